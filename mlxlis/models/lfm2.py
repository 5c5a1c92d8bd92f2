"""LFM2 (Liquid AI): pre-norm blocks (operator_norm, ffn_norm) whose mixer is a gated short
convolution (shortconv.py: C ⊙ conv_L(B ⊙ x), a state of the last L − 1 gated inputs) or GQA
attention with per-head q/k RMSNorms before RoPE, as `layer_types` says ("conv" |
"full_attention"; else `full_attn_idxs`, transformers' default: all attention); a SwiGLU MLP
(w1 gate, w3 up, w2 down) whose width `block_auto_adjust_ff_dim` makes int(2·ff/3), then with a
multiplier int(mult·w) rounded up to `block_multiple_of` (transformers rounds only inside the
multiplier branch, llama.cpp and mlx-lm always: alike for released configs); the final norm
is named `embedding_norm` though it follows the last layer; a tied head by default.
HF `lfm2` (hub configs also spell block_ff_dim, tie_embedding, norm_eps); mlx-lm's lfm2 has the
same names, its kernel saved (C, L, 1). GGUF: llama.cpp's LFM2Model writes arch `lfm2`, the
kernel squeezed to (C, L), head_count_kv per layer (0 on conv layers), shortconv.l_cache, the
MLP width already adjusted, the final norm as token_embd_norm.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.activations import gated
from mlxlis.models.base import (
    Convention,
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
    MLXFormat,
)
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.layers import Attention, Cache, Mask, norm
from mlxlis.models.reading import check_act
from mlxlis.models.rope import Rope
from mlxlis.models.shortconv import ShortConv

import mlx.core as mx
import mlx.nn as nn
import numpy as np

CONV, FULL = "conv", "full_attention"
HF_DEFAULTS = {  # transformers' Lfm2Config, for the keys the shared parser reads
    "vocab_size": 65536,
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 128000,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,  # Lfm2Config.default_theta
}
GGUF_BLOCK = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}


@dataclass(frozen=True)
class ShortConvConfig(FamilyConfig):
    """The short convolutions' kernel length L (conv_L_cache) and whether they have biases."""

    kernel: int = 3
    bias: bool = False


