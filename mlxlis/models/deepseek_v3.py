"""DeepSeek V3 / V3.1 / R1, Kimi K2: pre-norm blocks over multi-head latent attention (mla.py:
a latent cache, the up-projections absorbed, q full-rank or through q_lora_rank, RoPE on the
rope dims (interleaved pairs where rope_interleave), yarn's mscale(factor, mscale_all_dim)² on
the softmax scale); the first first_k_dense_replace layers a dense SwiGLU, the rest GLM-4.5's
grouped sigmoid mixture with shared experts (grouped_experts.py).

HF `deepseek_v3` (the next-n layer skipped, read when drafting with it: nextn.py);
mlx-lm's folders hold kv_b_proj split as embed_q / unembed_out, read so. GGUF: llama.cpp's
`deepseek2` (one KV head of key_length kv_lora_rank + rope, kv_b_proj split into k_b
(n_heads, kv_lora_rank, nope) and v_b (n_heads, v, kv_lora_rank), experts stacked, the
correction bias as exp_probs_b, yarn_log_multiplier = 0.1·mscale_all_dim).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from mlxlis.cache import KVFormat
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.base import (
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.models.glm4_moe import GGUF_BLOCK as GLM4_BLOCK
from mlxlis.models.glm4_moe import SIGMOID, Glm4Moe
from mlxlis.models.grouped_experts import GroupedMoE, GroupRouting, read_gguf, read_hf
from mlxlis.models.layers import MLP, Cache, PreNormBlock
from mlxlis.models.mla import (
    LatentAttention,
    LatentDims,
    latent_caches,
    softmax_scale,
    stored_split,
    yarn_keys_of,
)
from mlxlis.models.nextn import nextn_drafter
from mlxlis.models.reading import check_act, flag
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
GGUF_BLOCK = {  # GLM-4.5's MLP and expert rows, MLA's attention rows
    **{k: v for k, v in GLM4_BLOCK.items() if not k.startswith("attn_")},
    "attn_norm": "input_layernorm",
    **{
        f"attn_{k}": f"self_attn.{v}"
        for k, v in (
            ("output", "o_proj"),
            ("q", "q_proj"),
            ("q_a", "q_a_proj"),
            ("q_a_norm", "q_a_layernorm"),
            ("q_b", "q_b_proj"),
            ("kv_a_mqa", "kv_a_proj_with_mqa"),
            ("kv_a_norm", "kv_a_layernorm"),
            ("kv_b", "kv_b_proj"),
            ("k_b", "embed_q"),  # (n_heads, kv_lora_rank, nope): W_ukᵀ per head
            ("v_b", "unembed_out"),  # (n_heads, v, kv_lora_rank)
        )
    },
}


ROUTER_DEFAULTS = {  # DeepseekV3Config's
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
}


@dataclass(frozen=True)
class DeepseekV3Config(FamilyConfig):
    """MLA's sizes, the router's options, the next-n layers the checkpoint holds."""

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


class DeepseekV3(Glm4Moe):
    """GLM-4.5's decoder (next-n layers skipped, experts stacked) with DeepSeek V3's
    blocks; one latent KVCache per layer."""

    layer: type[nn.Module] = DeepseekV3Layer

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        return latent_caches(len(self._held), self.config.own(DeepseekV3Config).mla, kv)


def _mla_dims(cfg: dict, path: str) -> tuple[int | None, int, int, int, int]:
    """(q_lora_rank or None, kv_lora_rank, nope, rope, v), each checked."""
    got = [
        check_sizes({bound: (key, cfg.get(key, default))}, path)[bound]
        for key, bound, default in (  # DeepseekV3Config's defaults
            ("kv_lora_rank", "hidden_size", 512),
            ("qk_nope_head_dim", "head_dim", 128),
            ("qk_rope_head_dim", "head_dim", 64),
            ("v_head_dim", "head_dim", 128),
        )
    ]
    q_lora = cfg.get("q_lora_rank", 1536)
    if q_lora is not None:
        q_lora = check_sizes({"hidden_size": ("q_lora_rank", q_lora)}, path)["hidden_size"]
    if got[2] % 2:
        raise ConfigError(f"an odd rope width {got[2]}", path=path, field="qk_rope_head_dim")
    return (q_lora, *got)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    for key, want in (
        ("topk_method", "noaux_tc"),
        ("scoring_func", "sigmoid"),
        ("moe_layer_freq", 1),
    ):
        if cfg.get(key, want) != want:
            got = f"only {key} {want!r} is implemented, got {cfg[key]!r}"[:200]
            raise UnsupportedError(got, path=path, field=key)
    q_lora, r, nope, rope_d, v = _mla_dims(cfg, path)
    rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    fld = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    m_all = rope_params.get("mscale_all_dim", 0)
    scale = softmax_scale(nope + rope_d, base.rope, m_all, path, fld)
    dims = LatentDims(q_lora, r, nope, rope_d, v, scale, stored_split(path), float(m_all))
    base, routing = read_hf(cfg, base, path, ROUTER_DEFAULTS)
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
    scale = softmax_scale(
        qk, base.rope, log_mul / 0.1, m.path, m.key("rope.scaling.yarn_log_multiplier")
    )
    split = "blk.0.attn_k_b.weight" in m.shapes
    dims = LatentDims(q_lora, r, qk - rope_d, rope_d, v, scale, split, log_mul / 0.1)
    base, routing = read_gguf(base, m, 0)
    # llama.cpp's deepseek2 turns interleaved pairs (its NORM rope)
    attention = replace(base.attention, rope_interleaved=True, rotary_dim=None)
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
    yarn = cfg.rope.type == "yarn"
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
        "first_k_dense_replace": (moe.sparse_layers + (True,)).index(True),
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0,  # not written
        "rope_scaling": yarn_keys_of(cfg.rope, d.mscale_all_dim) if yarn else None,
    }


def _mtp_caches(one: ModelConfig) -> list[Cache]:
    """The next-n layer's (nextn.py): a latent cache."""
    return latent_caches(1, one.own(DeepseekV3Config).mla, None)


