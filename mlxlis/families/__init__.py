"""Family registry: config parsing and model classes per family, as explicit dicts."""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn

from ..config import ModelConfig
from . import llama


def _llama_config(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    return base


def _qwen2_config(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    # Qwen2 always has a bias on q/k/v and none on o_proj, whatever config.json says
    return base.with_(attention_bias=True, o_bias=False, mlp_bias=False)


CONFIG_PARSERS: dict[str, Callable[[dict, ModelConfig, str], ModelConfig]] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
}

FAMILIES: dict[str, type[nn.Module]] = {
    "llama": llama.Model,
    "qwen2": llama.Model,
}


def parse_family_config(family: str, cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    from ..errors import UnsupportedError

    if family not in CONFIG_PARSERS:
        raise UnsupportedError(f"family {family!r} is not implemented yet", path=path,
                               field="model_type")
    return CONFIG_PARSERS[family](cfg, base, path)


def build_model(cfg: ModelConfig, **kwargs) -> nn.Module:
    return FAMILIES[cfg.family](cfg, **kwargs)
