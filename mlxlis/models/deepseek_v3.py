"""DeepSeek V3 / V3.1 / R1, Kimi K2: pre-norm blocks over multi-head latent attention (mla.py:
a cache of one latent and one rope key per position, the up-projections absorbed; the query
full-rank or through q_lora_rank; RoPE on the rope dims only, on interleaved pairs where
rope_interleave; YaRN's mscale(factor, mscale_all_dim)² on the softmax scale, its attention
factor on q and k's rope dims); the first first_k_dense_replace layers a dense SwiGLU, the
rest GLM-4.5's mixture (grouped_experts.py: sigmoid scores, a correction bias for the choice
only, the best topk_group of n_group groups, renormalised and scaled weights, shared experts).

HF `deepseek_v3` (experts one tensor each, or transformers 5's fused ones; the next-token
layers `model.layers.{num_hidden_layers}...` skipped: drafting with them is not
implemented); mlx-lm's deepseek_v3 saves kv_b_proj split as embed_q / unembed_out, which a
folder with a quantization block is read as. GGUF: llama.cpp's converter writes `deepseek2`
(one KV head of key_length kv_lora_rank + rope, kv_b_proj split into k_b (n_heads,
kv_lora_rank, nope) and v_b (n_heads, v, kv_lora_rank), the experts stacked, the correction
bias as exp_probs_b, yarn_log_multiplier = 0.1·mscale_all_dim, its next-token layers left out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.base import (
    GGUF_LLAMA_BLOCK,
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import FamilyConfig, ModelConfig, RopeConfig, yarn_keys, yarn_mscale
from mlxlis.models.decoder import Decoder
from mlxlis.models.experts import ExpertSource
from mlxlis.models.glm4_moe import BOUNDS, SIGMOID, _past
from mlxlis.models.grouped_experts import GroupedMoE, GroupRouting, checked_routing
from mlxlis.models.layers import MLP, Cache, PreNormBlock
from mlxlis.models.mla import LatentAttention, LatentDims, latent_caches
from mlxlis.models.network import NoDraftHead
from mlxlis.models.reading import check_act, expert_sizes, flag, gguf_expert_sizes, moe_config
from mlxlis.models.rope import Rope

import mlx.nn as nn

HF_DEFAULTS = {  # transformers' DeepseekV3Config, for the keys the shared parser reads
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
MLA_DEFAULTS = {  # DeepseekV3Config's
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
GGUF_BLOCK = {
    **{k: v for k, v in GGUF_LLAMA_BLOCK.items() if not k.startswith("attn_")},
    "attn_norm": "input_layernorm",
    "attn_output": "self_attn.o_proj",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.embed_q",
    "attn_v_b": "self_attn.unembed_out",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


@dataclass(frozen=True)
class DeepseekV3Config(FamilyConfig):
    """MLA's sizes, the router's options, the next-token layers the checkpoint holds."""

    mla: LatentDims
    routing: GroupRouting
    mtp_layers: int = 0


def _attention(cfg: ModelConfig, rope: Rope | None) -> LatentAttention:
    return LatentAttention(cfg, rope, cfg.own(DeepseekV3Config).mla)


class DeepseekV3Layer(PreNormBlock):
    """The pre-norm block over MLA and a dense MLP (the first layers) or the experts."""

    attention = staticmethod(_attention)

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        routing = cfg.own(DeepseekV3Config).routing
        super().__init__(cfg, rope, GroupedMoE(cfg, routing) if cfg.is_sparse(layer) else MLP(cfg))


class DeepseekV3(Decoder):
    """The shared decoder with DeepSeek V3's blocks; one latent KVCache per layer."""

    layer: type[nn.Module] = DeepseekV3Layer

    def make_cache(self, kv=None) -> list[Cache]:
        return latent_caches(len(self._held), self.config.own(DeepseekV3Config).mla, kv)

    def sanitize(self, weights: dict) -> dict:
        n = self.config.num_hidden_layers
        return {k: v for k, v in super().sanitize(weights).items() if not _past(k, n)}

    def expert_stacks(self) -> dict[str, ExpertSource]:
        stacks: dict[str, ExpertSource] = {}
        for i, layer in enumerate(self.model.layers):
            if layer is not None and isinstance(layer.mlp, GroupedMoE):
                stacks.update(layer.mlp.expert_stacks(f"model.layers.{i}.mlp"))
        return stacks


def _softmax_scale(qk: int, rope: Any, mscale_all_dim: Any, path: str, fld: str) -> float:
    """transformers' yarn_apply_mscale: 1/√qk, times mscale(factor, mscale_all_dim)² when the
    RoPE is scaled and mscale_all_dim is nonzero."""
    if not isinstance(mscale_all_dim, (int, float)) or isinstance(mscale_all_dim, bool):
        raise ConfigError(f"expected a number, got {mscale_all_dim!r}"[:200], path=path, field=fld)
    scale = qk**-0.5
    if rope.type != "default" and mscale_all_dim:
        m = yarn_mscale(rope.factor, float(mscale_all_dim))
        scale = scale * m * m
    return scale


