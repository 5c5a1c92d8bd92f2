"""ModelConfig: one frozen description of a decoder, from config.json or GGUF metadata.

Per-family differences are data here (bias on q/k/v, tying, rope θ, norms, softcaps, experts),
so the network code reads fields instead of branching on the family name. Which family reads
which keys lives in that family's module (`mlxlis/models/`); this module knows no family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from mlxlis import limits
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.config_groups import (
    AttentionConfig,
    DeltaNetConfig,
    MLPConfig,
    MoEConfig,
    NormConfig,
    RopeConfig,
    SpecialTokens,
)

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
PER_TYPE_ROPE_TYPES = ("default", "linear", "llama3")  # under rope_parameters' layer types
# layer types whose state is recurrent: Gated DeltaNet, a gated short convolution (LFM2)
RECURRENT_TYPES = ("linear_attention", "conv")


class FamilyConfig:
    """A family's own structure beyond ModelConfig's shared fields (Gemma 4's per-type head
    dims, KV sharing, per-layer inputs, ...): a frozen dataclass in the family's module that
    subclasses this, held in `ModelConfig.family_config` and read with `ModelConfig.own`."""


F = TypeVar("F", bound=FamilyConfig)


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: RopeConfig
    norms: NormConfig
    mlp: MLPConfig
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    special: SpecialTokens = SpecialTokens()  # bos and eos ids
    # block structure (defaults are the Llama behaviour)
    attention: AttentionConfig = AttentionConfig()
    # per layer: "full_attention" | "sliding_attention" | "chunked_attention" |
    # "linear_attention" (Gated DeltaNet) | "conv" (a gated short convolution)
    layer_types: tuple[str, ...] = ()
    moe: MoEConfig | None = None  # a mixture of experts in its sparse layers
    deltanet: DeltaNetConfig | None = None  # Gated DeltaNet (linear attention) layers
    # what the fields above do not describe, typed by the family (e.g. Gemma 4's Structure)
    family_config: FamilyConfig | None = None
    # MLX quantization from config.json ({"group_size", "bits", per-layer overrides}) or None
    quantization: dict[str, Any] | None = field(default=None, compare=False)
    source: str = ""

    @property
    def attn_scale(self) -> float:
        scalar = self.attention.query_pre_attn_scalar
        if scalar:  # Gemma 2/3 scale by a configured constant
            return 1.0 / math.sqrt(scalar)
        return self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def is_chunked(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "chunked_attention"

    def is_ring(self, layer: int) -> bool:
        """The layer's keys are a bounded ring (sliding window or attention chunk)."""
        return self.is_sliding(layer) or self.is_chunked(layer)

    def ring_window(self, layer: int) -> int | None:
        """How many of the newest positions the layer's cache must hold (None: all)."""
        if self.is_chunked(layer):
            return self.attention.chunk_size
        return self.attention.sliding_window if self.is_sliding(layer) else None

    def has_rope(self, layer: int) -> bool:
        nope = self.attention.no_rope_layers
        return not (nope and nope[layer])

    def is_linear(self, layer: int) -> bool:
        """The layer keeps a recurrent state instead of keys (a RecurrentCache)."""
        return bool(self.layer_types) and self.layer_types[layer] in RECURRENT_TYPES

    @property
    def rewinds_anywhere(self) -> bool:
        """Every layer's cache returns exactly to any position it holds (full attention only:
        no sliding-window ring, no recurrent state), so snapshots are of no use to it."""
        n = self.num_hidden_layers
        return not any(self.is_ring(i) or self.is_linear(i) for i in range(n))

    def is_sparse(self, layer: int) -> bool:
        moe = self.moe
        return moe is not None and bool(moe.sparse_layers) and moe.sparse_layers[layer]

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    def own(self, kind: type[F]) -> F:
        """The family's own config, which must be a `kind` (a bug in the family otherwise)."""
        if not isinstance(self.family_config, kind):
            raise TypeError(
                f"{self.family} config holds {type(self.family_config).__name__}, "
                f"not {kind.__name__}"
            )
        return self.family_config