class Lfm2Attention(Attention):
    """GQA with q and k RMSNormed per head (q_layernorm, k_layernorm) before RoPE, its output
    projection named out_proj."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        super().__init__(cfg, rope)
        self.out_proj = self.o_proj
        del self.o_proj
        self.q_layernorm = norm(cfg, cfg.head_dim)
        self.k_layernorm = norm(cfg, cfg.head_dim)

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        q, k, v = self.project(x)
        return self.out_proj(self.attend(q, k, v, mask, cache, positions))

    def norm_heads(self, q, k) -> tuple[mx.array, mx.array]:
        return self.q_layernorm(q), self.k_layernorm(k)


class Lfm2MLP(nn.Module):
    """w2(silu(w1(x)) · w3(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.mlp.intermediate_size
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.act = gated(cfg.mlp.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(self.act(self.w1(x), self.w3(x)))


class Lfm2Layer(nn.Module):
    """h += mixer(operator_norm(h)); h += feed_forward(ffn_norm(h)), the mixer a short
    convolution or attention as layer_types says."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        super().__init__()
        d = cfg.hidden_size
        if cfg.is_linear(layer):
            s = cfg.own(ShortConvConfig)
            self.conv = ShortConv(d, s.kernel, s.bias)
        else:
            self.self_attn = Lfm2Attention(cfg, rope)
        self.feed_forward = Lfm2MLP(cfg)
        self.operator_norm = norm(cfg, d)
        self.ffn_norm = norm(cfg, d)

    def __call__(
        self, h: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        x = self.operator_norm(h)
        if "conv" in self:
            h = h + self.conv(x, cache)
        else:
            h = h + self.self_attn(x, mask, cache, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2(Decoder):
    """The shared decoder with LFM2's blocks (its conv layers' caches: RecurrentCache)."""

    layer: type[nn.Module] = Lfm2Layer

    def expert_stacks(self) -> dict:
        return {}  # dense MLPs only (feed_forward, not the shared blocks' `mlp`)


def _base(cfg: dict) -> dict:
    """What the shared parser reads, in the spellings transformers' Lfm2Config accepts."""
    out = {k: v for k, v in cfg.items() if k != "head_dim"}  # always hidden / heads
    for old, new in (
        ("block_ff_dim", "intermediate_size"),
        ("tie_embedding", "tie_word_embeddings"),
    ):
        if cfg.get(old) is not None:
            out[new] = cfg[old]
    out["rms_norm_eps"] = cfg.get("norm_eps", 1e-5)
    return out


def _ff_width(cfg: dict, ff: int, path: str) -> int:
    """The MLP width Lfm2MLP builds from `ff` and the block_* keys."""
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return ff
    ff = int(2 * ff / 3)
    mult = cfg.get("block_ffn_dim_multiplier", 1.0)
    if mult is not None:
        of = cfg.get("block_multiple_of", 256)
        of = check_sizes({"intermediate_size": ("block_multiple_of", of)}, path)[
            "intermediate_size"
        ]
        ff = of * ((int(mult * ff) + of - 1) // of)
    return check_sizes({"intermediate_size": ("block_ff_dim", ff)}, path)["intermediate_size"]


def _types(cfg: dict, n: int, path: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        full = range(n) if full is None else full
        types = [FULL if i in full else CONV for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (CONV, FULL) for t in types):
        raise ConfigError(
            f"expected {n} of {(CONV, FULL)}, got {types!r}"[:300], path=path, field="layer_types"
        )
    return tuple(types)


def _kernel(value: Any, field: str, path: str) -> int:
    kernel = check_sizes({"linear_conv_kernel_dim": (field, value)}, path)["linear_conv_kernel_dim"]
    if kernel < 2:  # a state of L − 1 inputs: none to carry
        raise ConfigError(f"a kernel of {kernel} taps is not supported", path=path, field=field)
    return kernel


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    ff = _ff_width(cfg, base.mlp.intermediate_size, path)
    kernel = _kernel(cfg.get("conv_L_cache", 3), "conv_L_cache", path)
    own = ShortConvConfig(kernel, bool(cfg.get("conv_bias", False)))
    return check_act(
        base.with_(
            mlp=replace(base.mlp, intermediate_size=ff, bias=False),
            attention=replace(base.attention, bias=False, o_bias=False),
            layer_types=_types(cfg, base.num_hidden_layers, path),
            family_config=own,
        ),
        path,
    )


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    """The conv layers are those stating 0 KV heads; the attention layers share one count."""
    n, field = base.num_hidden_layers, m.key("attention.head_count_kv")
    kv = m.md.get(field)
    counts = kv.tolist() if isinstance(kv, np.ndarray) else [base.num_key_value_heads] * n
    if len(counts) != n or len({c for c in counts if c}) != 1:
        raise UnsupportedError(f"expected {n} counts, one nonzero value", path=m.path, field=field)
    kernel = _kernel(m.get("shortconv.l_cache"), m.key("shortconv.l_cache"), m.path)
    own = ShortConvConfig(kernel, any(k.endswith("shortconv.conv.bias") for k in m.shapes))
    return base.with_(layer_types=tuple(FULL if c else CONV for c in counts), family_config=own)


# llama.cpp's converter squeezes the conv kernel to (C, L): back to torch's (C, 1, L)
CONV_UNSQUEEZED: Convention = (
    lambda name: name.endswith("conv.conv.weight"),
    lambda w, c, _: w.reshape(w.shape[0], 1, -1),
)


def export(cfg: ModelConfig) -> dict[str, Any]:
    s = cfg.own(ShortConvConfig)
    if cfg.rope.type != "default":
        raise UnsupportedError(
            f"writing lfm2 with {cfg.rope.type} RoPE scaling is not supported",
            path=cfg.source,
            field="rope_parameters",
        )
    types = list(cfg.layer_types)
    return {  # the MLP width as built (no adjustment left to redo); mlx-lm requires block_*
        "layer_types": types,
        "full_attn_idxs": [i for i, t in enumerate(types) if t == FULL],
        "conv_L_cache": s.kernel,
        "conv_bias": s.bias,
        "norm_eps": cfg.norms.eps,
        "block_dim": cfg.hidden_size,
        "block_ff_dim": cfg.mlp.intermediate_size,
        "block_auto_adjust_ff_dim": False,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope.theta},
    }


def _describe(c: ModelConfig) -> dict[str, Any]:
    s = c.own(ShortConvConfig)
    layers = sum(c.is_linear(i) for i in range(c.num_hidden_layers))
    return {"short_conv": {"kernel": s.kernel, "layers": layers, "bias": s.bias}}


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    s, n, d = config["short_conv"], config["layers"], config["hidden_size"]
    state = f"a state of the last {s['kernel'] - 1} gated inputs ({s['kernel'] - 1} × {d}) each"
    text = f"gated short convolution C·conv{s['kernel']}(B·x) in {s['layers']} of {n} layers"
    return [("conv", f"{text}, {state}; per-head q/k norms on the attention layers")]


LFM2 = Family(
    name="lfm2",
    hf=HFFormat(
        model_types=("lfm2",),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
        base=_base,
        renames=(("model.embedding_norm.", "model.norm."),),
    ),
    gguf=GGUFFormat(
        archs=("lfm2",),
        parse=parse_gguf,
        block=GGUF_BLOCK,
        conventions=(CONV_UNSQUEEZED,),
        names=lambda n: "model.norm.weight" if n == "token_embd_norm.weight" else None,
        per_layer_keys=("attention.head_count_kv",),
    ),
    network=Lfm2,
    export=Export(
        model_type="lfm2",
        architecture="Lfm2ForCausalLM",
        config=export,
        renames=(("model.norm.", "model.embedding_norm."),),
    ),
    mlx=MLXFormat(layouts={"conv.conv.weight": (0, 2, 1)}),  # mlx-lm's sanitize: (C, L, 1)
    describe=Description(("short_conv",), _describe, _rows),
)
