"""Gemma 1, 2 and 3 (text): three families on the shared decoder, their differences as data.

  Gemma 1: pre-norm blocks, GeGLU, x̂·(1 + w) RMSNorm, embedding × √hidden, tied head.
  Gemma 2: + sandwich norms, attention-logit and final-logit softcaps,
           scale 1/√query_pre_attn_scalar, every other layer sliding-window.
  Gemma 3: + q/k norms, 5 sliding layers per global one, a local RoPE base for sliding layers,
           global RoPE with linear scaling, usually no softcaps.
HF `gemma` / `gemma2` / `gemma3_text` (and the multimodal `gemma3`, whose language model is
read, and its vision tower and projector with it where the folder has an image processor's
settings: gemma3_vision.py); GGUF `gemma` / `gemma2` / `gemma3`. llama.cpp's converter adds
1 to every norm weight (Gemma computes x̂·(1 + w)); the loader subtracts it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.activations import GATED
from mlxlis.models.base import (
    GGUF_LLAMA_BLOCK,
    LANGUAGE_MODEL_RENAMES,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import ModelConfig, RopeConfig, parse_rope
from mlxlis.models.conventions import NORM_MINUS_ONE
from mlxlis.models.decoder import Decoder
from mlxlis.models.gemma3_mmproj import PROJECTOR as GEMMA3_MMPROJ
from mlxlis.models.gemma3_vision import load_images

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class _Version:
    """What one Gemma generation is: transformers' defaults for keys a config may omit, and the
    structure llama.cpp assumes for its GGUF architecture."""

    hf_act_key: str  # Gemma 1 reads hidden_act (its legacy "gelu" is the tanh GELU)
    query_pre_attn_scalar: float | None  # None: the scale is 1/√head_dim, not configurable
    attn_softcap: float | None
    final_softcap: float | None
    sliding_window: int | None  # transformers' default
    pattern: int | None  # classic configs: every pattern-th layer is global; None: no sliding
    gguf_window: int = 0  # llama.cpp's default window
    local_rope: bool = False  # a separate RoPE base for sliding layers (Gemma 3)
    sandwich: bool = False
    qk_norm: bool = False


_V1 = _Version("hidden_act", None, None, None, None, None)
_V2 = _Version("hidden_activation", 256, 50.0, 30.0, 4096, 2, gguf_window=4096, sandwich=True)
_V3 = _Version(
    "hidden_activation",
    256,
    None,
    None,
    4096,
    6,
    gguf_window=512,
    local_rope=True,
    sandwich=True,
    qk_norm=True,
)


def _positive(cfg: dict, key: str, default: Any, path: str) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(
            f"expected a positive number or null, got {value!r}", path=path, field=key
        )
    return value


def _structure(
    v: _Version, base: ModelConfig, final_softcap: float | None, **attention: Any
) -> dict[str, Any]:
    """The norms every Gemma has (final_softcap: the final logits' cap), and its attention's
    q/k norms with `attention`'s fields."""
    norms = replace(
        base.norms,
        kind="rms_plus_one",
        embed_scale=True,
        residual_f32=True,
        sandwich=v.sandwich,
        final_logit_softcapping=final_softcap,
    )
    return dict(norms=norms, attention=replace(base.attention, qk_norm=v.qk_norm, **attention))


def _act(cfg: dict, v: _Version, path: str) -> str:
    if v.hf_act_key == "hidden_act":
        act = cfg.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    else:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GATED:
        raise UnsupportedError(
            f"activation {act!r} is not implemented", path=path, field=v.hf_act_key
        )
    return act


def _layer_types(cfg: dict, v: _Version, n: int, path: str) -> tuple[str, ...]:
    if v.pattern is None:
        return ()
    if cfg.get("layer_types") is not None:
        types = tuple(cfg["layer_types"])
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(
                f"expected {n} of {LAYER_TYPES}, got {cfg['layer_types']!r}",
                path=path,
                field="layer_types",
            )
        return types
    pattern = cfg.get("sliding_window_pattern", v.pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"bad pattern {pattern!r}", path=path, field="sliding_window_pattern")
    return tuple(LAYER_TYPES[(i + 1) % pattern != 0] for i in range(n))


def _ropes(cfg: dict, path: str) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3: global θ (+ linear scaling) for full layers, a local θ for sliding ones."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        rope = parse_rope(
            params.get("full_attention"),
            cfg.get("rope_theta", 1e6),
            path,
            "rope_parameters.full_attention",
        )
        local = parse_rope(
            params.get("sliding_attention"),
            cfg.get("rope_local_base_freq", 1e4),
            path,
            "rope_parameters.sliding_attention",
        )
        return rope, local
    if params is not None:
        rope = parse_rope(params, cfg.get("rope_theta", 1e6), path, "rope_parameters")
    else:
        rope = parse_rope(cfg.get("rope_scaling"), cfg.get("rope_theta", 1e6), path, "rope_scaling")
    theta = _positive(cfg, "rope_local_base_freq", 1e4, path)
    return rope, RopeConfig(theta=float(theta or 1e4))


