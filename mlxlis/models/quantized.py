"""Quantized layers whose products go through mlxlis's CPU kernels (runtime/qmv) where they
apply, and MLX's own `mx.quantized_matmul` everywhere else: the same parameters, names and
results (within float32 rounding) as MLX's QuantizedLinear / QuantizedEmbedding.

`use_kernels(net)` turns a loaded network's MLX quantized layers into these (a class change
only: no parameter is copied). MLX's `nn.quantize` builds its own classes, so a loader calls
this after quantizing."""

from __future__ import annotations

from mlxlis.runtime import qmv

import mlx.core as mx
import mlx.nn as nn


class QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = qmv.matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            self.group_size,
            self.bits,
            self.mode,
        )
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        """The tied head: x @ embeddingᵀ."""
        return qmv.matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            self.group_size,
            self.bits,
            self.mode,
        )


_OURS = {nn.QuantizedLinear: QuantizedLinear, nn.QuantizedEmbedding: QuantizedEmbedding}


def use_kernels(net: nn.Module) -> int:
    """Turn `net`'s MLX quantized layers into the kernel-aware ones; returns how many."""
    n = 0
    for _, m in net.named_modules():
        ours = _OURS.get(type(m))
        if ours is not None:
            m.__class__ = ours  # same attributes and parameters: only the products change
            n += 1
    return n
