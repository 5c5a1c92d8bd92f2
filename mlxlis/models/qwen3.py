"""Qwen3 (dense): the Llama decoder with RMSNorm over head_dim on each head's q and k (before
RoPE), an explicit head_dim (≠ hidden / heads), no bias unless attention_bias.

HF `qwen3`, GGUF `qwen3`; llama.cpp leaves the Q/K rows as they are (no permutation) and names
the two norms attn_q_norm / attn_k_norm.
"""

from __future__ import annotations

from dataclasses import replace

from mlxlis.errors import UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.base import GGUF_LLAMA_BLOCK, Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.reading import check_act

HEAD_DIM_DEFAULT = 128  # transformers' Qwen3Config default when config.json omits head_dim
GGUF_BLOCK = {
    **GGUF_LLAMA_BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    if cfg.get("use_sliding_window"):
        raise UnsupportedError(
            "Qwen3 sliding-window attention is not implemented",
            path=path,
            field="use_sliding_window",
        )
    head_dim = base.head_dim
    if cfg.get("head_dim") is None:
        head_dim = check_sizes({"head_dim": ("head_dim", HEAD_DIM_DEFAULT)}, path)["head_dim"]
    # attention_bias covers q/k/v and o_proj in Qwen3, as in Llama; the MLP has none
    mlp = replace(base.mlp, bias=False)
    attention = replace(base.attention, qk_norm=True)
    return check_act(base.with_(attention=attention, head_dim=head_dim, mlp=mlp), path)


def parse_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    return base.with_(attention=replace(base.attention, qk_norm=True))


def export(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention.bias, "use_sliding_window": False}


QWEN3 = Family(
    name="qwen3",
    hf=HFFormat(
        model_types=("qwen3",),
        parse=parse_hf,
    ),
    gguf=GGUFFormat(
        archs=("qwen3",),
        parse=parse_gguf,
        block=GGUF_BLOCK,
    ),
    network=Decoder,
    export=Export(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        config=export,
    ),
)
