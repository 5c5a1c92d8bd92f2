"""Qwen2 (and Qwen2.5): the Llama decoder with a bias on q/k/v and none on o_proj.

HF `qwen2`, GGUF `qwen2`; llama.cpp leaves Qwen2's Q/K rows as they are (no permutation).
"""

from __future__ import annotations

from dataclasses import replace

from mlxlis.models.base import Family, GGUFMeta
from mlxlis.models.config import ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.reading import check_act


def _parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    # Qwen2 always has a bias on q/k/v and none on o_proj, whatever config.json says
    mlp = replace(base.mlp, bias=False)
    attention = replace(base.attention, bias=True, o_bias=False)
    return check_act(base.with_(attention=attention, mlp=mlp), path)


def _parse_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    return base


QWEN2 = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_archs=("qwen2",),
    parse_hf=_parse_hf,
    parse_gguf=_parse_gguf,
    network=Decoder,
    export_model_type="qwen2",
    export_architecture="Qwen2ForCausalLM",
)
