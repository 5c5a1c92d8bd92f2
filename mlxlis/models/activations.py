"""Gated MLP activations act(gate) · up by config name: runtime/fused's CPU node where it applies,
else mlxlis.runtime.fastmath's fused CPU kernels or MLX's ops (chosen per call)."""

from __future__ import annotations

from collections.abc import Callable

from mlxlis.runtime import fastmath, fused

import mlx.core as mx
import mlx.nn as nn

Gated = Callable[[mx.array, mx.array], mx.array]

# name -> (runtime/fused's kernel name, fastmath kernel, MLX ops); None: MLX's only
GATED: dict[str, tuple[str | None, Gated | None, Gated]] = {
    "silu": ("silu", fastmath.swiglu, lambda g, u: nn.silu(g) * u),
    # 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    "gelu_pytorch_tanh": ("gelu_tanh", fastmath.geglu_tanh, lambda g, u: nn.gelu_approx(g) * u),
    "gelu_new": ("gelu_tanh", fastmath.geglu_tanh, lambda g, u: nn.gelu_approx(g) * u),
    "gelu": (None, None, lambda g, u: nn.gelu(g) * u),  # exact, erf-based
}


def gated(name: str) -> Gated:
    kernel, fast, plain = GATED[name]
    if fast is None:
        return plain

    def act(gate: mx.array, up: mx.array) -> mx.array:
        if (out := fused.gated(kernel, gate, up)) is not None:
            return out
        return fast(gate, up) if fastmath.enabled() else plain(gate, up)

    return act


def clamped_swiglu(alpha: float, limit: float) -> Gated:
    """gpt-oss's experts: gate clamped above and up on both sides at `limit`, then
    gate·sigmoid(alpha·gate)·(up + 1) (transformers' GptOssExperts._apply_gate)."""

    def act(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return gate * mx.sigmoid(gate * alpha) * (up + 1)

    return act
