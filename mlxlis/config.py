"""ModelConfig: one frozen description of a decoder, from config.json or GGUF metadata.

Per-family differences are data here (bias on q/k/v, tying, rope θ, norms, softcaps), so the
model code reads fields instead of branching on the family name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError, UnsupportedError
from .loading import limits

# model_type in config.json -> family implemented here
MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama's attention_bias also covers o_proj)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma family fields (defaults are the Llama behaviour)
    rope_local: RopeConfig | None = None  # RoPE of sliding-window layers (Gemma 3)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # MLX quantization from config.json ({"group_size", "bits", per-layer overrides}) or None
    quantization: dict[str, Any] | None = field(default=None, compare=False)
    source: str = ""

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(base)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


def _req(cfg: dict, key: str, path: str, typ: type = int) -> Any:
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


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_rope(params: dict | None, theta: float | None, path: str, fld: str) -> RopeConfig:
    """A RopeConfig from a classic `rope_scaling` dict or a transformers-5 `rope_parameters`."""
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"expected an object, got {params!r}"[:200], path=path, field=fld)
    params = dict(params or {})
    theta = params.pop("rope_theta", theta)
    if theta is None:
        theta = 10000.0
    if not _number(theta) or theta <= 0:
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
    if not _number(factor) or factor <= 0:
        raise ConfigError(f"rope type {rtype} needs a positive factor", path=path, field=fld)
    if rtype == "linear":
        return RopeConfig(theta=float(theta), type="linear", factor=float(factor))
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


def _eos_list(value: Any, path: str, fld: str) -> tuple[int, ...]:
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
    from .loading.validate import read_json_file

    data = read_json_file(path, limits.CONFIG_JSON_MAX_BYTES, ConfigError, what=Path(path).name)
    if not isinstance(data, dict):
        raise ConfigError("expected a JSON object", path=path)
    return data


def config_from_hf(
    cfg: dict, path: str = "config.json", generation: dict | None = None
) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (classic or transformers-5 keys)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"expected a JSON object, got {type(cfg).__name__}", path=path)
    if generation is not None and not isinstance(generation, dict):
        raise ConfigError("generation config is not a JSON object", path=path)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        known = ", ".join(sorted(MODEL_TYPES))
        raise UnsupportedError(
            f"model_type {model_type!r} is not supported (known: {known})",
            path=path,
            field="model_type",
        )
    family = MODEL_TYPES[model_type]
    quant = cfg.get("quantization", cfg.get("quantization_config"))
    if "text_config" in cfg:  # multimodal wrapper (gemma3): the decoder lives in text_config
        text = cfg["text_config"]
        if not isinstance(text, dict):
            raise ConfigError("expected an object", path=path, field="text_config")
        cfg = {**text, "model_type": text.get("model_type", model_type)}
    from .families import parse_family_config  # late import: families import config

    base = _common(cfg, family, path)
    try:
        base = parse_family_config(family, cfg, base, path)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
        # config.json is untrusted: a value of the wrong type is a bad file, not a crash
        raise ConfigError(f"malformed value ({type(e).__name__}: {e})"[:300], path=path) from None
    eos = _eos_list(cfg.get("eos_token_id"), path, "eos_token_id")
    if generation and generation.get("eos_token_id") is not None:
        eos = tuple(
            dict.fromkeys(eos + _eos_list(generation["eos_token_id"], path, "eos_token_id"))
        )
    bos = cfg.get("bos_token_id")
    if generation and generation.get("bos_token_id") is not None:
        bos = generation["bos_token_id"]
    return base.with_(
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        quantization=quant if isinstance(quant, dict) else None,
    )


def _common(cfg: dict, family: str, path: str) -> ModelConfig:
    hidden = _req(cfg, "hidden_size", path)
    heads = _req(cfg, "num_attention_heads", path)
    kv_heads = cfg.get("num_key_value_heads") or heads
    max_pos = cfg.get("max_position_embeddings") or 4096
    if isinstance(max_pos, float) and max_pos.is_integer():
        max_pos = int(max_pos)
    sizes = {  # the bounds GGUF metadata gets too (limits.check_sizes)
        "hidden_size": ("hidden_size", hidden),
        "num_attention_heads": ("num_attention_heads", heads),
        "num_key_value_heads": ("num_key_value_heads", kv_heads),
        "intermediate_size": ("intermediate_size", _req(cfg, "intermediate_size", path)),
        "num_hidden_layers": ("num_hidden_layers", _req(cfg, "num_hidden_layers", path)),
        "vocab_size": ("vocab_size", _req(cfg, "vocab_size", path)),
        "max_position_embeddings": ("max_position_embeddings", max_pos),
    }
    size = limits.check_sizes(sizes, path)  # integers from here on
    hidden, heads, kv_heads = size["hidden_size"], size["num_attention_heads"], size[
        "num_key_value_heads"
    ]
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
    if rope_params is not None:
        rope = parse_rope(rope_params, cfg.get("rope_theta"), path, "rope_parameters")
    else:
        rope = parse_rope(cfg.get("rope_scaling"), cfg.get("rope_theta"), path, "rope_scaling")
    eps = cfg.get("rms_norm_eps")
    eps = 1e-6 if eps is None else eps
    if not _number(eps) or eps < 0:
        raise ConfigError(f"expected a small positive number, got {eps!r}"[:200], path=path,
                          field="rms_norm_eps")  # fmt: skip
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if not isinstance(act, str):
        raise ConfigError(f"expected a string, got {act!r}"[:200], path=path, field="hidden_act")
    return ModelConfig(
        family=family,
        vocab_size=size["vocab_size"],
        hidden_size=hidden,
        intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope=rope,
        max_position_embeddings=size["max_position_embeddings"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.startswith("gemma"))),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=act,
        source=path,
    )
