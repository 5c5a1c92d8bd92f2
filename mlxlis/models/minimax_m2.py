"""MiniMax-M2: pre-norm blocks over GQA attention without biases, q and k RMSNormed over the
whole projection (every head at once, one weight of heads·head_dim) before RoPE, RoPE on the
first rotary_dim dims of each head; every layer a mixture of experts routed by sigmoid scores
with a correction bias that sways the choice only, the top k weights renormalised to sum 1; no
dense MLP, no shared expert.

HF `minimax_m2` (the hub's and transformers' saved names: `block_sparse_moe.gate`, its
`e_score_correction_bias`, one tensor per expert `experts.{e}.w1|w3|w2` (gate, up, down),
stacked at load; transformers 5's in-memory `mlp.*` with fused `experts.gate_up_proj` loads
too). mlx-lm's `minimax` has the same names with the experts stacked as `switch_mlp` (its
router quantized at 8 bits). GGUF: llama.cpp's converter writes `minimax-m2` (its
MiniMaxM2Model: rows as they are, experts stacked 3-D, the bias as `exp_probs_b`, rotary_dim
as rope.dimension_count).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.base import (
    GGUF_LLAMA_BLOCK,
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.experts import PROJECTIONS, ExpertSource, SwitchGLU
from mlxlis.models.grouped_experts import GroupRouting, sigmoid_route
from mlxlis.models.layers import PreNormBlock, WholeQKNormAttention
from mlxlis.models.reading import check_act, expert_sizes, gguf_expert_sizes, moe_config
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

HF_DEFAULTS = {  # transformers' MiniMaxM2Config, for the keys the shared parser reads
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,  # each expert's width: the model has no dense MLP
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 196608,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000.0,  # MiniMaxM2Config.default_theta
    "tie_word_embeddings": False,
}
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
MOE = "block_sparse_moe"
GGUF_BLOCK = {
    **{k: v for k, v in GGUF_LLAMA_BLOCK.items() if not k.startswith("ffn_") or k == "ffn_norm"},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": f"{MOE}.gate",  # the router
    "exp_probs_b.bias": f"{MOE}.e_score_correction_bias",
    "ffn_gate_exps": f"{MOE}.switch_mlp.gate_proj",
    "ffn_up_exps": f"{MOE}.switch_mlp.up_proj",
    "ffn_down_exps": f"{MOE}.switch_mlp.down_proj",
}
# the checkpoints' per-expert names of the stacked projections
EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# transformers 5's in-memory names (its state_dict) for the block's feed-forward
_IN_MEMORY = re.compile(r"^(model\.layers\.\d+\.)mlp\.")


class MiniMaxMoE(nn.Module):
    """The router (a linear map, quantizable), its correction bias and the experts:
    x (B, T, hidden) -> (B, T, hidden)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.e_score_correction_bias = mx.zeros((moe.num_experts,))
        self.switch_mlp = SwitchGLU(cfg)
        self._k = moe.num_experts_per_tok

    def expert_stacks(self, prefix: str) -> dict[str, ExpertSource]:
        n = self.e_score_correction_bias.shape[0]
        fused = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        return {
            f"{prefix}.switch_mlp.{p}.weight": ExpertSource(
                tuple(f"{prefix}.experts.{e}.{EXPERT_PARTS[p]}.weight" for e in range(n)),
                f"{prefix}.experts.{fused.get(p, ('down_proj', None))[0]}",
                fused.get(p, ("down_proj", None))[1],
            )
            for p in PROJECTIONS
        }

    def __call__(self, x: mx.array) -> mx.array:
        # the logits in the router's dtype, as the reference's F.linear; sigmoid in float32
        bias = self.e_score_correction_bias
        inds, weights = sigmoid_route(self.gate(x), bias, self._k, True, GroupRouting())
        y = self.switch_mlp(x, inds)  # (B, T, k, hidden)
        return (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)


class MiniMaxM2Layer(PreNormBlock):
    """The pre-norm block over whole-projection q/k norm attention and the experts."""

    ffn_name = MOE
    attention = WholeQKNormAttention

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        super().__init__(cfg, rope, MiniMaxMoE(cfg))


class MiniMaxM2(Decoder):
    """The shared decoder with MiniMax-M2's blocks."""

    layer: type[nn.Module] = MiniMaxM2Layer

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = super().sanitize(weights)
        return {_IN_MEMORY.sub(rf"\1{MOE}.", k): v for k, v in out.items()}

    def expert_stacks(self) -> dict[str, ExpertSource]:
        stacks: dict[str, ExpertSource] = {}
        for i, layer in enumerate(self.model.layers):
            if layer is not None:
                stacks.update(layer[MOE].expert_stacks(f"model.layers.{i}.{MOE}"))
        return stacks