def required(cfg: dict, key: str, path: str, typ: type = int) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError("required field missing", path=path, field=key)
    value = cfg[key]
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"expected an integer, got {value!r}", path=path, field=key)
    if typ is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"expected a number, got {value!r}", path=path, field=key)
    if typ in (int, float) and not value > 0:  # NaN fails too
        raise ConfigError(f"must be positive, got {value!r}", path=path, field=key)
    return value


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_rope(params: dict | None, theta: float | None, path: str, fld: str) -> RopeConfig:
    """A RopeConfig from a classic `rope_scaling` dict or a transformers-5 `rope_parameters`."""
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"expected an object, got {params!r}"[:200], path=path, field=fld)
    params = dict(params or {})
    theta = params.pop("rope_theta", theta)
    if theta is None:
        theta = 10000.0
    if not number(theta) or theta <= 0:
        raise ConfigError(f"bad rope theta {theta!r}", path=path, field=fld)
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    if rtype not in ROPE_TYPES:
        raise UnsupportedError(
            f"rope type {rtype!r} is not implemented (supported: {', '.join(ROPE_TYPES)})",
            path=path,
            field=fld,
        )
    if rtype == "default":
        return RopeConfig(theta=float(theta))
    factor = params.get("factor")
    if not number(factor) or factor <= 0:
        raise ConfigError(f"rope type {rtype} needs a positive factor", path=path, field=fld)
    if rtype == "linear":
        return RopeConfig(theta=float(theta), type="linear", factor=float(factor))
    if rtype == "yarn":
        return _yarn(params, float(theta), float(factor), path, fld)
    try:
        return RopeConfig(
            theta=float(theta),
            type="llama3",
            factor=float(factor),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ConfigError(
            f"llama3 rope scaling lacks or mangles {e}", path=path, field=fld
        ) from None


def yarn_keys(r: RopeConfig) -> dict[str, Any]:
    """A yarn RopeConfig as transformers' rope keys (attention_factor and truncate stated:
    their defaults differ by model)."""
    return {
        "rope_type": "yarn",
        "factor": r.factor,
        "original_max_position_embeddings": r.original_max_position_embeddings,
        "beta_fast": r.beta_fast,
        "beta_slow": r.beta_slow,
        "truncate": r.truncate,
        "attention_factor": r.attention_factor,
    }


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scaling for a context `factor` (transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(params: dict, theta: float, factor: float, path: str, fld: str) -> RopeConfig:
    """transformers' _compute_yarn_parameters' inputs: attention_factor given, or from
    mscale / mscale_all_dim when both are, else from the factor."""
    orig = params.get("original_max_position_embeddings")
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise ConfigError(
            f"yarn needs a positive original_max_position_embeddings, got {orig!r}"[:200],
            path=path,
            field=fld,
        )
    vals = {}
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0), ("attention_factor", None)):
        v = params.get(key)
        if v is not None and (not number(v) or v < 0):
            raise ConfigError(
                f"yarn {key} must be a positive number, got {v!r}"[:200], path=path, field=fld
            )
        vals[key] = float(v) if v else default  # transformers: a 0 or null is the default
    if theta <= 1:  # its correction range divides by log θ
        raise ConfigError(f"yarn needs a rope theta above 1, got {theta!r}", path=path, field=fld)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(
            f"yarn truncate must be true or false, got {truncate!r}"[:200], path=path, field=fld
        )
    attn = vals["attention_factor"]
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        if m and m_all and number(m) and number(m_all):
            attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
        else:
            attn = yarn_mscale(factor)
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=vals["beta_fast"],
        beta_slow=vals["beta_slow"],
        truncate=truncate,
        attention_factor=attn,
    )


