"""gpt-oss (20B, 120B): the Llama decoder with
  attention     q/k/v/o biases, a learnt sink logit per head in every softmax, sliding-window
                (sliding_window) and full layers alternating (layer_types), YaRN RoPE
  MoE           every layer: a router with bias whose top k logits are softmaxed into the
                weights; experts with biases and the clamped SwiGLU
                gate·sigmoid(alpha·gate)·(up + 1), gate ≤ limit, |up| ≤ limit
HF `gpt_oss` in both of OpenAI's layouts: MXFP4 experts (`experts.gate_up_proj_blocks` /
`_scales`: (E, 2F, in/32, 16) uint8 codes and (E, 2F, in/32) E8M0 scales, gate and up rows
interleaved), kept as MLX's "mxfp4" quantization, bit for bit; or dense (`experts.gate_up_proj`
(E, in, 2F), columns interleaved, `down_proj` (E, F, in)). mlx-lm's layout (experts split as
`experts.{gate,up,down}_proj`, which `convert` writes). GGUF `gpt-oss` (llama.cpp's names;
its MXFP4 experts kept as MLX's mxfp4 too; the SwiGLU constants it fixes, 1.702 and 7, read
the same way; its YaRN always rounds the ramp's ends, config.py's truncate).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxlis.errors import ConfigError
from mlxlis.limits import check_sizes
from mlxlis.models.activations import clamped_swiglu
from mlxlis.models.attention import attend
from mlxlis.models.base import GGUF_LLAMA_BLOCK, Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import FamilyConfig, ModelConfig, number
from mlxlis.models.decoder import Decoder
from mlxlis.models.experts import PROJECTIONS, ExpertSource, SwitchGLU
from mlxlis.models.layers import Attention, Mask, PreNormBlock
from mlxlis.models.reading import expert_sizes, gguf_expert_sizes, moe_config
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

# transformers' GptOssConfig defaults for keys a config.json may omit
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
HF_DEFAULTS = {
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "attention_bias": True,
    "intermediate_size": 2880,
    "rope_scaling": YARN,  # when the file gives neither rope_parameters nor rope_scaling
}
SIZES = {  # our field: (its config.json key, transformers' default)
    "num_experts": ("num_local_experts", 128),
    "num_experts_per_tok": ("num_experts_per_tok", 4),
    "moe_intermediate_size": ("intermediate_size", 2880),
}
ALPHA, LIMIT = 1.702, 7.0  # swiglu_alpha, swiglu_limit (llama.cpp: fixed at these)
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Swiglu(FamilyConfig):
    alpha: float = ALPHA
    limit: float = LIMIT


def _layer_types(cfg: dict, n: int, window: int | None, path: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:  # transformers: sliding on even layers (full ones without a window)
        return tuple(LAYER_TYPES[i % 2 if window else 1] for i in range(n))
    if (
        not isinstance(types, list)
        or len(types) != n
        or any(t not in LAYER_TYPES for t in types)
        or (window is None and "sliding_attention" in types)
    ):
        raise ConfigError(
            f"expected {n} of {LAYER_TYPES} (sliding only with sliding_window), got {types!r}"[
                :300
            ],
            path=path,
            field="layer_types",
        )
    return tuple(types)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    size = expert_sizes({f: (k, cfg.get(k, v)) for f, (k, v) in SIZES.items()}, path)
    window = cfg.get("sliding_window", 128)
    if window is not None:
        window = check_sizes({"sliding_window": ("sliding_window", window)}, path)
        window = window["sliding_window"]
    act = {}
    for key, default in (("swiglu_alpha", ALPHA), ("swiglu_limit", LIMIT)):
        v = cfg.get(key, default)
        if not number(v) or v <= 0:
            raise ConfigError(f"expected a positive number, got {v!r}"[:200], path=path, field=key)
        act[key] = float(v)
    return base.with_(
        moe=moe_config(size, (True,) * base.num_hidden_layers),
        layer_types=_layer_types(cfg, base.num_hidden_layers, window, path),
        attention=replace(base.attention, sinks=True, sliding_window=window),
        family_config=Swiglu(act["swiglu_alpha"], act["swiglu_limit"]),
    )


def parse_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    size = gguf_expert_sizes(meta)
    key = meta.key("attention.sliding_window")
    window = meta.get("attention.sliding_window")
    window = check_sizes({"sliding_window": (key, window)}, meta.path)["sliding_window"]
    n = base.num_hidden_layers
    # llama.cpp's load_swa_pattern(ml, 2): layer i slides when i % 2 == 0 (a file's own
    # pattern key is not written by its converter, and refused here rather than misread)
    if meta.has("attention.sliding_window_pattern"):
        raise ConfigError(
            "a sliding-window pattern other than every second layer is not supported",
            path=meta.path,
            field=meta.key("attention.sliding_window_pattern"),
        )
    return base.with_(
        moe=moe_config(size, (True,) * n),
        layer_types=tuple(LAYER_TYPES[i % 2] for i in range(n)),
        attention=replace(base.attention, sinks=True, sliding_window=window),
        family_config=Swiglu(),
    )


def export(cfg: ModelConfig) -> dict[str, Any]:
    """GptOssConfig's keys (mlx-lm's gpt_oss reads them too)."""
    act = cfg.own(Swiglu)
    return {
        "attention_bias": True,
        "intermediate_size": cfg.moe.intermediate_size,
        "num_local_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.num_experts_per_tok,
        "sliding_window": cfg.attention.sliding_window,
        "layer_types": list(cfg.layer_types),
        "swiglu_alpha": act.alpha,
        "swiglu_limit": act.limit,
    }


class GptOssMoE(nn.Module):
    """x (B, T, hidden) -> Σ over the top k experts of softmax(top-k router logits) ·
    expert(x) (transformers' GptOssTopKRouter, GptOssExperts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        act = cfg.own(Swiglu)
        self.top_k = cfg.moe.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=True)
        self.experts = SwitchGLU(cfg, bias=True, act=clamped_swiglu(act.alpha, act.limit))

    def __call__(self, x: mx.array) -> mx.array:
        k = self.top_k
        logits = self.router(x)  # (B, T, E)
        inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]  # (B, T, k), any order
        top = mx.take_along_axis(logits, inds, axis=-1)
        weights = mx.softmax(top.astype(mx.float32), axis=-1, precise=True).astype(x.dtype)
        y = self.experts(x, mx.stop_gradient(inds))  # (B, T, k, hidden)
        return (y * weights[..., None]).sum(axis=-2)


