"""Llama 2/3: the plain pre-norm decoder with SwiGLU and RMSNorm.

HF `llama`, GGUF `llama` (Mistral's older GGUFs too; HF `mistral` is mistral3.py's).
llama.cpp's converter permutes the attn_q / attn_k rows into its interleaved RoPE layout
(`LlamaModel.permute`); the loader undoes it.
"""

from __future__ import annotations

from mlxlis.models.base import Export, Family, GGUFFormat, GGUFMeta, HFFormat
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
    hf=HFFormat(
        model_types=("llama",),
        parse=_parse_hf,
    ),
    gguf=GGUFFormat(
        archs=("llama",),
        parse=_parse_gguf,
        conventions=(UNPERMUTE_Q, UNPERMUTE_K),  # llama.cpp permutes Q/K for llama only
        rope_freqs=rope_freqs_as_config,
    ),
    network=Decoder,
    export=Export(
        model_type="llama",
        architecture="LlamaForCausalLM",
        config=_export,
    ),
    warmup={"model_type": "llama", "num_hidden_layers": 1},  # SiLU, full attention
)
