"""Quantized layers whose products go through mlxlis's CPU kernels (runtime/qmv) where they
apply, and MLX's own `mx.quantized_matmul` everywhere else: the same parameters, names and
results (within float32 rounding) as MLX's QuantizedLinear / QuantizedEmbedding.

`use_kernels(net)` turns a loaded network's MLX quantized layers into these (a class change
only: no parameter is copied). MLX's `nn.quantize` builds its own classes, so a loader calls
this after quantizing."""

from __future__ import annotations

from mlxlis.runtime import qmv
from mlxlis.runtime.device import device_name

import mlx.core as mx
import mlx.nn as nn


def _product(m: nn.Module, x: mx.array) -> mx.array:
    """x @ wᵀ for the quantized weight of `m` (a QuantizedLinear or QuantizedEmbedding)."""
    w, scales, biases = m["weight"], m["scales"], m.get("biases")
    return qmv.matmul(x, w, scales, biases, m.group_size, m.bits, m.mode)


class QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = _product(self, x)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        """The tied head: x @ embeddingᵀ."""
        return _product(self, x)


_OURS = {nn.QuantizedLinear: QuantizedLinear, nn.QuantizedEmbedding: QuantizedEmbedding}


def use_kernels(net: nn.Module) -> int:
    """Turn `net`'s MLX quantized layers into the kernel-aware ones; returns how many."""
    n = 0
    for _, m in net.named_modules():
        ours = _OURS.get(type(m))
        if ours is not None:
            m.__class__ = ours  # same attributes and parameters: only the products change
            n += 1
    if n and device_name() == "cpu":
        qmv.load()  # built (once) now, while loading, not inside the first product
    return n
