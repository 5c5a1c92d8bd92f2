"""Llama 2/3 (and Mistral): the plain pre-norm decoder with SwiGLU and RMSNorm.

HF `llama` / `mistral`, GGUF `llama`. llama.cpp's converter permutes the attn_q / attn_k rows
into its interleaved RoPE layout (`LlamaModel.permute`); the loader undoes it.
"""

from __future__ import annotations

from mlxlis.errors import UnsupportedError
from mlxlis.models.activations import GATED
from mlxlis.models.base import Family, GGUFMeta
from mlxlis.models.config import ModelConfig
from mlxlis.models.conventions import UNPERMUTE_K, UNPERMUTE_Q
from mlxlis.models.decoder import Decoder


def check_act(cfg: ModelConfig, path: str) -> ModelConfig:
    if cfg.hidden_act not in GATED:
        raise UnsupportedError(
            f"activation {cfg.hidden_act!r} is not implemented", path=path, field="hidden_act"
        )
    return cfg


def _parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    return check_act(base, path)  # attention_bias (q/k/v and o) and mlp_bias read as they are


def _parse_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    return base


def _export(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention_bias}


LLAMA = Family(
    name="llama",
    hf_model_types=("llama", "mistral"),
    gguf_archs=("llama",),
    parse_hf=_parse_hf,
    parse_gguf=_parse_gguf,
    network=Decoder,
    gguf_conventions=(UNPERMUTE_Q, UNPERMUTE_K),  # llama.cpp permutes Q/K for llama only
    export_model_type="llama",
    export_architecture="LlamaForCausalLM",
    export_config=_export,
)