def _describe(c: ModelConfig) -> dict[str, Any]:
    own = c.own(DeepseekV3Config)
    d, r = own.mla, own.routing
    held, expanded = d.kv_bytes(c.num_attention_heads, 2)  # at 16 bits
    return {
        "latent_attention": {
            **asdict(d),
            **asdict(r),
            "kv_bytes_per_token_layer": held,
            "expanded_bytes_per_token_layer": expanded,
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
            f"{a['qk_rope_head_dim']}-dim rope key per token: {held} bytes per token and "
            f"layer at 16 bits, against {full} for the expanded keys and values "
            f"({full / held:.1f}×)",
        ),
        (
            "routing",
            "sigmoid scores; a per-expert correction bias sways the choice, not the weights; "
            f"experts from the best {a['topk_group']} of {a['n_group']} groups; weights × "
            f"{a['routed_scaling_factor']:g}; shared width {a['shared_intermediate_size']}",
        ),
    ]
    if n := a["mtp_layers"]:  # the config's count: a conversion may have dropped them
        rows.append(
            ("mtp", f"{n} next-n layer(s): drafts for --speculative mtp if the file has it")
        )
    return rows


DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    hf=HFFormat(model_types=("deepseek_v3", "kimi_k2"), parse=parse_hf, defaults=HF_DEFAULTS),
    gguf=GGUFFormat(archs=("deepseek2",), parse=parse_gguf, block=GGUF_BLOCK),
    network=DeepseekV3,
    export=Export(model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", config=export),
    describe=Description(("latent_attention",), _describe, _rows),
    mtp=nextn_drafter(DeepseekV3Layer, _mtp_caches, "llama.cpp's deepseek2 drops the layer"),
)
