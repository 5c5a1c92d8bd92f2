"""Readers of config.json and GGUF values that several families compose: the activation a
gated MLP supports, a GGUF's rope_freqs as the llama3 scaling they are, and the mixture-of-
experts sizes, flags and sparse layers as transformers' MoE configs state them."""

from __future__ import annotations

from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.activations import GATED
from mlxlis.models.base import GGUFMeta
from mlxlis.models.config import ModelConfig, MoEConfig
from mlxlis.models.rope import llama3_from_factors

import mlx.core as mx
import numpy as np


def check_act(cfg: ModelConfig, path: str) -> ModelConfig:
    if cfg.mlp.hidden_act not in GATED:
        raise UnsupportedError(
            f"activation {cfg.mlp.hidden_act!r} is not implemented", path=path, field="hidden_act"
        )
    return cfg


def rope_freqs_as_config(cfg: ModelConfig, factors: mx.array) -> tuple[ModelConfig, Any]:
    """A GGUF's rope_freqs that are a published llama3 scaling's factors become that scaling
    (so `convert` can write it); any other factors stay a buffer."""
    dims = cfg.attention.rotary_dim or cfg.head_dim
    rope = llama3_from_factors(cfg.rope.theta, dims, np.asarray(factors, np.float64).tolist())
    return (cfg, factors) if rope is None else (cfg.with_(rope=rope), None)


def expert_sizes(
    sizes: dict[str, tuple[str, Any]], path: str, bounds: dict[str, int] | None = None
) -> dict[str, int]:
    size = check_sizes(sizes, path, bounds)
    if size["num_experts_per_tok"] > size["num_experts"]:
        key = sizes["num_experts_per_tok"][0]
        raise ConfigError(
            f"{size['num_experts_per_tok']} experts per token of {size['num_experts']}",
            path=path,
            field=key,
        )
    return size


def moe_config(size: dict[str, int], sparse: tuple[bool, ...], **more: Any) -> MoEConfig:
    """The experts of checked sizes (num_experts, num_experts_per_tok, moe_intermediate_size)
    in the `sparse` layers."""
    n, k, f = size["num_experts"], size["num_experts_per_tok"], size["moe_intermediate_size"]
    return MoEConfig(n, k, f, sparse, **more)


def gguf_expert_sizes(meta: GGUFMeta) -> dict[str, int]:
    """expert_count, expert_used_count and expert_feed_forward_length, checked (each error
    naming its key): num_experts, num_experts_per_tok, moe_intermediate_size."""
    keys = {
        "num_experts": "expert_count",
        "num_experts_per_tok": "expert_used_count",
        "moe_intermediate_size": "expert_feed_forward_length",
    }
    return expert_sizes({f: (meta.key(k), meta.get(k)) for f, k in keys.items()}, meta.path)


def flag(cfg: dict, key: str, path: str) -> bool:
    value = cfg.get(key, False)
    if not isinstance(value, bool):  # a string "false" must not read as true
        raise ConfigError(f"expected true or false, got {value!r}"[:200], path=path, field=key)
    return value


def sparse_layers(cfg: dict, n: int, step: int, path: str) -> tuple[bool, ...]:
    """transformers: the expert block on every step-th layer not listed in mlp_only_layers (a
    dense MLP there); Qwen3-Next reads the same."""
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in dense
    ):
        raise ConfigError(
            f"expected layer indices below {n}, got {dense!r}"[:200],
            path=path,
            field="mlp_only_layers",
        )
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def positive(cfg: dict, key: str, path: str, default: float = 1.0) -> float:
    """A positive number (a scale) from config.json, `default` when absent or null."""
    value = default if cfg.get(key) is None else cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"expected a positive number, got {value!r}"[:200], path=path, field=key)
    return float(value)
