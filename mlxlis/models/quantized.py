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
    return qmv.matmul(x, w, scales, biases, m.group_size, m.bits, m.mode, m.get("super_scales"))


class QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = _product(self, x)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    _lookup_dtype: mx.Dtype | None = None  # the network's compute dtype (use_kernels)

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


_OURS = {nn.QuantizedLinear: QuantizedLinear, nn.QuantizedEmbedding: QuantizedEmbedding}


def use_kernels(net: nn.Module, dtype: mx.Dtype | None = None) -> int:
    """Turn `net`'s MLX quantized layers into the kernel-aware ones (embeddings looking rows
    up in `dtype`, the network's compute dtype); returns how many."""
    n = 0
    for _, m in net.named_modules():
        ours = _OURS.get(type(m))
        if ours is not None:
            m.__class__ = ours  # same attributes and parameters: only the products change
            n += 1
        if isinstance(m, QuantizedEmbedding):
            object.__setattr__(m, "_lookup_dtype", dtype)  # not a parameter
    if n and device_name() == "cpu":
        qmv.load()  # built (once) now, while loading, not inside the first product
    return n
