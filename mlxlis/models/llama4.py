"""Llama 4 (Scout, Maverick), text: the Llama decoder with
  RoPE          interleaved pairs (the complex rotation), llama3 scaling where configured
  layers        chunked attention (a query sees its own chunk of attention_chunk_size) on the
                RoPE layers; every no_rope_layer_interval-th layer (or where no_rope_layers
                says 0) full attention without RoPE, its queries scaled by position
                (attn_temperature_tuning: 1 + attn_scale·log(1 + ⌊(p + 1) / floor_scale⌋))
  q/k norm      RMSNorm without weight after RoPE, on the RoPE layers (use_qk_norm)
  MoE           on every interleave_moe_layer_step-th layer (or moe_layers): a router whose top
                k logits, through a sigmoid, scale each chosen expert's INPUT; plus a shared
                expert every token runs; experts and shared expert of intermediate_size, the
                dense layers' MLP of intermediate_size_mlp
HF `llama4_text` and the `llama4` wrapper (`language_model.*`; its vision tower and projector
are skipped and said), mlx-lm's layout (experts stacked as `experts.{gate,up,down}_proj`, which
`convert` writes too, under `language_model.`), GGUF `llama4` (no Q/K permutation: the
converter's Llama4Model sets undo_permute False; what llama.cpp fixes rather than reads, its
chunk of 8192, NoPE every 4th layer, temperature floor 8192 and scale 0.1, and the q/k norm on
all but the 128-expert model, is read the same way here). Defaults are transformers'
Llama4TextConfig.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import CONFIG_MAX_CONTEXT, check_sizes
from mlxlis.models.base import GGUF_LLAMA_BLOCK, Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.experts import PROJECTIONS, ExpertSource, SwitchGLU
from mlxlis.models.layers import MLP, PreNormBlock, TemperedAttention
from mlxlis.models.reading import (
    check_act,
    expert_sizes,
    flag,
    gguf_expert_sizes,
    moe_config,
    rope_freqs_as_config,
)
from mlxlis.models.rope import Rope
from mlxlis.runtime import fused

import mlx.core as mx
import mlx.nn as nn

HF_DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
SIZES = {  # our field: (its config.json key, transformers' Llama4TextConfig default)
    "intermediate_size": ("intermediate_size_mlp", 16384),  # the dense layers'
    "moe_intermediate_size": ("intermediate_size", 8192),  # each expert's, the shared one's
    "num_experts": ("num_local_experts", 16),
    "num_experts_per_tok": ("num_experts_per_tok", 1),
    "decoder_sparse_step": ("interleave_moe_layer_step", 1),
    "no_rope_layer_interval": ("no_rope_layer_interval", 4),
    "floor_scale": ("floor_scale", 8192),
}
BOUNDS = {"floor_scale": CONFIG_MAX_CONTEXT}  # its own sizes' bounds (limits.check_sizes)
CHUNK_DEFAULT = 8192
ATTN_SCALE_DEFAULT = 0.1
# llama.cpp's llama4 graph: constants it sets rather than reads (llama_model_llama4 hparams)
GGUF_CHUNK, GGUF_NOPE_EVERY, GGUF_FLOOR, GGUF_TEMP = 8192, 4, 8192, 0.1
GGUF_NO_QK_NORM_EXPERTS = 128  # Maverick (128 experts) has no q/k norm
LAYER_TYPES = ("chunked_attention", "full_attention")


def _layers(cfg: dict, key: str, path: str) -> list[int] | None:
    value = cfg.get(key)
    if value is None or (value == [] and key == "no_rope_layers"):
        return None  # transformers: an empty no_rope_layers is the default; moe_layers [] none
    if not isinstance(value, list) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in value
    ):
        raise ConfigError(f"expected a list of integers, got {value!r}"[:200], path=path, field=key)
    return value


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    n = base.num_hidden_layers
    size = expert_sizes({f: (k, cfg.get(k, v)) for f, (k, v) in SIZES.items()}, path, BOUNDS)
    moe = _layers(cfg, "moe_layers", path)
    if moe is None:
        step = size["decoder_sparse_step"]
        moe = list(range(step - 1, n, step))
    elif any(not 0 <= i < n for i in moe):
        raise ConfigError(f"layer indices must be below {n}", path=path, field="moe_layers")
    rope_on = _layers(cfg, "no_rope_layers", path)  # 1: the layer has RoPE (sic)
    if rope_on is None:
        every = size["no_rope_layer_interval"]
        rope_on = [int((i + 1) % every != 0) for i in range(n)]
    elif len(rope_on) < n or any(v not in (0, 1) for v in rope_on):
        raise ConfigError(
            f"expected {n} flags of 0 or 1, got {rope_on!r}"[:200],
            path=path,
            field="no_rope_layers",
        )
    chunk = cfg.get("attention_chunk_size", CHUNK_DEFAULT)
    if chunk is not None:
        chunk = check_sizes({"attention_chunk_size": ("attention_chunk_size", chunk)}, path)
        chunk = chunk["attention_chunk_size"]
    types = cfg.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[not (r and chunk is not None)] for r in rope_on[:n]]
    if (
        not isinstance(types, list)
        or len(types) != n
        or any(t not in LAYER_TYPES for t in types)
        or (chunk is None and "chunked_attention" in types)
    ):
        raise ConfigError(
            f"expected {n} of {LAYER_TYPES} (chunked only with attention_chunk_size), "
            f"got {types!r}"[:300],
            path=path,
            field="layer_types",
        )
    tuning = cfg.get("attn_temperature_tuning", True)  # early configs wrote 4 (truthy)
    if not isinstance(tuning, (bool, int)):
        raise ConfigError(
            f"expected a flag, got {tuning!r}", path=path, field="attn_temperature_tuning"
        )
    scale = cfg.get("attn_scale", ATTN_SCALE_DEFAULT)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ConfigError(f"expected a number, got {scale!r}", path=path, field="attn_scale")
    attention = replace(
        base.attention,
        rope_interleaved=True,
        qk_l2_norm=flag({"use_qk_norm": cfg.get("use_qk_norm", True)}, "use_qk_norm", path),
        temperature=(size["floor_scale"], float(scale)) if tuning else None,
        no_rope_layers=tuple(not r for r in rope_on[:n]),
        chunk_size=chunk,
    )
    return check_act(
        base.with_(
            moe=moe_config(size, tuple(i in moe for i in range(n))),
            attention=attention,
            layer_types=tuple(types),
            mlp=replace(base.mlp, intermediate_size=size["intermediate_size"], bias=False),
        ),
        path,
    )


def parse_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    if meta.has("attention.sliding_window") and meta.get("attention.sliding_window") == 0:
        raise UnsupportedError(
            "a llama4 file without attention chunks (llama.cpp then keeps RoPE off the last "
            "layer only) is not supported",
            path=meta.path,
            field=meta.key("attention.sliding_window"),
        )
    n = base.num_hidden_layers
    size = gguf_expert_sizes(meta)
    nope = tuple((i + 1) % GGUF_NOPE_EVERY == 0 for i in range(n))
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in meta.shapes for i in range(n))
    attention = replace(
        base.attention,
        rope_interleaved=True,
        qk_l2_norm=size["num_experts"] != GGUF_NO_QK_NORM_EXPERTS,
        temperature=(GGUF_FLOOR, GGUF_TEMP),
        no_rope_layers=nope,
        chunk_size=GGUF_CHUNK,
    )
    return base.with_(
        moe=moe_config(size, sparse),
        attention=attention,
        layer_types=tuple(LAYER_TYPES[x] for x in nope),
    )


def export(cfg: ModelConfig) -> dict[str, Any]:
    """Llama4TextConfig's keys (mlx-lm's llama4 reads them under the wrapper's text_config)."""
    sparse = [i for i, s in enumerate(cfg.moe.sparse_layers) if s]
    step = sparse[0] + 1 if sparse else 1
    if sparse != list(range(step - 1, cfg.num_hidden_layers, step)):
        raise UnsupportedError(
            f"MoE layers {sparse} are not every n-th (mlx-lm reads interleave_moe_layer_step)",
            path=cfg.source,
            field="moe_layers",
        )
    floor, scale = cfg.attention.temperature or (SIZES["floor_scale"][1], ATTN_SCALE_DEFAULT)
    return {
        "attention_bias": cfg.attention.bias,
        "intermediate_size": cfg.moe.intermediate_size,
        "intermediate_size_mlp": cfg.mlp.intermediate_size,
        "num_local_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.num_experts_per_tok,
        "interleave_moe_layer_step": step,
        "moe_layers": sparse,
        "no_rope_layers": [int(not x) for x in cfg.attention.no_rope_layers],
        "attention_chunk_size": cfg.attention.chunk_size,
        "layer_types": list(cfg.layer_types),
        "use_qk_norm": cfg.attention.qk_l2_norm,
        "attn_temperature_tuning": cfg.attention.temperature is not None,
        "floor_scale": floor,
        "attn_scale": scale,
        # mlx-lm's llama4 requires the key (the shared writer gives it only when scaled)
        **({"rope_scaling": None} if cfg.rope.type == "default" else {}),
    }


