"""The typed groups of ModelConfig that the shared blocks read (config.py holds ModelConfig and
its readers, and is where the rest of the package imports these from): a block reads its group,
and a model without such a block holds None where the group is optional."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # "default" | "linear" | "llama3" | "yarn" | "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between rotations beta_fast and beta_slow, its ends rounded out
    # (`truncate`, transformers' default; gpt-oss says false), q and k scaled by
    # attention_factor (cos and sin are, in transformers)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # longrope (Phi-3 / Phi-4): per-pair factors dividing each frequency, short_factor while
    # a pass stays within original_max_position_embeddings, long_factor past it;
    # attention_factor on q and k as yarn's
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class SpecialTokens:
    """The model's own special ids (config.json with generation_config.json, or the GGUF's
    tokenizer keys): read by the stop ids and the converter's written config."""

    bos: int | None = None  # the id a prompt begins with
    eos: tuple[int, ...] = ()  # the ids that end generation


@dataclass(frozen=True)
class DeltaNetConfig:
    """The Gated DeltaNet (linear attention) layers' shape (Qwen3.5, Qwen3-Next, Qwen4-Exp):
    read by deltanet.py and by the conventions that reorder its value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int
    # the projections fused per key head (Qwen3-Next): "qkvz" (in_proj_qkvz: each key head's
    # q, k, its value heads' v then z), "ba" (in_proj_ba: its value heads' β then α)
    fused: tuple[str, ...] = ()
    gate_act: str = "silu"  # the output gate (Qwen4-Exp: also "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts (Qwen3-MoE and the hybrids, Llama 4, gpt-oss, Gemma 4): read by
    experts.py and by the families' own expert blocks."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # each expert's width
    sparse_layers: tuple[bool, ...]  # [i]: layer i's MLP is the expert block
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum 1
    shared_expert_intermediate_size: int = 0  # a shared expert beside the routed ones (> 0)


@dataclass(frozen=True)
class MLPConfig:
    """The gated MLP, down(act(gate(x)) · up(x)): read by layers.MLP (and its activation by
    the experts)."""

    intermediate_size: int  # its width (a dense layer's; the experts' is the MoE's own)
    hidden_act: str = "silu"  # the gate's: SwiGLU (silu), GeGLU (the GELUs)
    bias: bool = False
    fused_gate_up: bool = False  # one gate|up projection (gate_up_proj): Phi-3 / Phi-4


@dataclass(frozen=True)
class NormConfig:
    """The residual stream's norms and scales: read by layers.norm and the decoders (the
    embedding's scale, the float32 residual, the sandwich norms, the final logits' softcap)."""

    eps: float
    kind: str = "rms"  # "rms" | "rms_plus_one" (Gemma: x̂·(1 + w), computed in float32)
    sandwich: bool = False  # also norm each sublayer's output (Gemma 2/3)
    embed_scale: bool = False  # embeddings × √hidden (Gemma)
    residual_f32: bool = False  # residual stream in float32 whatever the compute dtype (Gemma)
    final_logit_softcapping: float | None = None  # the head's logits to tanh(x / c)·c (Gemma 2)


@dataclass(frozen=True)
class AttentionConfig:
    """The softmax attention's options beyond its heads: read by layers.Attention and the
    attention kinds (a family's own: fused_qkv, sinks, qk_l2_norm, temperature), the RoPE
    variants by the decoders that build its Ropes."""

    bias: bool = False  # bias on q/k/v (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama's attention_bias also covers o_proj)
    fused_qkv: bool = False  # one q|k|v projection (qkv_proj): Phi-3 / Phi-4
    qk_norm: bool = False  # RMSNorm over head_dim on each head's q and k before RoPE
    qk_l2_norm: bool = False  # RMSNorm without weight on q and k after RoPE (Llama 4, RoPE layers)
    sinks: bool = False  # a learnt sink logit per head in each softmax (gpt-oss)
    query_pre_attn_scalar: float | None = None  # the scale 1/√this (Gemma 2/3), not 1/√head_dim
    logit_softcapping: float | None = None  # scores to tanh(x / c)·c (Gemma 2)
    # NoPE layers (Llama 4), or every layer (temperature_all: Ministral 3's
    # llama_4_scaling_beta), scale q by 1 + scale·log(1 + ⌊(p + offset) / floor⌋) at
    # position p: (floor, scale); the offset 1 (Llama 4) or 0 (Ministral 3)
    temperature: tuple[int, float] | None = None
    temperature_offset: int = 1
    temperature_all: bool = False
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (None: all)
    rope_interleaved: bool = False  # RoPE pairs adjacent dims (2i, 2i+1) (Llama 4's complex form)
    rope_local: RopeConfig | None = None  # RoPE of sliding-window layers (Gemma 3)
    no_rope_layers: tuple[bool, ...] = ()  # [i]: layer i has no RoPE (NoPE: Llama 4, SmolLM3)
    sliding_window: int | None = None  # the keys a sliding layer sees (Gemma 2/3, Mistral, ...)
    # chunked layers see the keys of their own chunk of this many positions only (Llama 4)
    chunk_size: int | None = None
    # False: an encoder, every position seeing every other (Gemma 4's
    # use_bidirectional_attention "all"): its logits are read whole, it does not generate
    causal: bool = True