def eos_list(value: Any, path: str, fld: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ConfigError(f"expected an int or a list of ints, got {value!r}", path=path, field=fld)


def read_json(path: Path) -> dict:
    """A config JSON file, bounded: its size before parsing, its nesting after."""
    from mlxlis.bounded import read_json_file

    data = read_json_file(path, limits.CONFIG_JSON_MAX_BYTES, ConfigError, what=Path(path).name)
    if not isinstance(data, dict):
        raise ConfigError("expected a JSON object", path=path)
    return data


def base_config(cfg: dict, family: str, path: str) -> ModelConfig:
    """The fields every decoder shares, from config.json keys (classic or transformers 5); a
    family's module refines the result."""
    hidden = required(cfg, "hidden_size", path)
    heads = required(cfg, "num_attention_heads", path)
    kv_heads = cfg.get("num_key_value_heads") or heads
    max_pos = cfg.get("max_position_embeddings") or 4096
    if isinstance(max_pos, float) and max_pos.is_integer():
        max_pos = int(max_pos)
    sizes = {  # the bounds GGUF metadata gets too (limits.check_sizes)
        "hidden_size": ("hidden_size", hidden),
        "num_attention_heads": ("num_attention_heads", heads),
        "num_key_value_heads": ("num_key_value_heads", kv_heads),
        "intermediate_size": ("intermediate_size", required(cfg, "intermediate_size", path)),
        "num_hidden_layers": ("num_hidden_layers", required(cfg, "num_hidden_layers", path)),
        "vocab_size": ("vocab_size", required(cfg, "vocab_size", path)),
        "max_position_embeddings": ("max_position_embeddings", max_pos),
    }
    size = limits.check_sizes(sizes, path)  # integers from here on
    hidden, heads, kv_heads = (
        size["hidden_size"],
        size["num_attention_heads"],
        size["num_key_value_heads"],
    )
    if not kv_heads <= heads or heads % kv_heads:
        raise ConfigError(
            f"num_key_value_heads {kv_heads!r} must divide {heads}",
            path=path,
            field="num_key_value_heads",
        )
    head_dim = cfg.get("head_dim") or hidden // heads
    head_dim = limits.check_sizes({"head_dim": ("head_dim", head_dim)}, path)["head_dim"]
    rope_params = cfg.get("rope_parameters")
    if isinstance(rope_params, dict) and "full_attention" in rope_params:
        rope_params = rope_params["full_attention"]  # per layer type (Gemma 3): global layers
        # a type only its family implements (Gemma 4's "proportional"), or none of the
        # per-layer-type families does (yarn): the family parses it, and refuses what it lacks
        if isinstance(rope_params, dict) and rope_params.get("rope_type") not in (
            None,
            *PER_TYPE_ROPE_TYPES,
        ):
            rope_params = {"rope_theta": rope_params.get("rope_theta")}
    if rope_params is not None:
        rope = parse_rope(rope_params, cfg.get("rope_theta"), path, "rope_parameters")
    else:
        rope = parse_rope(cfg.get("rope_scaling"), cfg.get("rope_theta"), path, "rope_scaling")
    eps = cfg.get("rms_norm_eps")
    eps = 1e-6 if eps is None else eps
    if not number(eps) or eps < 0:
        raise ConfigError(
            f"expected a small positive number, got {eps!r}"[:200], path=path, field="rms_norm_eps"
        )
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if not isinstance(act, str):
        raise ConfigError(f"expected a string, got {act!r}"[:200], path=path, field="hidden_act")
    bias = cfg.get("attention_bias", False)
    return ModelConfig(
        family=family,
        vocab_size=size["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope=rope,
        norms=NormConfig(float(eps)),
        max_position_embeddings=size["max_position_embeddings"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention=AttentionConfig(bias=bool(bias), o_bias=bool(bias)),
        mlp=MLPConfig(
            size["intermediate_size"], hidden_act=act, bias=bool(cfg.get("mlp_bias", False))
        ),
        source=path,
    )
