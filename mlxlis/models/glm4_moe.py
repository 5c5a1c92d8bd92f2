"""GLM-4.5 / 4.6 / 4.7: pre-norm blocks over GQA attention with q/k/v biases (no o_proj bias),
RoPE on the first half of each head only (partial_rotary_factor, 0.5 by default), per-head q/k
RMSNorms where use_qk_norm; the first first_k_dense_replace layers a dense SwiGLU, the rest a
mixture of experts routed by sigmoid scores within the best groups, with a correction bias that
sways the choice only, scaled routed weights and shared experts (grouped_experts.py).

HF `glm4_moe` (experts one tensor each, or transformers 5's fused ones; the checkpoints' extra
next-n layer, `model.layers.{num_hidden_layers}...`, skipped at load and read when
`--speculative mtp` drafts with it: nextn.py); mlx-lm's glm4_moe has the same names
(`switch_mlp` stacked). GGUF:
llama.cpp's converter writes `glm4moe` (its Glm4MoeModel: Q/K rows as they are, experts
stacked 3-D, the correction bias as `exp_probs_b`, the next-n layer as an extra block
counted in block_count, with its blk.N.nextn.* tensors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from mlxlis.cache import KVCache
from mlxlis.errors import ConfigError
from mlxlis.models.base import (
    GGUF_LLAMA_BLOCK,
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.experts import ExpertSource
from mlxlis.models.grouped_experts import GroupedMoE, GroupRouting, read_gguf, read_hf
from mlxlis.models.layers import MLP, PreNormBlock
from mlxlis.models.nextn import nextn_drafter
from mlxlis.models.reading import check_act
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

HF_DEFAULTS = {  # transformers' Glm4MoeConfig, for the keys the shared parser reads
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
PARTIAL = 0.5  # Glm4MoeConfig's partial_rotary_factor default
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
GGUF_BLOCK = {
    **GGUF_LLAMA_BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the router
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
ROUTER_DEFAULTS = {  # Glm4MoeConfig's
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
_LAYER = re.compile(r"^(?:model\.layers|blk)\.(\d+)\.")


@dataclass(frozen=True)
class Glm4MoeConfig(FamilyConfig):
    """The router's options, and the next-n layers the checkpoint holds (drafters)."""

    routing: GroupRouting
    mtp_layers: int = 0


class Glm4MoeLayer(PreNormBlock):
    """The pre-norm block over attention and a dense MLP (the first layers) or the experts."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        routing = cfg.own(Glm4MoeConfig).routing
        super().__init__(cfg, rope, GroupedMoE(cfg, routing) if cfg.is_sparse(layer) else MLP(cfg))


class Glm4Moe(Decoder):
    """The shared decoder with GLM-4.5's blocks; the next-token layers' tensors dropped."""

    layer: type[nn.Module] = Glm4MoeLayer

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        n = self.config.num_hidden_layers
        out = super().sanitize(weights)
        return {k: v for k, v in out.items() if not _past(k, n)}

    def expert_stacks(self) -> dict[str, ExpertSource]:
        stacks: dict[str, ExpertSource] = {}
        for i, layer in enumerate(self.model.layers):
            if layer is not None and isinstance(layer.mlp, GroupedMoE):
                stacks.update(layer.mlp.expert_stacks(f"model.layers.{i}.mlp"))
        return stacks


def _past(name: str, n: int) -> bool:
    """A tensor of a layer past the n decoder layers (a next-token layer)."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= n


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    hd = base.head_dim
    rope = cfg.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", PARTIAL))
    if not (isinstance(factor, (int, float)) and 0 < factor <= 1 and int(hd * factor) % 2 == 0):
        raise ConfigError(
            f"bad partial_rotary_factor {factor!r}", path=path, field="partial_rotary_factor"
        )
    rotary = int(hd * factor)
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1)) or 0
    base, routing = read_hf(cfg, base, path, ROUTER_DEFAULTS)
    attention = replace(
        base.attention,
        o_bias=False,  # attention_bias covers q, k and v only
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        rotary_dim=rotary if rotary < hd else None,
    )
    own = Glm4MoeConfig(routing, int(mtp) if isinstance(mtp, int) else 0)
    mlp = replace(base.mlp, bias=False)
    return check_act(base.with_(attention=attention, mlp=mlp, family_config=own), path)


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    mtp = m.get("nextn_predict_layers", 0)
    n = base.num_hidden_layers - mtp
    if n < 1:
        raise ConfigError(
            f"{mtp} next-token layers of {base.num_hidden_layers}",
            path=m.path,
            field=m.key("nextn_predict_layers"),
        )
    if m.get("expert_gating_func", SIGMOID) != SIGMOID:
        raise ConfigError(
            "glm4moe routes by sigmoid", path=m.path, field=m.key("expert_gating_func")
        )
    base, routing = read_gguf(base.with_(num_hidden_layers=n), m, 1)
    rotary = m.get("rope.dimension_count", base.head_dim)
    attention = replace(
        base.attention,
        qk_norm="blk.0.attn_q_norm.weight" in m.shapes,
        rotary_dim=rotary if rotary < base.head_dim else None,
    )
    return base.with_(attention=attention, family_config=Glm4MoeConfig(routing, mtp))


