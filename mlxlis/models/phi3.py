"""Phi-3 / Phi-4 / Phi-4-mini: Llama's pre-norm decoder with one q|k|v projection (qkv_proj: the
query rows, then the keys', then the values') and one gate|up projection (gate_up_proj: the
gate's rows first), RoPE on the first partial_rotary_factor of each head (Phi-4-mini: 0.75),
LongRoPE where configured (per-pair short / long factors over original_max_position_embeddings,
q and k scaled by the attention factor), a sliding window on every layer where set (Phi-3-mini
4k).

HF `phi3` (transformers' Phi3Config; rope_scaling's older types "su" and "yarn" read as
longrope, as it does); mlx-lm's layout is the same names. LongRoPE's factors are chosen per
pass as transformers chooses them: a pass whose positions stay within the original context
turns by the short factors, one reaching past it by the long ones. A sequence that grows past
the original context during decoding keeps its earlier keys as they were turned (transformers'
generate re-runs the whole prompt at that point).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.base import GGUF_LLAMA_BLOCK, Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig, RopeConfig
from mlxlis.models.decoder import Decoder, DecoderLayer
from mlxlis.models.layers import Attention
from mlxlis.models.reading import check_act
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

HF_DEFAULTS = {  # transformers' Phi3Config, for the keys the shared parser reads
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _rope_params(cfg: dict, path: str) -> tuple[dict, str]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    fld = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise ConfigError("expected an object", path=path, field=fld)
    return params, fld


def hf_base(cfg: dict) -> dict:
    """The keys the shared parser reads: θ alone (parse_hf reads LongRoPE itself)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = (
        params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if isinstance(params, dict)
        else None
    )
    return {
        **cfg,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
    }


def _number(v: Any, path: str, fld: str, ok=lambda x: x > 0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
        raise ConfigError(f"bad value {v!r}"[:100], path=path, field=fld)
    return float(v)


def _longrope(
    params: dict, cfg: dict, base: ModelConfig, dims: int, path: str, fld: str
) -> RopeConfig:
    """transformers' _compute_longrope_parameters' inputs."""
    orig = params.get(
        "original_max_position_embeddings", cfg.get("original_max_position_embeddings", 4096)
    )
    orig = check_sizes(
        {"max_position_embeddings": (f"{fld}.original_max_position_embeddings", orig)}, path
    )["max_position_embeddings"]
    factors = {}
    for key in ("short_factor", "long_factor"):
        v = params.get(key)
        if not isinstance(v, list) or len(v) != dims // 2:
            raise ConfigError(
                f"expected {dims // 2} numbers, got {v!r}"[:200], path=path, field=f"{fld}.{key}"
            )
        factors[key] = tuple(_number(x, path, f"{fld}.{key}") for x in v)
    factor = params.get("factor")
    factor = (
        base.max_position_embeddings / orig
        if factor is None
        else _number(factor, path, f"{fld}.factor")
    )
    attn = params.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return RopeConfig(
        theta=base.rope.theta,
        type="longrope",
        factor=factor,
        original_max_position_embeddings=orig,
        attention_factor=_number(attn, path, f"{fld}.attention_factor"),
        **factors,
    )


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    params, fld = _rope_params(cfg, path)
    part = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    part = _number(part, path, "partial_rotary_factor", lambda x: 0 < x <= 1)
    dims = int(base.head_dim * part)
    if dims % 2:
        raise ConfigError(f"{dims} rotary dims: not even", path=path, field="partial_rotary_factor")
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    rtype = "longrope" if rtype in ("su", "yarn") else rtype  # Phi3Config's reading of old types
    if rtype == "longrope":
        rope = _longrope(params, cfg, base, dims, path, fld)
    elif rtype == "default":
        rope = base.rope
    else:
        raise UnsupportedError(
            f"rope type {rtype!r} is not implemented for Phi-3 (default, longrope)"[:200],
            path=path,
            field=f"{fld}.rope_type",
        )
    window = cfg.get("sliding_window")
    if window is not None:
        window = check_sizes({"sliding_window": ("sliding_window", window)}, path)["sliding_window"]
    n = base.num_hidden_layers
    return check_act(
        base.with_(
            rope=rope,
            attention=replace(
                base.attention,
                rotary_dim=dims if dims != base.head_dim else None,
                fused_qkv=True,
                sliding_window=window,
            ),
            mlp=replace(base.mlp, fused_gate_up=True),
            layer_types=("sliding_attention",) * n if window else (),
        ),
        path,
    )


def export(cfg: ModelConfig) -> dict[str, Any]:
    r, dims = cfg.rope, cfg.attention.rotary_dim or cfg.head_dim
    part = dims / cfg.head_dim
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": r.theta,
        "partial_rotary_factor": part,
    }
    scaling = None
    if r.type == "longrope":
        long = {
            "short_factor": list(r.short_factor),
            "long_factor": list(r.long_factor),
            "factor": r.factor,
            "attention_factor": r.attention_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }
        rope.update(rope_type="longrope", **long)
        scaling = {"type": "longrope", **long}  # the classic key mlx-lm reads
    elif r.type != "default":
        raise UnsupportedError(
            f"writing a Phi-3 with {r.type} RoPE is not supported", path=cfg.source, field="rope"
        )
    return {
        "rope_parameters": rope,
        "rope_scaling": scaling,
        "rope_theta": r.theta,
        "partial_rotary_factor": part,
        "original_max_position_embeddings": r.original_max_position_embeddings
        if r.type == "longrope"
        else cfg.max_position_embeddings,
        "sliding_window": cfg.attention.sliding_window,
    }


