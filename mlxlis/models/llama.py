"""Llama 2/3: the plain pre-norm decoder with SwiGLU and RMSNorm.

HF `llama`, GGUF `llama` (Mistral's older GGUFs too; HF `mistral` is mistral3.py's).
llama.cpp's converter permutes the attn_q / attn_k rows into its interleaved RoPE layout
(`LlamaModel.permute`); the loader undoes it.
"""

from __future__ import annotations

from typing import Any

from mlxlis.errors import UnsupportedError
from mlxlis.models.activations import GATED
from mlxlis.models.base import Family, GGUFMeta
from mlxlis.models.config import ModelConfig
from mlxlis.models.conventions import UNPERMUTE_K, UNPERMUTE_Q
from mlxlis.models.decoder import Decoder
from mlxlis.models.rope import llama3_from_factors

import mlx.core as mx
import numpy as np


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


def rope_freqs_as_config(cfg: ModelConfig, factors: mx.array) -> tuple[ModelConfig, Any]:
    """A GGUF's rope_freqs that are a published llama3 scaling's factors become that scaling
    (so `convert` can write it); any other factors stay a buffer."""
    dims = cfg.rotary_dim or cfg.head_dim
    rope = llama3_from_factors(cfg.rope.theta, dims, np.asarray(factors, np.float64).tolist())
    return (cfg, factors) if rope is None else (cfg.with_(rope=rope), None)


def _export(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention_bias}


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
)