def export(cfg: ModelConfig) -> dict[str, Any]:
    moe, r, a = cfg.moe, cfg.own(Glm4MoeConfig).routing, cfg.attention
    return {  # rope_theta comes from the shared keys
        "attention_bias": a.bias,
        "head_dim": cfg.head_dim,
        "partial_rotary_factor": (a.rotary_dim or cfg.head_dim) / cfg.head_dim,
        "use_qk_norm": a.qk_norm,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.intermediate_size,
        "n_shared_experts": r.shared_intermediate_size // moe.intermediate_size,
        "n_group": r.n_group,
        "topk_group": r.topk_group,
        "routed_scaling_factor": r.routed_scaling_factor,
        "norm_topk_prob": moe.norm_topk_prob,
        "first_k_dense_replace": moe.sparse_layers.index(True)
        if any(moe.sparse_layers)
        else cfg.num_hidden_layers,
        "num_nextn_predict_layers": 0,  # not written
        # mlx-lm requires the key; a scaled RoPE's comes from the shared keys
        **({"rope_scaling": None} if cfg.rope.type == "default" else {}),
    }


def _describe(c: ModelConfig) -> dict[str, Any]:
    own = c.own(Glm4MoeConfig)
    r = own.routing
    return {
        "grouped_routing": {
            "groups": r.n_group,
            "groups_used": r.topk_group,
            "renormalised": c.moe.norm_topk_prob,
            "routed_scale": r.routed_scaling_factor,
            "shared_width": r.shared_intermediate_size,
            "rotary_dim": c.attention.rotary_dim or c.head_dim,
            "mtp_layers": own.mtp_layers,
        }
    }


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    g = config["grouped_routing"]
    weights = "renormalised, then" if g["renormalised"] else "then"
    rows = [
        (
            "routing",
            "sigmoid scores; a per-expert correction bias sways the choice, not the weights; "
            f"experts from the best {g['groups_used']} of {g['groups']} groups (each worth its "
            f"two best scores); the weights {weights} × {g['routed_scale']:g}",
        ),
        ("rotary", f"RoPE on the first {g['rotary_dim']} dims of each head"),
    ]
    if g["shared_width"]:
        rows.append(
            ("shared", f"shared experts: one MLP of width {g['shared_width']}, every token")
        )
    if n := g["mtp_layers"]:  # the config's count: a conversion may have dropped them
        rows.append(
            ("mtp", f"{n} next-n layer(s): drafts for --speculative mtp if the file has it")
        )
    return rows


GLM4_MOE = Family(
    name="glm4_moe",
    hf=HFFormat(model_types=("glm4_moe",), parse=parse_hf, defaults=HF_DEFAULTS),
    gguf=GGUFFormat(
        archs=("glm4moe",),
        parse=parse_gguf,
        block=GGUF_BLOCK,
        ignored=lambda name, cfg: _past(name, cfg.num_hidden_layers),
    ),
    network=Glm4Moe,
    export=Export(model_type="glm4_moe", architecture="Glm4MoeForCausalLM", config=export),
    describe=Description(("grouped_routing",), _describe, _rows),
    mtp=nextn_drafter(Glm4MoeLayer, lambda one: [KVCache()]),  # the next-n layer: nextn.py
)
