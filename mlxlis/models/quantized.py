"""Quantized layers whose products go through mlxlis's CPU kernels (runtime/kernels) where they
apply, and MLX's own `mx.quantized_matmul` everywhere else: the same parameters, names and
results (within float32 rounding) as MLX's QuantizedLinear / QuantizedEmbedding.

A loader builds its network with these (`Kernels`, the quantized layers binding.quantize_like
makes): ours in place of MLX's QuantizedLinear / QuantizedEmbedding, MLX's own for the rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxlis.runtime import kernels
from mlxlis.runtime.device import on_cpu

import mlx.core as mx
import mlx.nn as nn


def _product(m: nn.Module, x: mx.array) -> mx.array:
    """x @ wᵀ for the quantized weight of `m` (a QuantizedLinear or QuantizedEmbedding)."""
    w, scales, biases = m["weight"], m["scales"], m.get("biases")
    return kernels.matmul(x, w, scales, biases, m.group_size, m.bits, m.mode, m.get("super_scales"))


def products(x: mx.array, layers: Sequence[nn.Module]) -> list[mx.array]:
    """Each layer of `layers` on x (a layer's q, k and v projections; its gate and up): where
    every one is one of these QuantizedLinear layers whose product the CPU kernels take, one
    graph node for all (a decode step: one job for the kernels' threads, not one a product,
    and the small k and v spread over them too; the same results), else each layer's own."""
    mod = kernels.load() if on_cpu() and 1 < len(layers) <= kernels.MAX_PRODUCTS else None
    if mod is None or not all(
        type(m) is QuantizedLinear and kernels.applies(m.bits, m.group_size, m.mode) for m in layers
    ):
        return [m(x) for m in layers]
    ys = mod.qmv_many(
        x,
        [m["weight"] for m in layers],
        [m["scales"] for m in layers],
        [m.get("biases") for m in layers],
        [m.group_size for m in layers],
        [m.bits for m in layers],
        [m.get("super_scales") for m in layers],
    )
    return [
        y.astype(x.dtype) + m["bias"] if "bias" in m else y.astype(x.dtype)
        for y, m in zip(ys, layers, strict=True)
    ]


class QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = _product(self, x)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    _lookup_dtype: mx.Dtype | None = None  # the network's compute dtype (Kernels)

    def __call__(self, x: mx.array) -> mx.array:
        """Rows of the table. float16 scales kept beside float32 compute (binding.kept_narrow)
        are widened for the looked-up rows only: MLX's dequantize computes in the scales'
        dtype, which would round d·q + bias to float16."""
        s, b = self["scales"][x], self.get("biases")
        b = None if b is None else b[x]
        if s.dtype == mx.float16 and self._lookup_dtype == mx.float32:
            s, b = s.astype(mx.float32), None if b is None else b.astype(mx.float32)
        return mx.dequantize(
            self["weight"][x], s, b, group_size=self.group_size, bits=self.bits, mode=self.mode
        )

    def as_linear(self, x: mx.array) -> mx.array:
        """The tied head: x @ embeddingᵀ."""
        return _product(self, x)


class Kernels:
    """The quantized layers of a network computing in `dtype` (binding.Quantizer): ours where
    MLX's `to_quantized` would make a QuantizedLinear or QuantizedEmbedding (an embedding
    looking its rows up in `dtype`), MLX's own for the rest (experts)."""

    def __init__(self, dtype: mx.Dtype | None = None):
        self.dtype = dtype

    def quantize(self, module: nn.Module, params: dict[str, Any]) -> nn.Module:
        if params.get("quantize_input"):  # activations quantized too: MLX's QQLinear
            return module.to_quantized(**params)
        if type(module) is nn.Linear:
            return self._made(QuantizedLinear.from_linear(module, **params))
        if type(module) is nn.Embedding:
            layer = QuantizedEmbedding.from_embedding(module, **params)
            object.__setattr__(layer, "_lookup_dtype", self.dtype)  # not a parameter
            return self._made(layer)
        return module.to_quantized(**params)

    def empty_linear(self) -> nn.QuantizedLinear:
        return self._made(QuantizedLinear.__new__(QuantizedLinear))

    def _made(self, layer: nn.Module) -> nn.Module:
        if on_cpu():
            kernels.load()  # built (once) now, while loading, not inside the first product
        return layer
