"""Qwen3-Next (80B-A3B): the hybrid before Qwen3.5, on Qwen3.5's pieces (qwen3_5.py, deltanet.py,
the shared decoder) with its differences as data.

  the same   Gated DeltaNet layers between gated full-attention layers (full_attention_interval,
             default 4, or layer_types), x̂·(1 + w) norms but DeltaNet's gated one, q/k norms,
             a sigmoid output gate from a doubled q_proj, RoPE on a quarter of each head,
             routed experts (softmax, top-k) plus a shared expert gated by a sigmoid
  differs    DeltaNet's projections fused per key head (`in_proj_qkvz`, `in_proj_ba`:
             cfg.deltanet.fused); dense MLP layers where `mlp_only_layers` / `decoder_sparse_step`
             say so; `norm_topk_prob` read (default true); no multimodal wrapper
HF `qwen3_next` (experts one tensor each, or transformers 5's fused ones); mlx-lm's layout (its
conv1d kernel axis last, 1 added to the zero-centred norms, experts stacked as switch_mlp).
GGUF `qwen3next` (llama.cpp's Qwen3NextModel): qkvz split into attn_qkv ([q | k | v]) and
attn_gate (z), β and α kept fused as ssm_ba, or older files' ssm_in (qkvz as it is); value
heads grouped as transformers has them (llama.cpp retiles them for Qwen3.5 only), A stored as
−exp(A_log), conv1d squeezed, 1 added to the zero-centred norms; every layer a MoE layer.
The multi-token-prediction block (`mtp.*`, GGUF `blk.N.nextn.*`) is skipped.
Defaults are transformers' Qwen3NextConfig.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.base import Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.conventions import QWEN3NEXT_GGUF, is_zero_centred_norm
from mlxlis.models.hybrid import (
    DROPPED,
    MLX,
    HybridDecoder,
    exporter,
    gguf_parser,
    hf_parser,
    mtp_tensor,
)
from mlxlis.models.hybrid import (
    GGUF_BLOCK as QWEN35_BLOCK,
)
from mlxlis.models.reading import sparse_layers

import mlx.core as mx

HF_DEFAULTS = {  # transformers' Qwen3NextConfig, for the keys the shared parser reads
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
}
MOE_DEFAULTS = {
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
FUSED = ("qkvz", "ba")
_parse_hybrid = hf_parser(True)


def _sparse_layers(cfg: dict, n: int, path: str) -> tuple[bool, ...]:
    step = cfg.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"bad step {step!r}"[:100], path=path, field="decoder_sparse_step")
    return sparse_layers(cfg, n, step, path)


def norm_topk(cfg: dict, path: str) -> bool:
    """`norm_topk_prob`, default true (Qwen3-Next's and Qwen4-Exp's routers)."""
    top = cfg.get("norm_topk_prob", True)
    if not isinstance(top, bool):  # a string "false" must not read as true
        raise ConfigError(
            f"expected true or false, got {top!r}"[:200], path=path, field="norm_topk_prob"
        )
    return top


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    cfg = {**MOE_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    top = norm_topk(cfg, path)
    out = _parse_hybrid(cfg, base, path)
    sparse = _sparse_layers(cfg, out.num_hidden_layers, path)
    return out.with_(
        moe=replace(out.moe, sparse_layers=sparse, norm_topk_prob=top),
        deltanet=replace(out.deltanet, fused=FUSED),
    )


_parse_gguf_hybrid = gguf_parser(True)


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    out = _parse_gguf_hybrid(base, m)
    n = out.num_hidden_layers
    for i in range(n):  # llama.cpp's qwen3next: a router (an expert block) in every layer
        if f"blk.{i}.ffn_gate_inp.weight" not in m.shapes:
            raise UnsupportedError(
                "llama.cpp's qwen3next has an expert block in every layer",
                path=m.path,
                field=f"blk.{i}.ffn_gate_inp.weight",
            )
    linear = [i for i in range(n) if out.is_linear(i)]
    legacy = {f"blk.{i}.ssm_in.weight" in m.shapes for i in linear}
    if len(legacy) > 1:
        raise UnsupportedError(
            "ssm_in in some DeltaNet layers only", path=m.path, field="ssm_in.weight"
        )
    fused = FUSED if legacy == {True} else ("ba",)
    return out.with_(deltanet=replace(out.deltanet, fused=fused))


GGUF_BLOCK = {
    **{k: v for k, v in QWEN35_BLOCK.items() if k not in ("ssm_beta", "ssm_alpha")},
    "ssm_ba": "linear_attn.in_proj_ba",  # β and α still fused per key head
    "ssm_in": "linear_attn.in_proj_qkvz",  # older files: qkvz as transformers has it
}
_export_hybrid = exporter(True)


def export(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.deltanet.fused != FUSED:
        raise UnsupportedError(
            "this Qwen3-Next layout (a GGUF's split attn_qkv / attn_gate) has no config.json form",
            path=cfg.source,
            field="attn_qkv",
        )
    out = _export_hybrid(cfg)
    if "full_attention_interval" not in out:  # mlx-lm places the layers by it alone
        raise UnsupportedError(
            "layer types that no full_attention_interval states (mlx-lm reads only that)",
            path=cfg.source,
            field="layer_types",
        )
    n = cfg.num_hidden_layers
    dense = [i for i in range(n) if not cfg.is_sparse(i)]
    return {
        **out,
        # the classic keys mlx-lm reads beside rope_parameters
        "rope_theta": cfg.rope.theta,
        "partial_rotary_factor": out["rope_parameters"]["partial_rotary_factor"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "norm_topk_prob": cfg.moe.norm_topk_prob,
    }


def mlx_lm_layout(name: str, w: mx.array) -> mx.array:
    """`convert` writes what mlx-lm's sanitize makes (it takes a folder with stacked experts as
    sanitized already): the conv kernel axis last, 1 added to the zero-centred norms, in the
    folder's dtype as mlx-lm's own folders (a float32 norm would turn mlx-lm's whole pass
    float32); mlxlis reads the layout back by the conv's shape."""
    if name.endswith("linear_attn.conv1d.weight"):
        return w.swapaxes(1, 2)  # (C, 1, kernel) -> (C, kernel, 1)
    if is_zero_centred_norm(name):
        return (w.astype(mx.float32) + 1.0).astype(w.dtype)
    return w


QWEN3_NEXT = Family(
    name="qwen3_next",
    hf=HFFormat(
        model_types=("qwen3_next",),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
        dropped=DROPPED,
    ),
    gguf=GGUFFormat(
        archs=("qwen3next",),
        parse=parse_gguf,
        block=GGUF_BLOCK,
        conventions=QWEN3NEXT_GGUF,
        ignored=mtp_tensor,
    ),
    network=HybridDecoder,
    export=Export(
        model_type="qwen3_next",
        architecture="Qwen3NextForCausalLM",
        config=export,
        layout=mlx_lm_layout,
    ),
    mlx=MLX,
)
