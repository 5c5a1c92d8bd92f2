"""Gemma 3n (text): E2B / E4B. This module: the family, config.json and GGUF metadata parsing,
`convert`'s keys; gemma3n_net.py the network (Gemma 4's attention, caches and per-layer inputs
with AltUp streams, LAuReL and the sparse MLP gate).

HF `gemma3n_text` and the multimodal `gemma3n` wrapper (the language model under
`model.language_model.`; the audio tower and its embedder are read where the folder has the
feature extractor's settings (gemma3n_hearing.py), the vision tower and its embedder are
skipped and said). config.json: layer_types (default: every 5th layer full), RoPE θ per layer
type from rope_parameters or rope_theta / rope_local_base_freq (default RoPE only),
intermediate_size one value or one per layer, activation_sparsity_pattern one per layer
(default: 0.95 on the first 10 of more than 10 layers), altup_num_inputs / altup_active_idx /
altup_correct_scale, laurel_rank, num_kv_shared_layers (the last layers reuse the K/V of the
last earlier layer of their type), hidden_size_per_layer_input, final_logit_softcapping.
GGUF `gemma3n` (llama.cpp's Gemma3NModel): norms as they are (x̂·w), the altup projections
stacked on one tensor each, per-layer Φ⁻¹ values (`activation_sparsity_scale`, −∞ for a dense
layer), the embeddings padded with zero rows to the whole vocabulary. llama.cpp's graph fixes
some of this for E2B / E4B (K/V from layer 20 on shared, sparsity in the first 10 layers at
0.95, 4 streams) where the file states it; mlxlis reads the file's keys, which say the same for
those two models, and a population standard deviation in the sparse gate as transformers does
(llama.cpp divides by n − 1).
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import CONFIG_MAX_DIM, check_sizes
from mlxlis.models.base import (
    LANGUAGE_MODEL_RENAMES,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import MLPConfig, ModelConfig, RopeConfig
from mlxlis.models.gemma3n_describe import DESCRIPTION
from mlxlis.models.gemma3n_hearing import load_hearing
from mlxlis.models.gemma3n_net import AltUpStructure, Gemma3n
from mlxlis.models.gemma4 import int_key, kv_sources
from mlxlis.models.gemma4_gguf import BOUNDS as GEMMA4_BOUNDS
from mlxlis.models.gemma4_gguf import GGUF_BLOCK as GEMMA4_BLOCK
from mlxlis.models.gemma4_gguf import GGUF_TOP as GEMMA4_TOP
from mlxlis.models.gemma4_gguf import layer_types, per_layer, unused_kv
from mlxlis.models.gemma4_net import FULL, PLAIN_ACTS, SLIDING, structure_fields

import numpy as np

# its own sizes beside Gemma 4's (limits.check_sizes): the residual streams (the active
# one's index) and the LAuReL rank
BOUNDS = {
    **GEMMA4_BOUNDS,
    "altup_num_inputs": 64,
    "altup_active_idx": 64,
    "laurel_rank": CONFIG_MAX_DIM,
}
_int = functools.partial(int_key, bounds=BOUNDS)

HF_DEFAULTS = {  # transformers' Gemma3nTextConfig, for the keys the shared parser reads
    "vocab_size": 262400,
    "hidden_size": 2048,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
}
THETA = {FULL: 1e6, SLIDING: 1e4}  # transformers' default_theta
OLD_THETA_KEYS = {FULL: "rope_theta", SLIDING: "rope_local_base_freq"}


def hf_base(cfg: dict) -> dict:
    """The keys the shared parser reads: a per-layer intermediate_size as its first value
    (parse_hf reads the whole list)."""
    size = cfg.get("intermediate_size", 16384)
    if isinstance(size, list) and size:
        return {**cfg, "intermediate_size": size[0]}
    return {**cfg, "intermediate_size": size}


def _number(v: Any, path: str, fld: str, ok=lambda x: True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
        raise ConfigError(f"bad value {v!r}"[:100], path=path, field=fld)
    return float(v)


def _flag(cfg: dict, key: str, default: bool, path: str) -> bool:
    v = cfg.get(key, default)
    if not isinstance(v, bool):  # transformers' strict config: a bool, not null or "false"
        raise ConfigError(f"expected true or false, got {v!r}"[:100], path=path, field=key)
    return v


def _per_layer_list(cfg: dict, key: str, n: int, default: list, path: str) -> list:
    v = cfg.get(key)
    v = default if v is None else v
    if not isinstance(v, list) or len(v) != n:
        raise ConfigError(f"expected {n} values, got {v!r}"[:200], path=path, field=key)
    return v


def _layer_types(cfg: dict, n: int, path: str) -> tuple[str, ...]:
    default = [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n)]
    types = _per_layer_list(cfg, "layer_types", n, default, path)
    if any(t not in (SLIDING, FULL) for t in types):
        raise ConfigError(
            f"expected {SLIDING} or {FULL}, got {types!r}"[:300], path=path, field="layer_types"
        )
    return tuple(types)


def _theta(cfg: dict, kind: str, path: str) -> float:
    """transformers' per-type θ: rope_parameters[kind], else the classic key, else its default;
    any RoPE type other than default is refused."""
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError("expected an object", path=path, field="rope_parameters")
    p = (params or {}).get(kind)
    if cfg.get("rope_scaling") is not None:
        raise UnsupportedError(
            "RoPE scaling is not implemented for Gemma 3n", path=path, field="rope_scaling"
        )
    if p is None:
        theta, fld = cfg.get(OLD_THETA_KEYS[kind], THETA[kind]), OLD_THETA_KEYS[kind]
    else:
        fld = f"rope_parameters.{kind}"
        if not isinstance(p, dict):
            raise ConfigError(f"expected an object, got {p!r}"[:200], path=path, field=fld)
        if p.get("rope_type", "default") != "default":
            raise UnsupportedError(
                f"rope type {p.get('rope_type')!r} is not implemented for Gemma 3n"[:200],
                path=path,
                field=f"{fld}.rope_type",
            )
        theta, fld = p.get("rope_theta", cfg.get(OLD_THETA_KEYS[kind], THETA[kind])), fld
    return _number(theta, path, fld, lambda x: x > 0)


def sparsity_std(p: float) -> float | None:
    """Φ⁻¹(p), the gate's cutoff in standard deviations, as torch's Normal(0, 1).icdf rounds
    it in float32 (√2 · erfinv(2p − 1), each step in float32); None for p = 0, a dense layer."""
    if p <= 0:
        return None
    x = np.float32(2) * np.float32(p) - np.float32(1)
    erfinv = np.float32(NormalDist().inv_cdf((float(x) + 1) / 2) / math.sqrt(2))
    return float(erfinv * np.float32(math.sqrt(2)))


def _structure(base: ModelConfig, **own: Any) -> AltUpStructure:
    """Gemma 4's Structure for one head shape and default RoPE, with Gemma 3n's own fields."""
    return AltUpStructure(
        global_head_dim=base.head_dim,
        global_kv_heads=base.num_key_value_heads,
        k_eq_v=False,
        full_rope_dims=base.head_dim,
        full_rotated=None,
        local_rope_dims=base.head_dim,
        local_rotated=None,
        **own,
    )


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    n = base.num_hidden_layers
    types = _layer_types(cfg, n, path)
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in PLAIN_ACTS:
        raise UnsupportedError(
            f"activation {act!r} is not implemented"[:200], path=path, field="hidden_activation"
        )
    size = cfg.get("intermediate_size", 16384)
    sizes = (
        _per_layer_list(cfg, "intermediate_size", n, [size] * n, path)
        if isinstance(size, list)
        else [size] * n
    )
    sizes = [
        _int({"intermediate_size": s}, "intermediate_size", None, path, fld="intermediate_size")
        for s in sizes
    ]
    default_sparsity = [0.95] * 10 + [0.0] * (n - 10) if n > 10 else [0.0] * n
    pattern = _per_layer_list(cfg, "activation_sparsity_pattern", n, default_sparsity, path)
    stds = tuple(
        # < 1 in float32, where transformers takes Φ⁻¹ (1 would be +∞)
        sparsity_std(
            _number(p, path, "activation_sparsity_pattern", lambda x: 0 <= np.float32(x) < 1)
        )
        for p in pattern
    )
    shared = _int(cfg, "num_kv_shared_layers", 15, path, low=0)
    if shared >= n:
        raise ConfigError(
            f"{shared} of {n} layers cannot all share K/V", path=path, field="num_kv_shared_layers"
        )
    streams = _int(cfg, "altup_num_inputs", 4, path, low=2)
    active = _int(cfg, "altup_active_idx", 0, path, low=0)
    if active >= streams:
        raise ConfigError(f"stream {active} of {streams}", path=path, field="altup_active_idx")
    softcap = cfg.get("final_logit_softcapping", 30.0)
    if softcap is not None:
        softcap = _number(softcap, path, "final_logit_softcapping", lambda x: x > 0)
    clip = cfg.get("altup_coef_clip", 120.0)
    structure = _structure(
        base,
        kv_source=kv_sources(types, shared, path, "num_kv_shared_layers"),
        intermediate_sizes=tuple(sizes),
        per_layer_dim=_int(cfg, "hidden_size_per_layer_input", 256, path),
        per_layer_vocab=_int(cfg, "vocab_size_per_layer_input", 262144, path),
        altup_num_inputs=streams,
        altup_active_idx=active,
        altup_correct_scale=_flag(cfg, "altup_correct_scale", True, path),
        laurel_rank=_int(cfg, "laurel_rank", 64, path),
        sparsity_std=stds,
        altup_coef_clip=None if clip is None else _number(clip, path, "altup_coef_clip"),
    )
    tied = _flag(cfg, "tie_word_embeddings", True, path)
    rope, local = (RopeConfig(theta=_theta(cfg, t, path)) for t in (FULL, SLIDING))
    window = _int(cfg, "sliding_window", 512, path)
    return base.with_(
        **structure_fields(base, softcap, local, window),
        mlp=MLPConfig(sizes[0], act),
        tie_word_embeddings=tied,
        rope=rope,
        layer_types=types,
        family_config=structure,
    )


# --- GGUF (llama.cpp's Gemma3NModel) ---


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    n, path, shapes = base.num_hidden_layers, m.path, m.shapes
    types = layer_types(m, n)
    for key in ("attention.value_length", "rope.dimension_count"):
        if m.get(key, base.head_dim) != base.head_dim:
            raise UnsupportedError(f"not the head dim {base.head_dim}", path=path, field=m.key(key))
    shared = m.get("attention.shared_kv_layers", 0)
    if not 0 <= shared < n:
        raise ConfigError(
            f"{shared} KV-shared layers of {n}",
            path=path,
            field=m.key("attention.shared_kv_layers"),
        )
    scales = m.md.get(m.key("activation_sparsity_scale"))
    if not isinstance(scales, np.ndarray) or scales.shape != (n,) or np.isnan(scales).any():
        raise ConfigError(
            f"expected {n} numbers, got {scales!r}"[:200],
            path=path,
            field=m.key("activation_sparsity_scale"),
        )
    if (scales == np.inf).any():
        raise ConfigError("a cutoff of +∞", path=path, field=m.key("activation_sparsity_scale"))
    stds = tuple(None if s == -math.inf else float(np.float32(s)) for s in scales.tolist())
    ple = m.get("embedding_length_per_layer_input")
    rows, width = shapes.get("per_layer_token_embd.weight", (0, 0))
    if width != n * ple:
        raise ConfigError(
            f"expected a per-layer embedding of width {n} × {ple}",
            path=path,
            field="per_layer_token_embd.weight",
        )
    streams = m.get("altup.num_inputs", 4)
    active = m.get("altup.active_idx", 0)
    if streams < 2 or not 0 <= active < streams:
        raise ConfigError(
            f"stream {active} of {streams}", path=path, field=m.key("altup.active_idx")
        )
    for top in ("altup_proj.weight", "altup_unembd_proj.weight"):
        if shapes.get(top, (0,))[0] != streams - 1:
            raise ConfigError(f"expected {streams - 1} stacked projections", path=path, field=top)
    rank = shapes.get("blk.0.laurel_l.weight", (0,))[0]
    check_sizes(
        {
            "hidden_size_per_layer_input": (m.key("embedding_length_per_layer_input"), ple),
            "vocab_size_per_layer_input": ("per_layer_token_embd.weight", rows),
            "laurel_rank": ("blk.0.laurel_l.weight", rank),
        },
        path,
        BOUNDS,
    )
    window = m.get("attention.sliding_window")
    check_sizes({"sliding_window": (m.key("attention.sliding_window"), window)}, path)
    ffn = per_layer(m, "feed_forward_length", n, "intermediate_size")
    structure = _structure(
        base,
        kv_source=_gguf_sources(types, shared, m),
        intermediate_sizes=ffn,
        per_layer_dim=ple,
        per_layer_vocab=rows,
        altup_num_inputs=streams,
        altup_active_idx=active,
        laurel_rank=rank,
        sparsity_std=stds,
    )
    local = RopeConfig(theta=m.get("rope.freq_base_swa", 10000.0, float))
    # llama.cpp's gemma3n never reads the key and caps at 30 (what the converter writes)
    cap = m.get("final_logit_softcapping", 30.0, float) or None
    return base.with_(
        **structure_fields(base, cap, local, window),
        mlp=MLPConfig(ffn[0], "gelu_pytorch_tanh"),
        layer_types=types,
        rope=RopeConfig(theta=base.rope.theta),
        family_config=structure,
    )


def _gguf_sources(types: tuple[str, ...], shared: int, m: GGUFMeta) -> tuple[int, ...]:
    """llama.cpp: a KV-shared sliding layer reads the cache of layer first-2, a full one
    first-1; a file where those are not the last layers of each type is refused."""
    n = len(types)
    source = kv_sources(types, shared, m.path, m.key("attention.shared_kv_layers"))
    first = n - shared
    for i in range(first, n):
        if source[i] != first - (2 if types[i] == SLIDING else 1):
            raise UnsupportedError(
                f"llama.cpp would have layer {i} ({types[i]}) read another layer's cache",
                path=m.path,
                field=m.key("attention.shared_kv_layers"),
            )
    return source


GGUF_BLOCK = {
    **GEMMA4_BLOCK,
    "altup_correct_coef": "altup.correction_coefs",
    "altup_correct_scale.weight": "altup.correct_output_scale",  # the converter adds .weight
    "altup_predict_coef": "altup.prediction_coefs",
    "altup_router": "altup.modality_router",
    "altup_router_norm": "altup.router_norm",
    "laurel_l": "laurel.linear_left",
    "laurel_r": "laurel.linear_right",
    "laurel_post_norm": "laurel.post_laurel_norm",
}


def gguf_name(name: str) -> str | None:
    return GEMMA4_TOP.get(name)


# --- convert: config.json keys transformers and mlx-lm read ---


def export(cfg: ModelConfig) -> dict[str, Any]:
    s: AltUpStructure = cfg.own(AltUpStructure)
    if not cfg.tie_word_embeddings:  # mlx-lm's gemma3n heads with the embedding, always
        raise UnsupportedError(
            "an untied Gemma 3n has no form mlx-lm reads", path=cfg.source, field="lm_head"
        )
    n, types = cfg.num_hidden_layers, cfg.layer_types
    shared = sum(src != i for i, src in enumerate(s.kv_source))
    # Φ back to the sparsity transformers reads (it recomputes Φ⁻¹ from it)
    pattern = [0.0 if x is None else float(np.float32(NormalDist().cdf(x))) for x in s.sparsity_std]
    if [sparsity_std(p) for p in pattern] != list(s.sparsity_std):
        raise UnsupportedError(
            "these activation sparsity cutoffs have no config.json form",
            path=cfg.source,
            field="activation_sparsity_pattern",
        )
    return {
        "hidden_activation": cfg.mlp.hidden_act,
        "layer_types": list(types),
        "sliding_window": cfg.attention.sliding_window,
        "final_logit_softcapping": cfg.norms.final_logit_softcapping,
        # transformers 5's rope_parameters and the classic keys mlx-lm reads
        "rope_parameters": {
            FULL: {"rope_type": "default", "rope_theta": cfg.rope.theta},
            SLIDING: {"rope_type": "default", "rope_theta": cfg.attention.rope_local.theta},
        },
        "rope_theta": cfg.rope.theta,
        "rope_local_base_freq": cfg.attention.rope_local.theta,
        "intermediate_size": list(s.intermediate_sizes),
        "activation_sparsity_pattern": pattern,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": s.per_layer_dim,
        "vocab_size_per_layer_input": s.per_layer_vocab,
        "altup_num_inputs": s.altup_num_inputs,
        "altup_active_idx": s.altup_active_idx,
        "altup_correct_scale": s.altup_correct_scale,
        "altup_coef_clip": s.altup_coef_clip,  # training-only in transformers; mlx-lm clips
        "laurel_rank": s.laurel_rank,
        "num_hidden_layers": n,
    }


def export_copies(cfg: ModelConfig) -> dict[str, str]:
    """mlx-lm loads K/V weights on the KV-shared layers (the hub's checkpoints carry them;
    transformers and mlxlis drop them): their source layer's, written again."""
    out = {}
    for i, src in enumerate(cfg.own(AltUpStructure).kv_source):
        if src != i:
            for m in ("k_proj", "v_proj", "k_norm"):
                out[f"model.layers.{i}.self_attn.{m}"] = f"model.layers.{src}.self_attn.{m}"
    return out


_TOWERS = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")

GEMMA3N = Family(
    name="gemma3n",
    hf=HFFormat(
        model_types=("gemma3n_text", "gemma3n"),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
        base=hf_base,
        renames=LANGUAGE_MODEL_RENAMES,
        dropped=_TOWERS + tuple(f"model.{t}" for t in _TOWERS),
    ),
    gguf=GGUFFormat(
        archs=("gemma3n",),
        parse=parse_gguf,
        block=GGUF_BLOCK,
        names=gguf_name,
        per_layer_keys=("feed_forward_length",),
        ignored=unused_kv,
        stacked={
            "altup_proj.weight": "model.altup_projections.{}.weight",
            "altup_unembd_proj.weight": "model.altup_unembed_projections.{}.weight",
        },
    ),
    network=Gemma3n,
    vision=load_hearing,  # the audio tower, where the folder has it and its extractor's settings
    export=Export(
        model_type="gemma3n_text",
        architecture="Gemma3nForConditionalGeneration",
        config=export,
        wrapper="gemma3n",  # mlx-lm reads the wrapper type only, its tensors under:
        renames=(("model.", "model.language_model."),),
        copies=export_copies,
    ),
    describe=DESCRIPTION,
)
