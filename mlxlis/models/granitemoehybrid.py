"""Granite 4.0 (IBM's GraniteMoeHybrid): pre-norm blocks whose mixer is Mamba-2 (mamba2.py) or
GQA attention, without RoPE unless position_embedding_type is "rope" (released: "nope"); then
experts (experts.LogitTopKMoE, SwiGLU) beside a shared SwiGLU MLP, or that MLP alone
(num_local_experts 0). Granite's scales: embeddings × embedding_multiplier, each sublayer's
output × residual_multiplier, attention scaled by attention_multiplier, logits ÷ logits_scaling.

HF `granitemoehybrid` (layer_types "mamba" / "attention", transformers 5's "linear_attention" /
"full_attention"; experts as block_sparse_moe.input_linear (E, 2F, hidden; gate rows, then up)
and output_linear; the shared MLP's gate|up one shared_mlp.input_linear); mlx-lm's has the same
names, the experts stacked (`switch_mlp`), its conv kernel saved (C, K, 1). GGUF: llama.cpp's
GraniteHybridModel writes `granitehybrid` (head_count_kv 0 on Mamba layers, Q/K rows permuted
as for Llama, the shared MLP split, mamba2.GGUF_CONVENTIONS; RoPE as rope.scaling.finetuned).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models import mamba2
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
from mlxlis.models.experts import ExpertSource, LogitTopKMoE
from mlxlis.models.layers import MLP, Attention, Cache, Mask, norm
from mlxlis.models.reading import check_act, expert_sizes, moe_config, positive
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

MAMBA, ATTN = "linear_attention", "full_attention"
HF_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6}  # transformers' defaults
CHUNK = 256  # transformers' mamba_chunk_size default (GGUF files do not say)
GGUF_BLOCK = {
    **GGUF_LLAMA_BLOCK,
    **mamba2.gguf_block("mamba"),
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
    "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
    "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
    # the shared MLP's, split; a dense model's one MLP (ffn_gate, ...)
    **{
        f"ffn_{p}{s}": f"shared_mlp.{p}_proj"
        for p in ("gate", "up", "down")
        for s in ("", "_shexp")
    },
}
SCALES = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
GGUF_SCALES = ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")
BIASES = ("mamba_conv_bias", "mamba_proj_bias")
EXPERT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
MAMBA_KEYS = {  # the mixer's config.json keys and transformers' defaults
    "heads": ("mamba_n_heads", 128),
    "head_dim": ("mamba_d_head", "auto"),
    "state": ("mamba_d_state", 256),
    "groups": ("mamba_n_groups", 1),
    "conv_kernel": ("mamba_d_conv", 4),
    "chunk": ("mamba_chunk_size", CHUNK),
}
_SPLIT = re.compile(r"^(.*\.shared_mlp)\.(gate|up)_proj\.(weight|scales|biases)$")
# the shared MLP: the checkpoints' names -> layers.MLP's (fused gate|up)
NAMES = {"gate_up_proj": "input_linear", "down_proj": "output_linear"}
_THEIRS = re.compile(r"(\.shared_mlp)\.(input_linear|output_linear)\.")
_OURS = re.compile(r"(\.shared_mlp)\.(gate_up_proj|down_proj)\.")


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
            self.self_attn = Attention(cfg, rope)
            self.self_attn.scale = own.attention_multiplier  # not 1/√head_dim
        if cfg.is_sparse(layer):
            self.block_sparse_moe = LogitTopKMoE(cfg)
        self.shared_mlp = MLP(cfg, own.shared_width)
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

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        ours = {v: k for k, v in NAMES.items()}
        rename = lambda m: f"{m.group(1)}.{ours[m.group(2)]}."  # noqa: E731
        return {_THEIRS.sub(rename, k): v for k, v in super().sanitize(weights).items()}

    def embed(self, inputs: mx.array) -> mx.array:
        h = super().embed(inputs)
        return h * self.config.own(Granite4Config).embedding_multiplier

    def head(self, h: mx.array, last_only: bool = False) -> mx.array:
        return super().head(h, last_only) / self.config.own(Granite4Config).logits_scaling

    def expert_stacks(self) -> dict[str, ExpertSource]:
        stacks: dict[str, ExpertSource] = {}
        for i, layer in enumerate(self.model.layers):
            if layer is not None and "block_sparse_moe" in layer:
                stacks.update(
                    layer.block_sparse_moe.expert_stacks(f"model.layers.{i}.block_sparse_moe")
                )
        return stacks


def _types(cfg: dict, n: int, path: str) -> tuple[str, ...]:
    keys = ("layer_types", "layers_block_type")
    types = mamba2.layer_kinds(cfg, keys, (MAMBA, ATTN), path) or (MAMBA,) * n  # all Mamba
    if len(types) != n:
        raise ConfigError(f"{len(types)} layer types for {n} layers", path=path, field=keys[0])
    return types


def _moe(keys: tuple[str, str, str], values: tuple, n: int, path: str):
    """The experts in every layer, or None (0 experts: the shared MLP alone)."""
    if not values[0]:
        return None
    sizes = dict(zip(EXPERT_FIELDS, zip(keys, values, strict=True), strict=True))
    return moe_config(expert_sizes(sizes, path), (True,) * n, norm_topk_prob=True)


def _with(base: ModelConfig, own: Granite4Config, types, moe, rope: bool) -> ModelConfig:
    nope = () if rope else (True,) * base.num_hidden_layers
    mlp = replace(base.mlp, bias=False, fused_gate_up=not own.split_shared)
    attention = replace(base.attention, no_rope_layers=nope)
    return base.with_(layer_types=types, moe=moe, attention=attention, mlp=mlp, family_config=own)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    n, pos = base.num_hidden_layers, cfg.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):
        raise UnsupportedError(
            f"position embedding {pos!r}", path=path, field="position_embedding_type"
        )
    expand = check_sizes({"intermediate_size": ("mamba_expand", cfg.get("mamba_expand", 2))}, path)
    inner = expand["intermediate_size"] * base.hidden_size
    heads, head_dim = cfg.get("mamba_n_heads", 128), cfg.get("mamba_d_head", "auto")
    if head_dim == "auto" and isinstance(heads, int) and heads > 0:
        head_dim = inner // heads
    cfg = {**cfg, "mamba_d_head": head_dim}
    mamba = mamba2.from_hf(cfg, MAMBA_KEYS, BIASES, base.norms.eps, path)
    if mamba.inner != inner:  # transformers' validate_architecture
        raise ConfigError(
            f"{mamba.heads} × {mamba.head_dim} ≠ {inner}", path=path, field="mamba_d_head"
        )
    width = cfg.get("shared_intermediate_size", 1024)
    width = check_sizes({"intermediate_size": ("shared_intermediate_size", width)}, path)
    keys = ("num_local_experts", "num_experts_per_tok", "intermediate_size")
    values = (cfg.get(keys[0], 8) or 0, cfg.get(keys[1], 2), base.mlp.intermediate_size)
    moe = _moe(keys, values, n, path)
    scales = {k: positive(cfg, k, path) for k in SCALES}
    own = Granite4Config(mamba, **scales, shared_width=width["intermediate_size"])
    return check_act(_with(base, own, _types(cfg, n, path), moe, pos == "rope"), path)


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    """The Mamba layers are those stating 0 KV heads; RoPE where rope.scaling.finetuned (as
    llama.cpp's GraniteHybridModel writes it)."""
    n = base.num_hidden_layers
    attn, kv_heads = mamba2.gguf_attention(m, n)
    keys = tuple(map(m.key, ("expert_count", "expert_used_count", "feed_forward_length")))
    values = (m.get("expert_count", 0), m.get("expert_used_count", 0), base.mlp.intermediate_size)
    moe = _moe(keys, values, n, m.path)
    width = m.get("expert_shared_feed_forward_length", base.mlp.intermediate_size)
    scales = (m.get(k, 1.0, float) for k in GGUF_SCALES)
    own = Granite4Config(mamba2.from_gguf(m, base.norms.eps, CHUNK), *scales, width, True)
    rope = bool(m.md.get(m.key("rope.scaling.finetuned"), False))
    base = base.with_(num_key_value_heads=kv_heads or base.num_attention_heads)
    return _with(base, own, tuple(ATTN if a else MAMBA for a in attn), moe, rope)


def export(cfg: ModelConfig) -> dict[str, Any]:
    own = cfg.own(Granite4Config)
    m, moe = own.mamba, cfg.moe
    if cfg.rope.type != "default":
        what = f"writing granitemoehybrid with {cfg.rope.type} RoPE scaling"
        raise UnsupportedError(what, path=cfg.source, field="rope_parameters")
    return {
        "layer_types": ["mamba" if t == MAMBA else "attention" for t in cfg.layer_types],
        "position_embedding_type": "nope" if cfg.attention.no_rope_layers else "rope",
        "attention_bias": cfg.attention.bias,
        **{key: getattr(m, name) for name, (key, _) in MAMBA_KEYS.items()},
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


def checkpoint_names(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """The shared MLP under the checkpoints' names (input_linear: gate rows, then up;
    output_linear), a GGUF's split gate and up fused back."""
    out, halves = {}, {}
    for name, arr in params.items():
        m = _SPLIT.match(name)
        if m is None:
            out[_OURS.sub(lambda x: f"{x.group(1)}.{NAMES[x.group(2)]}.", name)] = arr
        else:
            halves.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = arr
    for (prefix, part), h in halves.items():
        out[f"{prefix}.input_linear.{part}"] = mx.concatenate([h["gate"], h["up"]], axis=0)
    return out


def _describe(c: ModelConfig) -> dict[str, Any]:
    own = c.own(Granite4Config)
    layers = sum(c.is_linear(i) for i in range(c.num_hidden_layers))
    more = {"rope": not c.attention.no_rope_layers, "scales": [getattr(own, k) for k in SCALES]}
    return {"mamba2": {**mamba2.describe(own.mamba, layers), **more}}


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    m = config["mamba2"]
    e, r, a, lg = m["scales"]
    return [
        mamba2.row(m, config["layers"]),
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
        regroup=checkpoint_names,
    ),
    mlx=MLXFormat(layouts={"mamba.conv1d.weight": (0, 2, 1)}),  # mlx-lm's sanitize: (C, K, 1)
    describe=Description(("mamba2",), _describe, _rows),
)