# --- GGUF (llama.cpp's Phi3MiniModel: no Q/K permutation, NEOX RoPE) ---

GGUF_BLOCK = {
    **GGUF_LLAMA_BLOCK,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",  # llama.cpp's phi3: ffn_up holds the gate and up rows
}
ROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    """The converter's keys: rope.dimension_count (the rotary dims), rope.freq_base,
    rope.scaling.original_context_length and attn_factor with the LongRoPE factor tensors,
    attention.sliding_window (0: none, Phi-4)."""
    dims = m.get("rope.dimension_count", base.head_dim)
    if not 0 < dims <= base.head_dim or dims % 2:
        raise ConfigError(
            f"{dims} rotary dims for a head of {base.head_dim}",
            path=m.path,
            field=m.key("rope.dimension_count"),
        )
    window = m.get("attention.sliding_window", 0) or None
    if window is not None:
        check_sizes({"sliding_window": (m.key("attention.sliding_window"), window)}, m.path)
    rope = RopeConfig(theta=base.rope.theta)
    if set(ROPE_TENSORS) & set(m.shapes):
        for name in ROPE_TENSORS:
            if m.shapes.get(name) != (dims // 2,):
                raise ConfigError(f"expected {dims // 2} factors", path=m.path, field=name)
        orig = m.get("rope.scaling.original_context_length")
        factor = base.max_position_embeddings / orig  # as the converter's attn_factor
        default = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        rope = RopeConfig(
            theta=base.rope.theta,
            type="longrope",
            factor=factor,
            original_max_position_embeddings=orig,
            attention_factor=m.get("rope.scaling.attn_factor", default, float),
        )  # the factors: gguf.tensor_config, once read
    n = base.num_hidden_layers
    return check_act(
        base.with_(
            rope=rope,
            attention=replace(
                base.attention,
                rotary_dim=dims if dims != base.head_dim else None,
                fused_qkv="blk.0.attn_qkv.weight" in m.shapes,
                sliding_window=window,
            ),
            mlp=replace(base.mlp, fused_gate_up="blk.0.ffn_gate.weight" not in m.shapes),
            layer_types=("sliding_attention",) * n if window else (),
        ),
        m.path,
    )


def rope_factors(cfg: ModelConfig, tensors: dict[str, mx.array]) -> ModelConfig:
    """The LongRoPE factors from their tensors (parse_gguf checked their shapes)."""
    if cfg.rope.type != "longrope":
        return cfg
    short, long = (tuple(float(x) for x in tensors[n].tolist()) for n in ROPE_TENSORS)
    return cfg.with_(rope=replace(cfg.rope, short_factor=short, long_factor=long))


class FusedQKVAttention(Attention):
    """The common attention over one q|k|v projection (qkv_proj: q rows, then k, then v)."""

    def projections(self, d: int, q_out: int, kv_out: int, bias: bool) -> None:
        self.qkv_proj = nn.Linear(d, q_out + 2 * kv_out, bias=bias)
        self._split = (q_out, q_out + kv_out)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = mx.split(self.qkv_proj(x), self._split, axis=-1)
        return self.heads(q, k, v)


def phi3_attention(cfg: ModelConfig, rope: Rope | None) -> Attention:
    """Fused q|k|v, or the common kind where a GGUF carries them apart (attn_q, attn_k, attn_v)."""
    return (FusedQKVAttention if cfg.attention.fused_qkv else Attention)(cfg, rope)


class Phi3Layer(DecoderLayer):
    attention = staticmethod(phi3_attention)


class Phi3(Decoder):
    """The shared decoder with Phi-3's attention."""

    layer = Phi3Layer


PHI3 = Family(
    name="phi3",
    hf=HFFormat(
        model_types=("phi3",),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
        base=hf_base,
    ),
    gguf=GGUFFormat(
        archs=("phi3",),
        parse=parse_gguf,
        block=GGUF_BLOCK,
        config_tensors=ROPE_TENSORS,
        tensor_config=rope_factors,
    ),
    network=Phi3,
    export=Export(
        model_type="phi3",
        architecture="Phi3ForCausalLM",
        config=export,
    ),
)