class Llama4MoE(nn.Module):
    """x (B, T, hidden) -> Σ over the top k experts e of expert_e(x · sigmoid(logit_e)), plus
    the shared expert of x (transformers' Llama4TextMoe: the score scales the input)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.moe.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.experts = SwitchGLU(cfg)
        self.shared_expert = MLP(cfg, cfg.moe.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        k = self.top_k
        logits = self.router(x)  # (B, T, E)
        inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]  # (B, T, k), any order
        top = mx.take_along_axis(logits, inds, axis=-1)
        scores = mx.sigmoid(top.astype(mx.float32)).astype(x.dtype)  # as transformers: f32
        y = self.experts(x[..., None, :] * scores[..., None], mx.stop_gradient(inds))
        return y.sum(axis=-2) + self.shared_expert(x)  # (B, T, hidden)


class Llama4Attention(TemperedAttention):
    """RoPE layers: q and k RMSNormed without weight after RoPE (use_qk_norm); NoPE layers:
    the queries' temperature (attn_temperature_tuning: TemperedAttention's, offset 1)."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        super().__init__(cfg, rope)
        if rope is not None:
            self._temperature = None
        self._l2_eps = cfg.norms.eps if cfg.attention.qk_l2_norm and rope is not None else None

    def after_rope(self, q, k, offset) -> tuple[mx.array, mx.array]:
        if self._l2_eps is not None:
            q = fused.rms_norm(q, None, self._l2_eps)
            k = fused.rms_norm(k, None, self._l2_eps)
        return super().after_rope(q, k, offset)