def _mla_dims(cfg: dict, path: str) -> tuple[int | None, int, int, int, int]:
    """(q_lora_rank or None, kv_lora_rank, nope, rope, v), each checked."""
    got = [
        check_sizes({bound: (key, cfg.get(key, MLA_DEFAULTS[key]))}, path)[bound]
        for key, bound in (
            ("kv_lora_rank", "hidden_size"),
            ("qk_nope_head_dim", "head_dim"),
            ("qk_rope_head_dim", "head_dim"),
            ("v_head_dim", "head_dim"),
        )
    ]
    q_lora = cfg.get("q_lora_rank", 1536)
    if q_lora is not None:
        q_lora = check_sizes({"hidden_size": ("q_lora_rank", q_lora)}, path)["hidden_size"]
    if got[2] % 2:
        raise ConfigError(f"an odd rope width {got[2]}", path=path, field="qk_rope_head_dim")
    return (q_lora, *got)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    n = base.num_hidden_layers
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if cfg.get(key, want) != want:
            raise UnsupportedError(
                f"only {want!r} routing is implemented, got {cfg[key]!r}"[:200],
                path=path,
                field=key,
            )
    if cfg.get("moe_layer_freq", 1) != 1:
        raise UnsupportedError(
            "expert layers other than every layer", path=path, field="moe_layer_freq"
        )
    q_lora, r, nope, rope_d, v = _mla_dims(cfg, path)
    rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    fld = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    m_all = rope_params.get("mscale_all_dim", 0)
    scale = _softmax_scale(nope + rope_d, base.rope, m_all, path, fld)
    dims = LatentDims(q_lora, r, nope, rope_d, v, scale, "quantization" in cfg, float(m_all))
    keys = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    sizes = {
        "num_experts": (keys[0], cfg.get(keys[0], 256)),
        "num_experts_per_tok": (keys[1], cfg.get(keys[1], 8)),
        "moe_intermediate_size": (keys[2], cfg.get(keys[2], 2048)),
    }
    size = expert_sizes(sizes, path, BOUNDS)
    shared = cfg.get("n_shared_experts", 1) or 0
    if shared:
        shared = check_sizes({"n_group": ("n_shared_experts", shared)}, path, BOUNDS)["n_group"]
    dense = cfg.get("first_k_dense_replace", 3)
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= n:
        raise ConfigError(
            f"expected 0 to {n}, got {dense!r}"[:200], path=path, field="first_k_dense_replace"
        )
    norm = flag({"norm_topk_prob": True, **cfg}, "norm_topk_prob", path)
    base = base.with_(
        moe=moe_config(size, tuple(i >= dense for i in range(n)), norm_topk_prob=norm)
    )
    routing = checked_routing(
        base.moe,
        cfg.get("n_group", 8),
        cfg.get("topk_group", 4),
        cfg.get("routed_scaling_factor", 2.5),
        shared * size["moe_intermediate_size"],
        path,
        ("n_group", "topk_group", "routed_scaling_factor"),
    )
    interleave = flag({"rope_interleave": True, **cfg}, "rope_interleave", path)
    mtp = cfg.get("num_nextn_predict_layers", 0) or 0
    own = DeepseekV3Config(dims, routing, mtp if isinstance(mtp, int) else 0)
    attention = replace(base.attention, rope_interleaved=interleave, rotary_dim=None)
    return check_act(
        base.with_(
            head_dim=rope_d,  # the rotary width: the Decoder's Rope turns the rope dims
            num_key_value_heads=1,  # one latent per position
            attention=attention,
            mlp=replace(base.mlp, bias=False),
            family_config=own,
        ),
        path,
    )


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    n = base.num_hidden_layers
    if m.get("expert_gating_func", SIGMOID) != SIGMOID:
        raise UnsupportedError(
            "only sigmoid routing", path=m.path, field=m.key("expert_gating_func")
        )
    rope_d = m.get("rope.dimension_count")
    r = m.get("attention.kv_lora_rank")
    qk = m.get("attention.key_length_mla")
    v = m.get("attention.value_length_mla")
    q_lora = m.get("attention.q_lora_rank", 0) or None
    log_mul = m.get("rope.scaling.yarn_log_multiplier", 0.0, float)
    scale = _softmax_scale(
        qk, base.rope, log_mul / 0.1, m.path, m.key("rope.scaling.yarn_log_multiplier")
    )
    split = "blk.0.attn_k_b.weight" in m.shapes
    dims = LatentDims(q_lora, r, qk - rope_d, rope_d, v, scale, split, log_mul / 0.1)
    size = gguf_expert_sizes(m)
    dense = m.get("leading_dense_block_count", 0)
    sparse = tuple(i >= dense for i in range(n))
    norm = bool(m.md.get(m.key("expert_weights_norm"), False))
    base = base.with_(moe=moe_config(size, sparse, norm_topk_prob=norm))
    routing = checked_routing(
        base.moe,
        m.get("expert_group_count", 1),
        m.get("expert_group_used_count", 1),
        m.get("expert_weights_scale", 1.0, float),
        m.get("expert_shared_count", 0) * size["moe_intermediate_size"],
        m.path,
        tuple(
            m.key(k)
            for k in ("expert_group_count", "expert_group_used_count", "expert_weights_scale")
        ),
    )
    attention = replace(
        base.attention, rope_interleaved=True, rotary_dim=None
    )  # llama.cpp's NORM rope
    rope = base.rope
    if rope.type == "yarn":  # llama.cpp's deepseek2 turns q and k's rope dims unscaled:
        # transformers' mscale(factor, mscale) / mscale(factor, mscale_all_dim), the two equal
        # in the released checkpoints (a GGUF states mscale_all_dim only)
        rope = replace(rope, attention_factor=1.0)
    return base.with_(
        rope=rope,
        head_dim=rope_d,
        num_key_value_heads=1,
        attention=attention,
        family_config=DeepseekV3Config(dims, routing, 0),
    )


