"""Llama 2/3: the plain pre-norm decoder with SwiGLU and RMSNorm.

HF `llama`, GGUF `llama` (Mistral's older GGUFs too; HF `mistral` is mistral3.py's).
llama.cpp's converter permutes the attn_q / attn_k rows into its interleaved RoPE layout
(`LlamaModel.permute`); the loader undoes it.
"""

from __future__ import annotations

from mlxlis.models.base import Family, GGUFMeta
from mlxlis.models.config import ModelConfig
from mlxlis.models.conventions import UNPERMUTE_K, UNPERMUTE_Q
from mlxlis.models.decoder import Decoder
from mlxlis.models.reading import check_act, rope_freqs_as_config


def _parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    return check_act(base, path)  # attention_bias (q/k/v and o) and mlp_bias read as they are


def _parse_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    return base


def _export(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention.bias}


LLAMA = Family(
    name="llama",
    hf_model_types=("llama",),
    gguf_archs=("llama",),
    parse_hf=_parse_hf,
    parse_gguf=_parse_gguf,
    network=Decoder,
    gguf_conventions=(UNPERMUTE_Q, UNPERMUTE_K),  # llama.cpp permutes Q/K for llama only
    gguf_rope_freqs=rope_freqs_as_config,
    export_model_type="llama",
    export_architecture="LlamaForCausalLM",
    export_config=_export,
    warmup={"model_type": "llama", "num_hidden_layers": 1},  # SiLU, full attention
)
