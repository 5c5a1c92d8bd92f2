"""How a KV cache stores its keys and values: dense arrays, or MLX affine-quantized ones.

A KV cache (kv.py), its batches (batch.py) and the attention that reads them see one kind of
thing, shaped (B, n_kv_heads, positions, head_dim) with positions on axis 2: an `mx.array`, or
a `QArray` holding (packed, scales, biases) as `mx.quantize` makes them, each part with the
same leading axes. The caches do their bookkeeping through a `Store` (allocate, append, copy,
write one slot per row); a chunk written into a quantized store is quantized on the way in,
so a cache never holds a full-precision copy of what it has quantized. Attention computes on
the parts directly (`mx.quantized_matmul`, models/attention.py).

Quantization is per position (groups of `group_size` along head_dim), so quantizing a chunk
and quantizing its positions one by one give the same bits: rewinds, rings and batches move
quantized positions around without ever requantizing them.

A full-attention cache in a format with `tail` (the default) also keeps its newest block (the
positions since the last multiple of KVCache.step) in full precision until the block fills,
and attends over them in that form: a `Tailed` pair of the quantized positions before it and
the dense ones. Measured on the catalog models at 2 248 tokens (200 in the tail), it cut the
KL divergence from dense KV's next-token distribution 3-50x at 8 bits and 2.5-8x at 4 bits
(README, "Long contexts"), for ≤ 255 dense positions a layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from mlxlis.errors import MlxlisError

import mlx.core as mx

T = TypeVar("T")
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVFormat:
    """Quantized KV: `bits` per element, one scale and bias per `group_size` elements."""

    bits: int = 8
    group_size: int = 64
    tail: bool = True  # the newest block of full-attention positions kept in full precision

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise MlxlisError(f"KV bits must be one of {BITS}, got {self.bits}", field="kv_bits")
        if self.group_size not in GROUP_SIZES:
            raise MlxlisError(
                f"KV group size must be one of {GROUP_SIZES}, got {self.group_size}",
                field="kv_group_size",
            )

    def check(self, head_dim: int, where: str = "") -> None:
        """Refuse a head dimension the groups do not divide."""
        if head_dim % self.group_size:
            raise MlxlisError(
                f"head_dim {head_dim}{where} is not a multiple of the KV group size "
                f"{self.group_size}",
                field="kv_group_size",
            )

    def bytes_per_element(self, dtype: mx.Dtype) -> float:
        """Stored bytes per key or value element: the bits, plus a scale and a bias per group."""
        return self.bits / 8 + 2 * dtype.size / self.group_size

    def __str__(self) -> str:
        plain = "" if self.tail else ", no full-precision tail"
        return f"{self.bits}-bit (groups of {self.group_size}{plain})"


class QArray:
    """Keys or values stored quantized: `parts` (packed uint32, scales, biases), each shaped
    (B, n_kv_heads, positions, ·); `dtype` is that of the full-precision values (and of the
    scales). Indexing applies to every part alike and must leave the last axis whole."""

    __slots__ = ("dim", "fmt", "parts")

    def __init__(self, parts: tuple[mx.array, mx.array, mx.array], fmt: KVFormat, dim: int):
        self.parts, self.fmt, self.dim = parts, fmt, dim

    @classmethod
    def of(cls, x: mx.array, fmt: KVFormat) -> QArray:
        """`x` (…, head_dim) quantized."""
        parts = mx.quantize(x, group_size=fmt.group_size, bits=fmt.bits)
        return cls(tuple(parts), fmt, x.shape[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.parts[0].shape[:-1], self.dim)

    @property
    def ndim(self) -> int:
        return self.parts[0].ndim

    @property
    def dtype(self) -> mx.Dtype:
        return self.parts[1].dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __getitem__(self, index) -> QArray:
        return QArray(tuple(p[index] for p in self.parts), self.fmt, self.dim)

    def __setitem__(self, index, value: QArray | mx.array) -> None:
        value = value if isinstance(value, QArray) else QArray.of(value, self.fmt)
        for p, v in zip(self.parts, value.parts, strict=True):
            p[index] = v

    def dequantize(self) -> mx.array:
        f = self.fmt
        return mx.dequantize(*self.parts, group_size=f.group_size, bits=f.bits)


class Tailed:
    """One sequence's keys or values in position order: `head` quantized (QArray), then the
    newest `tail` in full precision, each (B, n_kv_heads, ·, head_dim). Indexing takes the
    first positions only (`x[:, :, :end]`, what attention's query blocks do)."""

    __slots__ = ("head", "tail")

    def __init__(self, head: QArray, tail: mx.array):
        self.head, self.tail = head, tail

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, dim = self.head.shape
        return (*lead, n + self.tail.shape[2], dim)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def dtype(self) -> mx.Dtype:
        return self.tail.dtype

    def __getitem__(self, index) -> Tailed | QArray:
        a, b, c = index
        if a != slice(None) or b != slice(None) or c.start is not None or c.step is not None:
            raise IndexError("a Tailed array takes only [:, :, :end]")
        n = self.head.shape[2]
        end = self.shape[2] if c.stop is None else c.stop
        if end <= n:
            return self.head[:, :, :end]
        return Tailed(self.head, self.tail[:, :, : end - n])

    def dequantize(self) -> mx.array:
        return mx.concatenate([self.head.dequantize(), self.tail], axis=2)


Stored = mx.array | QArray


class Store:
    """Dense storage: the arrays as they come."""

    fmt: KVFormat | None = None

    def zeros(self, shape: tuple[int, ...], dtype: mx.Dtype) -> Stored:
        return mx.zeros(shape, dtype)

    def take(self, x: Stored) -> Stored:
        """A new chunk (B, n_kv_heads, T, head_dim) as this store holds it."""
        return x

    def concat(self, xs: list[Stored], axis: int = 2) -> Stored:
        return mx.concatenate(xs, axis=axis)

    def contiguous(self, x: Stored) -> Stored:
        return mx.contiguous(x)

    def copy(self, x: Stored) -> Stored:
        """An array of its own (writes into the original never reach it)."""
        return mx.array(x)

    def put_rows(self, x: Stored, at: mx.array, new: Stored) -> Stored:
        """`x` (B, h, cap, ·) with row b's slot at[b] set to new[b] (new: (B, h, 1, ·))."""
        return mx.put_along_axis(x, mx.broadcast_to(at, new.shape), new.astype(x.dtype), axis=2)

    def arrays(self, x: Stored | None) -> list[mx.array]:
        """The MLX arrays behind `x` (to evaluate, or to count bytes)."""
        return [] if x is None else [x]

    def assemble(self, parts: list[mx.array]) -> Stored:
        """What `arrays` gave, back (ValueError: not this store's form)."""
        if len(parts) != 1:
            raise ValueError(f"{len(parts)} arrays for a dense one")
        return parts[0]


class QuantizedStore(Store):
    """Quantized storage in `fmt`: every chunk quantized as it is written."""

    def __init__(self, fmt: KVFormat):
        self.fmt = fmt

    def zeros(self, shape: tuple[int, ...], dtype: mx.Dtype) -> QArray:
        *lead, dim = shape
        f = self.fmt
        packed = mx.zeros((*lead, dim * f.bits // 32), mx.uint32)
        scales = mx.zeros((*lead, dim // f.group_size), dtype)
        return QArray((packed, scales, mx.zeros_like(scales)), f, dim)

    def take(self, x: Stored) -> QArray:
        return x if isinstance(x, QArray) else QArray.of(x, self.fmt)

    def concat(self, xs: list[Stored], axis: int = 2) -> QArray:
        qs = [self.take(x) for x in xs]
        parts = tuple(mx.concatenate([q.parts[i] for q in qs], axis=axis) for i in range(3))
        return QArray(parts, self.fmt, qs[0].dim)

    def contiguous(self, x: QArray) -> QArray:
        return QArray(tuple(mx.contiguous(p) for p in x.parts), x.fmt, x.dim)

    def copy(self, x: QArray) -> QArray:
        return QArray(tuple(mx.array(p) for p in x.parts), x.fmt, x.dim)

    def put_rows(self, x: QArray, at: mx.array, new: Stored) -> QArray:
        new = self.take(new)
        parts = tuple(
            mx.put_along_axis(p, mx.broadcast_to(at, n.shape), n.astype(p.dtype), axis=2)
            for p, n in zip(x.parts, new.parts, strict=True)
        )
        return QArray(parts, x.fmt, x.dim)

    def arrays(self, x: QArray | None) -> list[mx.array]:
        return [] if x is None else list(x.parts)

    def assemble(self, parts: list[mx.array]) -> QArray:
        f = self.fmt
        if len(parts) != 3 or parts[0].dtype != mx.uint32:
            raise ValueError("not the packed, scales, biases of a quantized array")
        dim = parts[0].shape[-1] * 32 // f.bits
        if parts[1].shape[-1] * f.group_size != dim or parts[2].shape != parts[1].shape:
            raise ValueError(f"scales of another group size than {f.group_size}")
        return QArray((parts[0], parts[1], parts[2]), f, dim)


DENSE = Store()

# what a request asks for: a KVFormat, None (dense: full precision) or "model" (the model's)
KVChoice = KVFormat | None | Literal["model"]


def store_for(fmt: KVFormat | None) -> Store:
    return DENSE if fmt is None else QuantizedStore(fmt)


def resolve(choice: KVChoice, own: KVFormat | None) -> KVFormat | None:
    """The format a request's caches take: its choice, or the model's `own` (None: dense)."""
    return own if choice == "model" else choice


def by_format(items: list[T], kv_of: Callable[[T], KVFormat | None]) -> list[list[T]]:
    """`items` in groups of one KV format each, in order (the caches of one format stack into
    one batch; a request may ask for its own)."""
    groups: dict[KVFormat | None, list[T]] = {}
    for x in items:
        groups.setdefault(kv_of(x), []).append(x)
    return list(groups.values())


def format_of(caches: list) -> KVFormat | None:
    """The KV format of a sequence's caches (their KV layers'; None: dense, or none has KV)."""
    for c in caches:
        if c.store is not None:
            return c.store.fmt
    return None
