"""Qwen3-MoE: Qwen3's attention with mixture-of-experts MLPs (a router choosing the top k of
num_experts SwiGLU experts per token, see experts.py) in the sparse layers.

HF `qwen3_moe` (experts one tensor each: `mlp.experts.{e}.gate_proj.weight`, stacked at load;
mlx-lm's stacked `mlp.switch_mlp.*` loads as it is), GGUF `qwen3moe` (stacked 3-D
`ffn_{gate,up,down}_exps`, router `ffn_gate_inp`).
"""

from __future__ import annotations

from mlxlis.models.base import Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.qwen3 import GGUF_BLOCK as QWEN3_BLOCK
from mlxlis.models.qwen3 import parse_gguf as qwen3_gguf
from mlxlis.models.qwen3 import parse_hf as qwen3_hf
from mlxlis.models.reading import (
    expert_sizes,
    flag,
    gguf_expert_sizes,
    moe_config,
    sparse_layers,
)

# transformers' Qwen3MoeConfig defaults for keys a config.json may omit
HF_DEFAULTS = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
}


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    base = qwen3_hf(cfg, base, path)
    if "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg = {**cfg, "num_experts": cfg["num_local_experts"]}  # transformers 5 saves this name
    size = expert_sizes({k: (k, cfg.get(k, v)) for k, v in HF_DEFAULTS.items()}, path)
    sparse = sparse_layers(cfg, base.num_hidden_layers, size["decoder_sparse_step"], path)
    top = flag(cfg, "norm_topk_prob", path)
    return base.with_(moe=moe_config(size, sparse, norm_topk_prob=top))


def parse_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    base = qwen3_gguf(base, meta)
    size = gguf_expert_sizes(meta)
    # a layer is sparse when the file has its router (llama.cpp's qwen3moe: every layer)
    n = base.num_hidden_layers
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in meta.shapes for i in range(n))
    # llama.cpp's qwen3moe graph always renormalises the top k
    return base.with_(moe=moe_config(size, sparse, norm_topk_prob=True))


def export(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    return {
        "attention_bias": cfg.attention.bias,
        "use_sliding_window": False,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, s in enumerate(moe.sparse_layers) if not s],
    }


QWEN3_MOE = Family(
    name="qwen3_moe",
    hf=HFFormat(
        model_types=("qwen3_moe",),
        parse=parse_hf,
    ),
    gguf=GGUFFormat(
        archs=("qwen3moe",),
        parse=parse_gguf,
        block={
            **QWEN3_BLOCK,
            "ffn_gate_inp": "mlp.gate",  # the router
            "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
            "ffn_up_exps": "mlp.switch_mlp.up_proj",
            "ffn_down_exps": "mlp.switch_mlp.down_proj",
        },
    ),
    network=Decoder,
    export=Export(
        model_type="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        config=export,
    ),
)