def _hf_parser(v: _Version):
    def parse(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
        bidirectional = cfg.get("use_bidirectional_attention") or False
        if not isinstance(bidirectional, bool):
            raise ConfigError(
                f"expected true or false, got {bidirectional!r}"[:200],
                path=path,
                field="use_bidirectional_attention",
            )
        if bidirectional and not (Path(path).parent / "modules.json").is_file():
            raise UnsupportedError(  # EmbeddingGemma's flag: it pools, it never generates
                "a bidirectional Gemma embeds only: its folder needs modules.json with a "
                "Pooling module",
                path=path,
                field="use_bidirectional_attention",
            )
        layer_types = _layer_types(cfg, v, base.num_hidden_layers, path)
        window = _positive(cfg, "sliding_window", v.sliding_window, path)
        if window is not None:
            check_sizes({"sliding_window": ("sliding_window", window)}, path)
            if bidirectional:  # transformers: |q − k| < w // 2 + 1
                window = int(window) // 2 + 1
        if "sliding_attention" in layer_types and window is None:
            raise ConfigError(
                "sliding-window layers need a sliding_window", path=path, field="sliding_window"
            )
        rope, rope_local = _ropes(cfg, path) if v.local_rope else (base.rope, None)
        qpas = _positive(cfg, "query_pre_attn_scalar", v.query_pre_attn_scalar, path)
        act = _act(cfg, v, path)
        attn_cap = _positive(cfg, "attn_logit_softcapping", v.attn_softcap, path)
        final = _positive(cfg, "final_logit_softcapping", v.final_softcap, path)
        attention = dict(
            rope_local=rope_local,
            sliding_window=int(window) if window is not None and layer_types else None,
            query_pre_attn_scalar=(
                float(qpas) if qpas is not None and v.query_pre_attn_scalar else None
            ),
            logit_softcapping=attn_cap,
            # EmbeddingGemma: every position sees both ways (an encoder: decoder_encoder.py)
            causal=not bidirectional,
        )
        return base.with_(
            **_structure(v, base, final, **attention),
            mlp=replace(base.mlp, hidden_act=act),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            rope=rope,
            layer_types=layer_types,
        )

    return parse


def _gguf_parser(v: _Version, big_layers: int):
    """llama.cpp's reading of a Gemma GGUF; `big_layers`: the block count of the 27B model."""

    def parse(cfg: ModelConfig, m: GGUFMeta) -> ModelConfig:
        n = cfg.num_hidden_layers
        # llama.cpp: the 27B models scale by hidden/heads, every other size by head_dim
        qpas = cfg.head_dim if n != big_layers else cfg.hidden_size // cfg.num_attention_heads
        changes: dict[str, Any] = dict(mlp=replace(cfg.mlp, hidden_act="gelu_pytorch_tanh"))
        attention: dict[str, Any] = dict(query_pre_attn_scalar=float(qpas))
        if v.pattern is not None:
            window = m.get("attention.sliding_window", v.gguf_window)
            check_sizes({"sliding_window": (m.key("attention.sliding_window"), window)}, m.path)
            # llama.cpp: Gemma 2 slides on even layers; Gemma 3 on 5 of every 6
            types = tuple(LAYER_TYPES[(i + 1) % v.pattern != 0] for i in range(n))
            changes.update(layer_types=types)
            attention["sliding_window"] = window
        final = None
        if v.attn_softcap is not None:
            attention["logit_softcapping"] = m.get("attn_logit_softcapping", v.attn_softcap, float)
            final = m.get("final_logit_softcapping", v.final_softcap, float)
        if v.local_rope:
            attention["rope_local"] = RopeConfig(theta=10000.0)  # llama.cpp's local base
        return cfg.with_(**changes, **_structure(v, cfg, final, **attention))

    return parse


def _export(v: _Version):
    def export(cfg: ModelConfig) -> dict[str, Any]:
        q = cfg.attention.query_pre_attn_scalar
        out: dict[str, Any] = {
            "hidden_activation": cfg.mlp.hidden_act,
            "query_pre_attn_scalar": int(q) if q is not None and float(q).is_integer() else q,
        }
        if v.pattern is not None:
            out["sliding_window"] = cfg.attention.sliding_window
            out["layer_types"] = list(cfg.layer_types)
            if not cfg.attention.causal and cfg.attention.sliding_window:  # as the file said
                out["use_bidirectional_attention"] = True
                out["sliding_window"] = (cfg.attention.sliding_window - 1) * 2
        if v.attn_softcap is not None:
            out["attn_logit_softcapping"] = cfg.attention.logit_softcapping
            out["final_logit_softcapping"] = cfg.norms.final_logit_softcapping
        if v.local_rope:
            local = cfg.attention.rope_local
            out["rope_local_base_freq"] = local.theta if local else 10000.0
            pattern = _pattern(cfg.layer_types)
            if pattern:
                out["sliding_window_pattern"] = pattern
        return out

    return export


def _pattern(layer_types: tuple[str, ...]) -> int | None:
    """The period n of 'n-1 sliding then 1 full', if the layers follow one."""
    for n in range(1, len(layer_types) + 1):
        if all((t == "full_attention") == ((i + 1) % n == 0) for i, t in enumerate(layer_types)):
            return n
    return None


_GEMMA2_BLOCK = {
    **GGUF_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_BLOCK = {
    **_GEMMA2_BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}  # noqa: E501

GEMMA = Family(
    name="gemma",
    hf=HFFormat(
        model_types=("gemma",),
        parse=_hf_parser(_V1),
    ),
    gguf=GGUFFormat(
        archs=("gemma",),
        parse=_gguf_parser(_V1, 0),
        conventions=(NORM_MINUS_ONE,),
    ),
    network=Decoder,
    export=Export(
        model_type="gemma",
        architecture="GemmaForCausalLM",
        config=_export(_V1),
    ),
)
GEMMA2 = Family(
    name="gemma2",
    hf=HFFormat(
        model_types=("gemma2",),
        parse=_hf_parser(_V2),
    ),
    gguf=GGUFFormat(
        archs=("gemma2",),
        parse=_gguf_parser(_V2, 46),
        block=_GEMMA2_BLOCK,
        conventions=(NORM_MINUS_ONE,),
    ),
    network=Decoder,
    export=Export(
        model_type="gemma2",
        architecture="Gemma2ForCausalLM",
        config=_export(_V2),
    ),
)
GEMMA3 = Family(
    name="gemma3",
    hf=HFFormat(
        model_types=("gemma3_text", "gemma3"),
        parse=_hf_parser(_V3),
        # multimodal checkpoints: the hub's `language_model.model.*`, transformers 5's
        # `model.language_model.*`; the vision tower and projector are the text plan's dropped
        # names, loaded by `vision`
        renames=LANGUAGE_MODEL_RENAMES,
        dropped=(
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ),
    ),
    gguf=GGUFFormat(
        archs=("gemma3",),
        parse=_gguf_parser(_V3, 62),
        block=_GEMMA3_BLOCK,
        conventions=(NORM_MINUS_ONE,),  # q_norm / k_norm included
    ),
    network=Decoder,
    export=Export(
        model_type="gemma3_text",
        architecture="Gemma3ForCausalLM",
        config=_export(_V3),
    ),
    vision=load_images,
    mmproj=GEMMA3_MMPROJ,  # llama.cpp's "gemma3" projector
    warmup={  # GELU, a sliding window
        "model_type": "gemma3_text",
        "num_hidden_layers": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 16,
    },
)