def _rotary(hd: int, rotary: Any, field: str, path: str) -> int | None:
    """The rotated dims of each head, checked; None for the whole head."""
    if isinstance(rotary, bool) or not isinstance(rotary, int) or not 0 < rotary <= hd:
        raise ConfigError(f"expected 1 to {hd}, got {rotary!r}"[:200], path=path, field=field)
    if rotary % 2:
        raise ConfigError(f"an odd rotary width {rotary}", path=path, field=field)
    return rotary if rotary < hd else None


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    n, hd = base.num_hidden_layers, base.head_dim
    rope = cfg.get("rope_parameters")
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if factor is not None:  # transformers 5 states it there, and prefers it to rotary_dim
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            raise ConfigError(
                f"bad partial_rotary_factor {factor!r}"[:200],
                path=path,
                field="rope_parameters.partial_rotary_factor",
            )
        rotary = _rotary(hd, int(hd * factor), "rope_parameters.partial_rotary_factor", path)
    else:
        rotary = _rotary(hd, cfg.get("rotary_dim", hd), "rotary_dim", path)
    # what transformers' MiniMaxM2 does not have is refused rather than ignored
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedError(
            f"routing by {cfg['scoring_func']!r} is not MiniMax-M2's",
            path=path,
            field="scoring_func",
        )
    if cfg.get("use_qk_norm", True) is not True or cfg.get("qk_norm_type", "per_layer") != (
        "per_layer"
    ):
        raise UnsupportedError(
            "MiniMax-M2 norms q and k over the whole projection", path=path, field="use_qk_norm"
        )
    if cfg.get("shared_intermediate_size", 0):
        raise UnsupportedError(
            "a shared expert is not MiniMax-M2's", path=path, field="shared_intermediate_size"
        )
    sizes = {
        "num_experts": ("num_local_experts", cfg.get("num_local_experts", 256)),
        "num_experts_per_tok": ("num_experts_per_tok", cfg.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": ("intermediate_size", base.mlp.intermediate_size),
    }
    moe = moe_config(expert_sizes(sizes, path), (True,) * n, norm_topk_prob=True)
    attention = replace(base.attention, bias=False, o_bias=False, rotary_dim=rotary)
    mlp = replace(base.mlp, bias=False)
    return check_act(base.with_(attention=attention, mlp=mlp, moe=moe), path)


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    if m.get("expert_gating_func", SIGMOID) != SIGMOID:
        raise ConfigError(
            "minimax-m2 routes by sigmoid", path=m.path, field=m.key("expert_gating_func")
        )
    n, hd = base.num_hidden_layers, base.head_dim
    rotary = _rotary(hd, m.get("rope.dimension_count", hd), m.key("rope.dimension_count"), m.path)
    moe = moe_config(gguf_expert_sizes(m), (True,) * n, norm_topk_prob=True)
    return base.with_(attention=replace(base.attention, rotary_dim=rotary), moe=moe)


def export(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {  # rope_theta comes from the shared keys
        "head_dim": cfg.head_dim,
        "rotary_dim": cfg.attention.rotary_dim or cfg.head_dim,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "intermediate_size": moe.intermediate_size,
        "scoring_func": "sigmoid",
        "use_qk_norm": True,
        "shared_intermediate_size": 0,  # mlx-lm requires the key
    }


def _describe(c: ModelConfig) -> dict[str, Any]:
    return {"minimax_routing": {"rotary_dim": c.attention.rotary_dim or c.head_dim}}


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    g = config["minimax_routing"]
    return [
        (
            "routing",
            "sigmoid scores; a per-expert correction bias sways the choice, not the weights; "
            "the chosen weights renormalised to sum 1; no shared expert",
        ),
        ("attention", "q/k norms over all heads at once"),
        ("rotary", f"RoPE on the first {g['rotary_dim']} dims of each head"),
    ]


MINIMAX_M2 = Family(
    name="minimax_m2",
    hf=HFFormat(model_types=("minimax_m2",), parse=parse_hf, defaults=HF_DEFAULTS),
    gguf=GGUFFormat(archs=("minimax-m2",), parse=parse_gguf, block=GGUF_BLOCK),
    network=MiniMaxM2,
    export=Export(model_type="minimax_m2", architecture="MiniMaxM2ForCausalLM", config=export),
    describe=Description(("minimax_routing",), _describe, _rows),
)