def export(cfg: ModelConfig) -> dict[str, Any]:
    own = cfg.own(DeepseekV3Config)
    d, r, moe = own.mla, own.routing, cfg.moe
    if cfg.rope.type not in ("default", "yarn"):
        raise UnsupportedError(
            f"writing deepseek_v3 with {cfg.rope.type} RoPE is not supported",
            path=cfg.source,
            field="rope_parameters",
        )
    return {
        "q_lora_rank": d.q_lora_rank,
        "kv_lora_rank": d.kv_lora_rank,
        "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim,
        "v_head_dim": d.v_head_dim,
        "num_key_value_heads": cfg.num_attention_heads,
        "rope_interleave": cfg.attention.rope_interleaved,
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
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0,  # not written
        "rope_scaling": _yarn(cfg.rope, d.mscale_all_dim) if cfg.rope.type == "yarn" else None,
    }


def _yarn(rope: RopeConfig, m_all: float) -> dict[str, Any]:
    """yarn's keys with mscale_all_dim, and the mscale that gives its attention factor
    (mlx-lm reads those two, not attention_factor)."""
    m = (rope.attention_factor * yarn_mscale(rope.factor, m_all) - 1) / (
        0.1 * math.log(rope.factor)
    )
    return {**yarn_keys(rope), "mscale": m, "mscale_all_dim": m_all}


def _no_mtp(model: Any, spec: Family) -> Any:
    n = model.config.own(DeepseekV3Config).mtp_layers
    raise NoDraftHead(
        f"{model.name}: DeepSeek V3's next-token layers ({n} in the checkpoint) are skipped at "
        "load; drafting with them is not implemented"
    )


def _describe(c: ModelConfig) -> dict[str, Any]:
    own = c.own(DeepseekV3Config)
    d, r = own.mla, own.routing
    held, expanded = d.kv_bytes(c.num_attention_heads, 2)
    return {
        "latent_attention": {
            "q_lora_rank": d.q_lora_rank,
            "kv_lora_rank": d.kv_lora_rank,
            "rope_dims": d.qk_rope_head_dim,
            "nope_dims": d.qk_nope_head_dim,
            "v_dims": d.v_head_dim,
            "kv_bytes_per_token_layer": held,  # 16-bit
            "expanded_bytes_per_token_layer": expanded,
            "softmax_scale": d.scale,
            "groups": r.n_group,
            "groups_used": r.topk_group,
            "routed_scale": r.routed_scaling_factor,
            "shared_width": r.shared_intermediate_size,
            "mtp_layers": own.mtp_layers,
        }
    }


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    a = config["latent_attention"]
    q = f"q through rank {a['q_lora_rank']}" if a["q_lora_rank"] else "a full-rank q_proj"
    held, full = a["kv_bytes_per_token_layer"], a["expanded_bytes_per_token_layer"]
    rows = [
        (
            "latent kv",
            f"MLA: {q}; the cache holds a {a['kv_lora_rank']}-dim latent and a "
            f"{a['rope_dims']}-dim rope key per token: {held} bytes per token and layer at 16 "
            f"bits, against {full} for the expanded keys and values ({full / held:.1f}×)",
        ),
        (
            "routing",
            "sigmoid scores; a per-expert correction bias sways the choice, not the weights; "
            f"experts from the best {a['groups_used']} of {a['groups']} groups; the weights × "
            f"{a['routed_scale']:g}; shared experts of width {a['shared_width']}",
        ),
    ]
    if a["mtp_layers"]:
        rows.append(("mtp", f"{a['mtp_layers']} next-token layer(s) in the checkpoint, not loaded"))
    return rows


DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    hf=HFFormat(model_types=("deepseek_v3", "kimi_k2"), parse=parse_hf, defaults=HF_DEFAULTS),
    gguf=GGUFFormat(archs=("deepseek2",), parse=parse_gguf, block=GGUF_BLOCK),
    network=DeepseekV3,
    export=Export(model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", config=export),
    describe=Description(("latent_attention",), _describe, _rows),
    mtp=_no_mtp,
)