class Llama4Layer(PreNormBlock):
    """Pre-norm attention and feed-forward (the MoE or a dense MLP) under the checkpoint's
    names (`feed_forward`, not `mlp`)."""

    ffn_name = "feed_forward"
    attention = Llama4Attention

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        super().__init__(cfg, rope, Llama4MoE(cfg) if cfg.is_sparse(layer) else MLP(cfg))


class Llama4(Decoder):
    """The shared decoder with Llama 4's blocks."""

    layer = Llama4Layer

    def expert_stacks(self) -> dict[str, ExpertSource]:
        """The stacked experts -> transformers' fused `experts.gate_up_proj` (E, hidden, 2·F:
        gate columns, then up) and `experts.down_proj` (E, F, hidden), transposed."""
        fused = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        stacks: dict[str, ExpertSource] = {}
        for i, layer in enumerate(self.model.layers):
            if layer is None or not isinstance(layer.feed_forward, Llama4MoE):
                continue
            p = f"model.layers.{i}.feed_forward.experts"
            for proj in PROJECTIONS:
                name, half = fused.get(proj, ("down_proj", None))
                stacks[f"{p}.{proj}.weight"] = ExpertSource((), f"{p}.{name}", half, 2, (0, 2, 1))
        return stacks


_FFN = "feed_forward"
LLAMA4 = Family(
    name="llama4",
    hf=HFFormat(
        model_types=("llama4_text", "llama4"),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
        renames=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
        dropped=("vision_model.", "multi_modal_projector."),
    ),
    gguf=GGUFFormat(
        archs=("llama4",),
        parse=parse_gguf,
        rope_freqs=rope_freqs_as_config,
        block={
            **{k: v for k, v in GGUF_LLAMA_BLOCK.items() if not k.startswith("ffn_")},
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate": f"{_FFN}.gate_proj",
            "ffn_up": f"{_FFN}.up_proj",
            "ffn_down": f"{_FFN}.down_proj",
            "ffn_gate_inp": f"{_FFN}.router",
            "ffn_gate_exps": f"{_FFN}.experts.gate_proj",
            "ffn_up_exps": f"{_FFN}.experts.up_proj",
            "ffn_down_exps": f"{_FFN}.experts.down_proj",
            "ffn_gate_shexp": f"{_FFN}.shared_expert.gate_proj",
            "ffn_up_shexp": f"{_FFN}.shared_expert.up_proj",
            "ffn_down_shexp": f"{_FFN}.shared_expert.down_proj",
        },
    ),
    network=Llama4,
    export=Export(
        model_type="llama4_text",
        architecture="Llama4ForConditionalGeneration",
        config=export,
        wrapper="llama4",  # mlx-lm reads the wrapper type only, its tensors under:
        prefix="language_model.",
    ),
)
