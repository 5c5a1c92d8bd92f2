"""The typed groups of ModelConfig that the shared blocks read (config.py holds ModelConfig and
its readers, and is where the rest of the package imports these from): a block reads its group,
and a model without such a block holds None where the group is optional."""

from __future__ import annotations

from dataclasses import dataclass


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
