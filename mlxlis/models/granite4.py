"""Granite 4.0 (IBM's GraniteMoeHybrid): pre-norm blocks whose mixer is a Mamba-2 layer
(mamba2.py) or GQA attention, without RoPE unless position_embedding_type is "rope" (released
Granite 4.0: "nope"); then a mixture of experts (a router softmax over its top-k logits, SwiGLU
experts) beside a shared SwiGLU MLP every token runs, or that shared MLP alone
(num_local_experts 0). Granite's scales: embeddings × embedding_multiplier, each sublayer's
output × residual_multiplier into the residual, the attention scale attention_multiplier (not
1/√head_dim), logits ÷ logits_scaling.

HF `granitemoehybrid` (layer_types "mamba" / "attention", transformers 5's "linear_attention" /
"full_attention"; experts as block_sparse_moe.input_linear (E, 2F, hidden; gate rows, then up)
and output_linear; the shared MLP's gate|up fused in shared_mlp.input_linear); mlx-lm's
granitemoehybrid has the same names with the experts stacked (`switch_mlp`) and its conv kernel
saved (C, K, 1). GGUF: llama.cpp's GraniteHybridModel writes arch `granitehybrid` (head_count_kv
0 on Mamba layers, Q/K rows permuted as for Llama, the shared MLP split into gate and up, the
Mamba-2 conventions of mamba2.GGUF_CONVENTIONS; RoPE as rope.scaling.finetuned).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models import mamba2
from mlxlis.models.activations import gated
from mlxlis.models.base import (
    GGUF_LLAMA_BLOCK,
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
    MLXFormat,
)
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.models.conventions import UNPERMUTE_K, UNPERMUTE_Q
from mlxlis.models.decoder import Decoder
from mlxlis.models.experts import ExpertSource, SwitchGLU
from mlxlis.models.layers import Attention, Cache, Mask, norm
from mlxlis.models.reading import check_act, expert_sizes, moe_config
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn
import numpy as np

MAMBA, ATTN = "linear_attention", "full_attention"
LEGACY = {"mamba": MAMBA, "attention": ATTN}  # hub configs' names (transformers remaps them)
HF_DEFAULTS = {  # transformers' GraniteMoeHybridConfig, for the keys the shared parser reads
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
}
CHUNK = 256  # transformers' mamba_chunk_size default (GGUF files do not say)
GGUF_BLOCK = {
    **GGUF_LLAMA_BLOCK,
    **mamba2.gguf_block("mamba"),
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
    "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
    "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.output_linear",
    "ffn_gate": "shared_mlp.gate_proj",  # a dense model's one MLP
    "ffn_up": "shared_mlp.up_proj",
    "ffn_down": "shared_mlp.output_linear",
}
_SPLIT = re.compile(r"^(.*\.shared_mlp)\.(gate|up)_proj\.(weight|scales|biases)$")


@dataclass(frozen=True)
class Granite4Config(FamilyConfig):
    """The Mamba-2 layers' shape, Granite's four scales, the shared MLP's width (and whether
    its gate and up come split, as GGUF files keep them)."""

    mamba: mamba2.Mamba2Config
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    shared_width: int = 1024
    split_shared: bool = False


class GraniteAttention(Attention):
    """GQA scaled by attention_multiplier."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        super().__init__(cfg, rope)
        self.scale = cfg.own(Granite4Config).attention_multiplier


class SharedMLP(nn.Module):
    """output_linear(silu(gate) · up), gate|up one projection (input_linear) or two."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        own, d = cfg.own(Granite4Config), cfg.hidden_size
        f = own.shared_width
        if own.split_shared:
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
        else:
            self.input_linear = nn.Linear(d, 2 * f, bias=False)
        self.output_linear = nn.Linear(f, d, bias=False)
        self.act = gated(cfg.mlp.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        if "input_linear" in self:
            return self.output_linear(self.act(*mx.split(self.input_linear(x), 2, axis=-1)))
        return self.output_linear(self.act(self.gate_proj(x), self.up_proj(x)))


class GraniteMoE(nn.Module):
    """The top k of the router's logits, softmaxed among themselves, weight the experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.moe.num_experts_per_tok
        self.router = nn.Module()
        self.router.layer = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(cfg)

    def __call__(self, x: mx.array) -> mx.array:
        k = self.top_k
        logits = self.router.layer(x).astype(mx.float32)  # (B, T, E)
        inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]  # (B, T, k)
        weights = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
        y = self.switch_mlp(x, mx.stop_gradient(inds))  # (B, T, k, hidden)
        return (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)


