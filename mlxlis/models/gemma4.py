"""Gemma 4 (text): E2B / E4B (per-layer embeddings, KV sharing, double-wide MLPs), 31B and the
26B-A4B MoE. This module: the family, config.json parsing, `convert`'s keys; gemma4_net.py the
network, gemma4_gguf.py the GGUF metadata and names.

  layers     `layer_types`: sliding-window layers (head_dim, num_key_value_heads, default RoPE
             θ 1e4) and full layers with their own head dim and KV heads (global_head_dim,
             num_global_key_value_heads) and "proportional" RoPE (θ 1e6; the first
             partial_rotary_factor of each half turned, at frequencies over the whole head)
  attention  q/k RMSNorm x̂·w, a weightless RMSNorm on v, scale 1; attention_k_eq_v: full
             layers' values are their raw keys; the last num_kv_shared_layers layers reuse the
             K/V of the last earlier layer of their type
  blocks     sandwich norms; a scalar per layer; MoE (26B): a dense MLP plus routed experts,
             the router with its own norm and scale, per-expert scales; per-layer inputs (E2B)
HF `gemma4_text` and the multimodal `gemma4` (the language model is read; the vision and audio
towers are skipped). transformers ≥ 5.2x saves the full layers' shape as `per_layer_config`,
hub checkpoints as `global_head_dim` / `num_global_key_value_heads`: both are read. GGUF
`gemma4` (llama.cpp's Gemma4Model): norms stored as they are (x̂·w, no +1), proportional RoPE
as a `rope_freqs` tensor, per-layer arrays for head_count_kv and feed_forward_length.
Refused by name: bidirectional attention, RoPE types other than default / proportional,
per_layer_config overrides of anything but head_dim / num_key_value_heads or not uniform per
layer type, and `convert` of a GGUF (its RoPE is in rope_freqs values, not in config keys).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models import gemma4_gguf
from mlxlis.models.activations import GATED
from mlxlis.models.base import LANGUAGE_MODEL_RENAMES, Export, Family, GGUFFormat, HFFormat
from mlxlis.models.config import MLPConfig, ModelConfig, MoEConfig, RopeConfig
from mlxlis.models.gemma4_mmproj import PROJECTOR as MMPROJ
from mlxlis.models.gemma4_net import FULL, PLAIN_ACTS, SLIDING, Gemma4, Structure, structure_fields
from mlxlis.models.gemma4_vision import load_images

HF_DEFAULTS = {  # transformers' Gemma4TextConfig, for the keys the shared parser reads
    "vocab_size": 262144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
}
ROPE_DEFAULTS = {  # transformers' Gemma4TextConfig when rope_parameters is absent
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}


def int_key(
    cfg: dict,
    key: str,
    default: Any,
    path: str,
    low: int = 1,
    size: str = "",
    fld: str = "",
    bounds: Mapping[str, int] = gemma4_gguf.BOUNDS,
) -> int:
    """An integer ≥ low from `cfg` (default when absent or null), bounded as
    limits.SIZE_BOUNDS or `bounds` bound `size` (`key` by default)."""
    v = cfg.get(key, default)
    v = default if v is None else v
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(
            f"expected an integer ≥ {low}, got {v!r}"[:200], path=path, field=fld or key
        )
    return check_sizes({size or key: (fld or key, v)}, path, bounds)[size or key] if v else v


def _layer_types(cfg: dict, n: int, path: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:  # transformers: 5 sliding layers per full one
        return tuple(SLIDING if (i + 1) % 6 else FULL for i in range(n))
    if (
        not isinstance(types, list)
        or len(types) != n
        or any(t not in (SLIDING, FULL) for t in types)
    ):
        raise ConfigError(
            f"expected {n} of {SLIDING}, {FULL}; got {types!r}"[:300],
            path=path,
            field="layer_types",
        )
    return (*types[:-1], FULL)  # transformers forces the last layer to full attention


def _full_shape(
    cfg: dict, base: ModelConfig, types: tuple[str, ...], path: str
) -> tuple[int, int, int, int]:
    """(sliding head_dim, sliding KV heads, full head_dim, full KV heads)."""
    plc = cfg.get("per_layer_config")
    if plc is None:  # the hub's keys; transformers: global KV heads only with attention_k_eq_v
        hd = int_key(cfg, "global_head_dim", 512, path)
        kv = base.num_key_value_heads
        if cfg.get("attention_k_eq_v"):
            kv = int_key(cfg, "num_global_key_value_heads", kv, path)
        shape, fld = (base.head_dim, base.num_key_value_heads, hd, kv), "num_global_key_value_heads"
    else:
        if not isinstance(plc, dict):
            raise ConfigError("expected an object", path=path, field="per_layer_config")
        per = {t: set() for t in (SLIDING, FULL)}
        layers = {str(i): {} for i in range(len(types))}
        for k, v in plc.items():
            if k not in layers or not isinstance(v, dict):
                raise ConfigError(
                    f"expected a layer index and an object, got {k!r}: {v!r}"[:200],
                    path=path,
                    field="per_layer_config",
                )
            for key in set(v) - {"head_dim", "num_key_value_heads"}:
                raise UnsupportedError(
                    "per-layer override not implemented",
                    path=path,
                    field=f"per_layer_config.{k}.{key}",
                )
            layers[k] = v
        for i, t in enumerate(types):
            v = layers[str(i)]
            sub = f"per_layer_config.{i}"
            per[t].add(
                (
                    int_key(v, "head_dim", base.head_dim, path, fld=f"{sub}.head_dim"),
                    int_key(
                        v,
                        "num_key_value_heads",
                        base.num_key_value_heads,
                        path,
                        fld=f"{sub}.num_key_value_heads",
                    ),
                )
            )
        if len(per[SLIDING]) > 1 or len(per[FULL]) > 1:
            raise UnsupportedError(
                "head_dim / num_key_value_heads must be uniform per layer type",
                path=path,
                field="per_layer_config",
            )
        s = next(iter(per[SLIDING]), (base.head_dim, base.num_key_value_heads))
        shape, fld = (*s, *next(iter(per[FULL]), s)), "per_layer_config"
    for kv in shape[1::2]:
        if base.num_attention_heads % kv:
            raise ConfigError(
                f"{kv} KV heads must divide {base.num_attention_heads} heads", path=path, field=fld
            )
    return shape


def _rope(params: Any, kind: str, head_dim: int, path: str) -> tuple[RopeConfig, int | None, float]:
    """transformers' per-type RoPE: "default" turns every dim; "proportional" the first
    int(partial_rotary_factor · head_dim // 2) pairs, frequencies over head_dim, ÷ factor."""
    fld = f"rope_parameters.{kind}"
    p = params.get(kind)
    if not isinstance(p, dict):
        raise ConfigError(f"expected an object, got {p!r}"[:200], path=path, field=fld)
    theta, rtype = p.get("rope_theta", ROPE_DEFAULTS[kind]["rope_theta"]), p.get("rope_type")
    factor, part = p.get("factor", 1.0), p.get("partial_rotary_factor", 1.0)
    for name, v, ok in (
        ("rope_theta", theta, lambda x: x > 0),
        ("factor", factor, lambda x: x > 0),
        ("partial_rotary_factor", part, lambda x: 0 < x <= 1),
    ):
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not (math.isfinite(v) and ok(v))
        ):
            raise ConfigError(f"bad value {v!r}"[:100], path=path, field=f"{fld}.{name}")
    if rtype in (None, "default"):
        return RopeConfig(theta=float(theta)), None, 1.0
    if rtype != "proportional":
        raise UnsupportedError(
            f"rope type {rtype!r} is not implemented for Gemma 4"[:200],
            path=path,
            field=f"{fld}.rope_type",
        )
    return RopeConfig(theta=float(theta)), int(part * head_dim // 2), float(factor)


def kv_sources(types: tuple[str, ...], shared: int, path: str, fld: str) -> tuple[int, ...]:
    """transformers: a KV-shared layer (one of the last `shared`) attends over the keys and values
    of the last earlier non-shared layer of its type."""
    first = len(types) - shared
    out = list(range(len(types)))
    for i in range(first, len(types)):
        src = [j for j in range(first) if types[j] == types[i]]
        if not src:
            raise ConfigError(
                f"layer {i} ({types[i]}) shares K/V but no earlier layer of its type has its own",
                path=path,
                field=fld,
            )
        out[i] = src[-1]
    return tuple(out)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    bidirectional = cfg.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision", "all"):
        raise ConfigError(
            f'expected "vision", "all" or null, got {bidirectional!r}'[:200],
            path=path,
            field="use_bidirectional_attention",
        )
    n = base.num_hidden_layers
    types = _layer_types(cfg, n, path)
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in GATED or act not in PLAIN_ACTS:
        raise UnsupportedError(
            f"activation {act!r} is not implemented"[:200], path=path, field="hidden_activation"
        )
    head, kv, g_head, g_kv = _full_shape(cfg, base, types, path)
    params = ROPE_DEFAULTS if cfg.get("rope_parameters") is None else cfg["rope_parameters"]
    if not isinstance(params, dict):
        raise ConfigError("expected an object", path=path, field="rope_parameters")
    rope, full_rot, full_factor = (
        _rope(params, FULL, g_head, path) if FULL in types else (base.rope, None, 1.0)
    )
    local, local_rot, local_factor = (
        _rope(params, SLIDING, head, path) if SLIDING in types else (rope, None, 1.0)
    )
    shared = int_key(cfg, "num_kv_shared_layers", 0, path, low=0)
    if shared >= n:
        raise ConfigError(
            f"{shared} of {n} layers cannot all share K/V", path=path, field="num_kv_shared_layers"
        )
    source = kv_sources(types, shared, path, "num_kv_shared_layers")
    double = bool(cfg.get("use_double_wide_mlp", False))
    sizes = tuple(
        base.mlp.intermediate_size * (2 if double and src != i else 1)
        for i, src in enumerate(source)
    )
    ple = int_key(cfg, "hidden_size_per_layer_input", 256, path, low=0)
    moe = None
    if cfg.get("enable_moe_block"):
        e, k = (
            int_key(cfg, "num_experts", None, path),
            int_key(cfg, "top_k_experts", None, path, size="num_experts_per_tok"),
        )
        if k > e:
            raise ConfigError(f"{k} experts per token of {e}", path=path, field="top_k_experts")
        width = int_key(cfg, "moe_intermediate_size", None, path)
        moe = MoEConfig(e, k, width, (True,) * n, norm_topk_prob=True)
    window = int_key(cfg, "sliding_window", 512, path)
    softcap = cfg.get("final_logit_softcapping")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not 0 < softcap < math.inf
    ):
        raise ConfigError(
            f"expected a positive number or null, got {softcap!r}"[:200],
            path=path,
            field="final_logit_softcapping",
        )
    structure = Structure(
        global_head_dim=g_head,
        global_kv_heads=g_kv,
        k_eq_v=bool(cfg.get("attention_k_eq_v")),
        kv_source=source,
        intermediate_sizes=sizes,
        full_rope_dims=g_head,
        full_rotated=full_rot,
        local_rope_dims=head,
        local_rotated=local_rot,
        full_rope_factor=full_factor,
        local_rope_factor=local_factor,
        per_layer_dim=ple,
        per_layer_vocab=int_key(cfg, "vocab_size_per_layer_input", 262144, path) if ple else 0,
        bidirectional=bidirectional,
    )
    return base.with_(
        **structure_fields(
            base,
            float(softcap) if softcap is not None else None,
            local,
            window,
            causal=bidirectional != "all",  # "all": an encoder (Model.logits only)
        ),
        moe=moe,
        mlp=MLPConfig(base.mlp.intermediate_size, act),
        head_dim=head,
        num_key_value_heads=kv,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope=rope,
        layer_types=types,
        family_config=structure,
    )