class SinkAttention(Attention):
    """The common attention with a learnt sink logit per head in each softmax."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        super().__init__(cfg, rope)
        self.sinks = mx.zeros((self.n_heads,))

    def attend_heads(self, q, k, v, mask: Mask) -> mx.array:
        return attend(q, k, v, self.scale, mask, self.softcap, self.sinks, heads_last=True)


class GptOssLayer(PreNormBlock):
    """Pre-norm attention (with sinks) and the MoE."""

    attention = SinkAttention

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        super().__init__(cfg, rope, GptOssMoE(cfg))


class GptOss(Decoder):
    """The shared decoder with gpt-oss's blocks."""

    layer = GptOssLayer

    def expert_stacks(self) -> dict[str, ExpertSource | tuple[ExpertSource, ...]]:
        """The split experts -> OpenAI's fused tensors: MXFP4 blocks and scales (E, 2F, ...)
        with gate and up rows interleaved, or dense (E, in, 2F) with the columns interleaved
        (then transposed); the biases (E, 2F) interleaved likewise."""
        stacks: dict[str, ExpertSource | tuple[ExpertSource, ...]] = {}
        for i, layer in enumerate(self.model.layers):
            if layer is None:
                continue
            p = f"model.layers.{i}.mlp.experts"
            for proj in PROJECTIONS:
                half = {"gate_proj": 0, "up_proj": 1}.get(proj)
                src = f"{p}.gate_up_proj" if half is not None else f"{p}.down_proj"
                one = {"half": half, "strided": half is not None}
                stacks[f"{p}.{proj}.weight"] = (
                    ExpertSource((), f"{src}_blocks", axis=1, blocks=True, **one),
                    ExpertSource((), src, axis=2, axes=(0, 2, 1), **one),
                )
                stacks[f"{p}.{proj}.scales"] = ExpertSource((), f"{src}_scales", axis=1, **one)
                stacks[f"{p}.{proj}.bias"] = ExpertSource((), f"{src}_bias", axis=1, **one)
        return stacks


_E = "mlp.experts"
GPT_OSS = Family(
    name="gpt_oss",
    hf=HFFormat(
        model_types=("gpt_oss",),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
    ),
    gguf=GGUFFormat(
        archs=("gpt-oss",),
        parse=parse_gguf,
        block={
            **{k: v for k, v in GGUF_LLAMA_BLOCK.items() if not k.startswith("ffn_")},
            "post_attention_norm": "post_attention_layernorm",
            "attn_sinks.weight": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
            "ffn_gate_exps": f"{_E}.gate_proj",
            "ffn_up_exps": f"{_E}.up_proj",
            "ffn_down_exps": f"{_E}.down_proj",
        },
    ),
    network=GptOss,
    export=Export(
        model_type="gpt_oss",
        architecture="GptOssForCausalLM",
        config=export,
    ),
)