class Granite4Layer(nn.Module):
    """h += r·mixer(norm(h)); h += r·(moe(norm(h)) + shared_mlp(norm(h))), r the
    residual_multiplier."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        super().__init__()
        own = cfg.own(Granite4Config)
        self.r = own.residual_multiplier
        if cfg.is_linear(layer):
            self.mamba = mamba2.Mamba2Mixer(cfg.hidden_size, own.mamba)
        else:
            self.self_attn = GraniteAttention(cfg, rope)
        if cfg.is_sparse(layer):
            self.block_sparse_moe = GraniteMoE(cfg)
        self.shared_mlp = SharedMLP(cfg)
        self.input_layernorm = norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size)

    def __call__(
        self, h: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        x = self.input_layernorm(h)
        if "mamba" in self:
            h = h + self.mamba(x, cache) * self.r
        else:
            h = h + self.self_attn(x, mask, cache, positions) * self.r
        x = self.post_attention_layernorm(h)
        y = self.shared_mlp(x)
        if "block_sparse_moe" in self:
            y = self.block_sparse_moe(x) + y
        return h + y * self.r


class Granite4(Decoder):
    """The shared decoder with Granite 4.0's blocks and scales (its Mamba layers' caches:
    RecurrentCache)."""

    layer: type[nn.Module] = Granite4Layer

    def embed(self, inputs: mx.array) -> mx.array:
        h = super().embed(inputs)
        return h * self.config.own(Granite4Config).embedding_multiplier

    def head(self, h: mx.array, last_only: bool = False) -> mx.array:
        return super().head(h, last_only) / self.config.own(Granite4Config).logits_scaling

    def expert_stacks(self) -> dict[str, ExpertSource]:
        stacks: dict[str, ExpertSource] = {}
        for i, layer in enumerate(self.model.layers):
            if layer is not None and "block_sparse_moe" in layer:
                p = f"model.layers.{i}.block_sparse_moe"
                for name, fused, half in (
                    ("gate_proj", "input_linear", 0),
                    ("up_proj", "input_linear", 1),
                    ("down_proj", "output_linear", None),
                ):
                    src = ExpertSource((), f"{p}.{fused}.weight", half)
                    stacks[f"{p}.switch_mlp.{name}.weight"] = src
        return stacks


def _types(cfg: dict, n: int, path: str) -> tuple[str, ...]:
    key = "layer_types" if "layer_types" in cfg else "layers_block_type"
    types = cfg.get(key)
    types = [MAMBA] * n if types is None else types  # transformers' default: all Mamba
    if (
        not isinstance(types, list)
        or len(types) != n
        or any(LEGACY.get(t, t) not in (MAMBA, ATTN) for t in types)
    ):
        raise ConfigError(
            f"expected {n} of mamba | attention, got {types!r}"[:300], path=path, field=key
        )
    return tuple(LEGACY.get(t, t) for t in types)


def _scale(cfg: dict, key: str, path: str) -> float:
    value = cfg.get(key, 1.0)
    value = 1.0 if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"expected a positive number, got {value!r}"[:200], path=path, field=key)
    return float(value)


SCALES = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    n, d = base.num_hidden_layers, base.hidden_size
    pos = cfg.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):
        raise UnsupportedError(
            f"position embedding {pos!r}", path=path, field="position_embedding_type"
        )
    heads = cfg.get("mamba_n_heads", 128)
    expand = check_sizes({"intermediate_size": ("mamba_expand", cfg.get("mamba_expand", 2))}, path)
    inner = expand["intermediate_size"] * d
    head_dim = cfg.get("mamba_d_head", "auto")
    if head_dim == "auto" and isinstance(heads, int) and heads > 0:
        head_dim = inner // heads
    sizes = {
        "heads": ("mamba_n_heads", heads),
        "head_dim": ("mamba_d_head", head_dim),
        "state": ("mamba_d_state", cfg.get("mamba_d_state", 256)),
        "groups": ("mamba_n_groups", cfg.get("mamba_n_groups", 1)),
        "conv_kernel": ("mamba_d_conv", cfg.get("mamba_d_conv", 4)),
        "chunk": ("mamba_chunk_size", cfg.get("mamba_chunk_size", CHUNK)),
    }
    biases = (cfg.get("mamba_conv_bias", True), cfg.get("mamba_proj_bias", False))
    limit = (cfg.get("time_step_limit", (0.0, float("inf"))), "time_step_limit")
    mamba = mamba2.checked(sizes, base.norms.eps, biases, limit, path)
    if mamba.inner != inner:  # transformers' validate_architecture
        raise ConfigError(
            f"{mamba.heads} × {mamba.head_dim} ≠ {inner}", path=path, field="mamba_d_head"
        )
    width = cfg.get("shared_intermediate_size", 1024)
    width = check_sizes({"intermediate_size": ("shared_intermediate_size", width)}, path)
    experts = cfg.get("num_local_experts", 8) or 0
    moe = None
    if experts:
        size = expert_sizes(
            {
                "num_experts": ("num_local_experts", experts),
                "num_experts_per_tok": ("num_experts_per_tok", cfg.get("num_experts_per_tok", 2)),
                "moe_intermediate_size": ("intermediate_size", base.mlp.intermediate_size),
            },
            path,
        )
        moe = moe_config(size, (True,) * n, norm_topk_prob=True)
    scales = {k: _scale(cfg, k, path) for k in SCALES}
    own = Granite4Config(mamba, **scales, shared_width=width["intermediate_size"])
    return check_act(
        base.with_(
            layer_types=_types(cfg, n, path),
            moe=moe,
            attention=replace(base.attention, no_rope_layers=() if pos == "rope" else (True,) * n),
            mlp=replace(base.mlp, bias=False),
            family_config=own,
        ),
        path,
    )


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    """The Mamba layers are those stating 0 KV heads; the attention layers share one count."""
    n, field = base.num_hidden_layers, m.key("attention.head_count_kv")
    kv = m.md.get(field)
    counts = kv.tolist() if isinstance(kv, np.ndarray) else [base.num_key_value_heads] * n
    if len(counts) != n or len({c for c in counts if c}) > 1:
        raise UnsupportedError(f"expected {n} counts, one nonzero value", path=m.path, field=field)
    kv_heads = max(counts)
    experts = m.get("expert_count", 0)
    moe = None
    if experts:
        size = expert_sizes(
            {
                "num_experts": (m.key("expert_count"), experts),
                "num_experts_per_tok": (m.key("expert_used_count"), m.get("expert_used_count")),
                "moe_intermediate_size": (m.key("feed_forward_length"), base.mlp.intermediate_size),
            },
            m.path,
        )
        moe = moe_config(size, (True,) * n, norm_topk_prob=True)
    width = m.get("expert_shared_feed_forward_length", base.mlp.intermediate_size)
    scales = (
        m.get("embedding_scale", 1.0, float),
        m.get("residual_scale", 1.0, float),
        m.get("attention.scale", 1.0, float),
        m.get("logit_scale", 1.0, float),
    )
    own = Granite4Config(mamba2.from_gguf(m, base.norms.eps, CHUNK), *scales, width, True)
    rope = bool(m.md.get(m.key("rope.scaling.finetuned"), False))
    return base.with_(
        num_key_value_heads=kv_heads or base.num_attention_heads,
        layer_types=tuple(ATTN if c else MAMBA for c in counts),
        moe=moe,
        attention=replace(base.attention, no_rope_layers=() if rope else (True,) * n),
        family_config=own,
    )


def export(cfg: ModelConfig) -> dict[str, Any]:
    own = cfg.own(Granite4Config)
    m, moe = own.mamba, cfg.moe
    if cfg.rope.type != "default":
        raise UnsupportedError(
            f"writing granitemoehybrid with {cfg.rope.type} RoPE scaling is not supported",
            path=cfg.source,
            field="rope_parameters",
        )
    return {
        "layer_types": [
            "mamba" if cfg.is_linear(i) else "attention" for i in range(cfg.num_hidden_layers)
        ],
        "position_embedding_type": "nope" if cfg.attention.no_rope_layers else "rope",
        "attention_bias": cfg.attention.bias,
        "mamba_n_heads": m.heads,
        "mamba_d_head": m.head_dim,
        "mamba_d_state": m.state,
        "mamba_n_groups": m.groups,
        "mamba_d_conv": m.conv_kernel,
        "mamba_chunk_size": m.chunk,
        "mamba_expand": m.inner // cfg.hidden_size,
        "mamba_conv_bias": m.conv_bias,
        "mamba_proj_bias": m.proj_bias,
        "time_step_limit": list(m.dt_limit),
        "num_local_experts": moe.num_experts if moe else 0,
        "num_experts_per_tok": moe.num_experts_per_tok if moe else 0,
        "shared_intermediate_size": own.shared_width,
        **{k: getattr(own, k) for k in SCALES},
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope.theta},
    }


def fuse_shared(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """A GGUF's split shared gate and up, written as the checkpoints' one input_linear."""
    out, halves = {}, {}
    for name, arr in params.items():
        m = _SPLIT.match(name)
        if m is None:
            out[name] = arr
        else:
            halves.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = arr
    for (prefix, part), h in halves.items():
        out[f"{prefix}.input_linear.{part}"] = mx.concatenate([h["gate"], h["up"]], axis=0)
    return out


def _describe(c: ModelConfig) -> dict[str, Any]:
    own = c.own(Granite4Config)
    m = own.mamba
    return {
        "mamba2": {
            "layers": sum(c.is_linear(i) for i in range(c.num_hidden_layers)),
            "heads": m.heads,
            "head_dim": m.head_dim,
            "state": m.state,
            "groups": m.groups,
            "conv_kernel": m.conv_kernel,
            "chunk": m.chunk,
            "state_bytes": m.state_bytes(),
            "rope": not c.attention.no_rope_layers,
            "scales": [getattr(own, k) for k in SCALES],
        }
    }


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    m, n = config["mamba2"], config["layers"]
    e, r, a, lg = m["scales"]
    return [
        (
            "mamba2",
            f"Mamba-2 state space layers in {m['layers']} of {n}: {m['heads']} heads × "
            f"{m['head_dim']}, state {m['state']} in {m['groups']} group(s), conv of "
            f"{m['conv_kernel']}, prompts in chunks of {m['chunk']}; a state of "
            f"{m['state_bytes']} bytes each",
        ),
        ("attention", "RoPE" if m["rope"] else "no positional encoding (NoPE)"),
        ("scales", f"embeddings × {e:g}, residual × {r:g}, attention × {a:g}, logits ÷ {lg:g}"),
    ]


GRANITE4 = Family(
    name="granitemoehybrid",
    hf=HFFormat(model_types=("granitemoehybrid",), parse=parse_hf, defaults=HF_DEFAULTS),
    gguf=GGUFFormat(
        archs=("granitehybrid",),
        parse=parse_gguf,
        block=GGUF_BLOCK,
        conventions=(*mamba2.GGUF_CONVENTIONS, UNPERMUTE_Q, UNPERMUTE_K),
        per_layer_keys=("attention.head_count_kv",),
    ),
    network=Granite4,
    export=Export(
        model_type="granitemoehybrid",
        architecture="GraniteMoeHybridForCausalLM",
        config=export,
        regroup=fuse_shared,
    ),
    mlx=MLXFormat(layouts={"mamba.conv1d.weight": (0, 2, 1)}),  # mlx-lm's sanitize: (C, K, 1)
    describe=Description(("mamba2",), _describe, _rows),
)