# --- convert: config.json keys transformers and mlx-lm read ---


def _rope_out(theta: float, rotated: int | None, dims: int, factor: float) -> dict[str, Any]:
    if rotated is None and factor == 1:
        return {"rope_type": "default", "rope_theta": theta}
    part = 1.0 if rotated is None else 2 * rotated / dims
    if rotated is not None and int(part * dims // 2) != rotated:  # read back as transformers does
        part = math.nextafter(part, 2.0)
    return {
        "rope_type": "proportional",
        "partial_rotary_factor": part,
        "rope_theta": theta,
        "factor": factor,
    }


def export(cfg: ModelConfig) -> dict[str, Any]:
    s: Structure = cfg.own(Structure)
    n, types, moe = cfg.num_hidden_layers, cfg.layer_types, cfg.moe
    shared = sum(src != i for i, src in enumerate(s.kv_source))
    double = s.intermediate_sizes != (cfg.mlp.intermediate_size,) * n
    hf = (
        not s.fused_gate_up
        and s.kv_source == kv_sources(types, shared, cfg.source, "")
        and s.intermediate_sizes
        in (
            (cfg.mlp.intermediate_size,) * n,
            tuple(
                cfg.mlp.intermediate_size * (2 if src != i else 1)
                for i, src in enumerate(s.kv_source)
            ),
        )
        and (moe is None or len(set(moe.sparse_layers)) <= 1)
        and (s.full_rope_dims, s.local_rope_dims) == (s.global_head_dim, cfg.head_dim)
    )
    if not hf:
        raise UnsupportedError(
            "this Gemma 4 layout (from a GGUF) has no config.json form",
            path=cfg.source,
            field="gemma4",
        )
    full = {"head_dim": s.global_head_dim, "num_key_value_heads": s.global_kv_heads}
    return {
        "hidden_activation": cfg.mlp.hidden_act,
        "layer_types": list(types),
        "sliding_window": cfg.attention.sliding_window,
        "attention_bias": cfg.attention.bias,
        "final_logit_softcapping": cfg.norms.final_logit_softcapping,
        "rope_parameters": {
            FULL: _rope_out(cfg.rope.theta, s.full_rotated, s.full_rope_dims, s.full_rope_factor),
            SLIDING: _rope_out(
                cfg.attention.rope_local.theta, s.local_rotated, cfg.head_dim, s.local_rope_factor
            ),
        },
        # the hub's keys (mlx-lm reads these) and transformers 5's per_layer_config
        "global_head_dim": s.global_head_dim,
        "num_global_key_value_heads": s.global_kv_heads,
        "per_layer_config": {str(i): full for i, t in enumerate(types) if t == FULL},
        "attention_k_eq_v": s.k_eq_v,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double,
        "hidden_size_per_layer_input": s.per_layer_dim,
        "vocab_size_per_layer_input": s.per_layer_vocab or cfg.vocab_size,
        "enable_moe_block": moe is not None,
        "num_experts": moe.num_experts if moe else None,
        "top_k_experts": moe.num_experts_per_tok if moe else None,
        "moe_intermediate_size": moe.intermediate_size if moe else None,
        "use_bidirectional_attention": s.bidirectional,
    }


# multimodal checkpoints: transformers' `model.language_model.*` (mlx-lm saves
# `language_model.model.*`); the towers and their embedders are the text plan's dropped names
# (the vision ones loaded by `vision`, gemma4_vision.py; audio is not read)
_TOWERS = (
    "vision_tower.",
    "audio_tower.",
    "embed_vision.",
    "embed_audio.",
    "multi_modal_projector.",
    "vision_embedder.",
)

GEMMA4 = Family(
    name="gemma4",
    hf=HFFormat(
        model_types=("gemma4_text", "gemma4"),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
        renames=LANGUAGE_MODEL_RENAMES,
        dropped=_TOWERS + tuple(f"model.{t}" for t in _TOWERS),
    ),
    gguf=GGUFFormat(
        archs=("gemma4",),
        parse=gemma4_gguf.parse_gguf,
        block=gemma4_gguf.GGUF_BLOCK,
        names=gemma4_gguf.gguf_name,
        # llama.cpp reads these per layer (get_key_or_arr); parse_gguf reads the whole arrays
        per_layer_keys=("attention.head_count_kv", "feed_forward_length"),
        rope_freqs=gemma4_gguf.rope_freqs_as_config,
        ignored=gemma4_gguf.unused_kv,
    ),
    network=Gemma4,
    export=Export(
        model_type="gemma4_text",
        architecture="Gemma4ForCausalLM",
        config=export,
    ),
    vision=load_images,  # the vision tower and embedder, where the folder has their processor
    mmproj=MMPROJ,  # llama.cpp's "gemma4v" projector
)
