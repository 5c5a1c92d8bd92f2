"""Gated MLP activations act(gate) · up by config name: the backend's (runtime/backend.py: on the
CPU a fused node or compiled kernel, else MLX's ops), or MLX's ops where it has none."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from mlxlis.runtime import fused

import mlx.core as mx
import mlx.nn as nn

Gated = Callable[[mx.array, mx.array], mx.array]

# name -> the backend's activation ("silu": g·σ(g); "gelu_tanh": 0.5·x·(1 + tanh(√(2/π)·(x +
# 0.044715·x³)))), or MLX's ops where the backend has none
GATED: dict[str, str | Gated] = {
    "silu": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": lambda g, u: nn.gelu(g) * u,  # exact, erf-based
}


def gated(name: str) -> Gated:
    act = GATED[name]
    return partial(fused.gated, act) if isinstance(act, str) else act


def clamped_swiglu(alpha: float, limit: float) -> Gated:
    """gpt-oss's experts: gate clamped above and up on both sides at `limit`, then
    gate·sigmoid(alpha·gate)·(up + 1) (transformers' GptOssExperts._apply_gate)."""

    def act(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return gate * mx.sigmoid(gate * alpha) * (up + 1)

    return act


def relu2(x: mx.array) -> mx.array:
    """relu(x)² (Nemotron-H's MLPs and experts, transformers' "relu2")."""
    return mx.square(nn.relu(x))
