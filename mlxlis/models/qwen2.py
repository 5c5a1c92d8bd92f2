"""Qwen2 (and Qwen2.5): the Llama decoder with a bias on q/k/v and none on o_proj.

HF `qwen2`, GGUF `qwen2`; llama.cpp leaves Qwen2's Q/K rows as they are (no permutation).
"""

from __future__ import annotations

from dataclasses import replace

from mlxlis.models.base import Export, Family, GGUFFormat, GGUFMeta, HFFormat
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
    hf=HFFormat(
        model_types=("qwen2",),
        parse=_parse_hf,
    ),
    gguf=GGUFFormat(
        archs=("qwen2",),
        parse=_parse_gguf,
    ),
    network=Decoder,
    export=Export(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
    ),
)
