"""Reading one slice of a tensor from its file (a tensor-parallel rank's share), never the rest.

A `Cut` names a range along one logical axis of a parameter: output rows (axis −2 of a
matrix, −1 of a vector) or input columns (axis −1 of a matrix), counted in weights. Each
format maps it onto what it stores:
  GGUF         rows are whole runs of blocks: a row range is a contiguous span of the bytes
               (per leading index); a column range takes whole blocks of every row (32 or 256
               weights), and one that would cut a block is refused.
  safetensors  read through a memory map with numpy: only the cut's bytes are copied. An
               MLX-quantized layer's packed words (32 / bits weights each) and its scales and
               biases (one per group) are cut on the same columns, at whole words and groups.
The copies are the rank's weights: the whole tensor is never materialised, so a rank's peak
memory is its share.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from mlxlis.errors import UnsupportedError
from mlxlis.loading.gguf import GGML_TYPES, GGUFTensor
from mlxlis.loading.safetensors import DTYPE_SIZES, ST_DTYPES

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Cut:
    """Weights `part` of the `whole` along `axis` (negative: counted from the last) of a
    parameter, as the network uses it."""

    axis: int
    part: range
    whole: int

    def stored(self, length: int, what: str, where: str) -> range:
        """The range along a stored axis of `length` entries that each hold `whole / length`
        weights (packed words, a group's scale, a block): an UnsupportedError naming `what`
        where the cut falls inside one."""
        if length == self.whole:
            return self.part
        per, rest = divmod(self.whole, length)
        if rest or not per:
            raise UnsupportedError(
                f"{length} stored entries do not hold the {self.whole} weights the split "
                "expects in whole groups",
                path=where,
                field=what,
            )
        if self.part.start % per or len(self.part) % per:
            raise UnsupportedError(
                f"weights {self.part.start}-{self.part.stop - 1} of {self.whole} cut a "
                f"quantization group or packed word of {per} weights",
                path=where,
                field=what,
            )
        return range(self.part.start // per, self.part.stop // per)


def cut_gguf(t: GGUFTensor, cut: Cut, where: str) -> GGUFTensor:
    """`t` as if the file held only `cut` of it (numpy order: the blocked axis last); an
    UnsupportedError naming the tensor where the cut falls inside a block."""
    shape = list(t.shape)
    axis = cut.axis % len(shape)
    if shape[axis] != cut.whole:
        raise UnsupportedError(
            f"axis {axis} holds {shape[axis]} weights, the split expects {cut.whole}",
            path=where,
            field=t.name,
        )
    _, block, block_bytes = GGML_TYPES[t.ggml_type]
    if axis == len(shape) - 1:
        cut.stored(shape[-1] // block, t.name, where)
    shape[axis] = len(cut.part)
    nbytes = math.prod(shape) // block * block_bytes
    return replace(t, shape=tuple(shape), nbytes=nbytes)


def cut_gguf_bytes(t: GGUFTensor, raw: np.ndarray, cut: Cut, where: str) -> np.ndarray:
    """The bytes of `cut` of `t` (its raw bytes): each row's whole blocks, copied."""
    shape = t.shape
    axis = cut.axis % len(shape)
    _, block, block_bytes = GGML_TYPES[t.ggml_type]
    blocks = shape[-1] // block
    rows = raw.reshape(*shape[:-1], blocks, block_bytes)  # (..., blocks, bytes per block)
    if axis == len(shape) - 1:
        taken = cut.stored(blocks, t.name, where)
        rows = rows[..., taken.start : taken.stop, :]
    else:
        rows = rows[(slice(None),) * axis + (slice(cut.part.start, cut.part.stop),)]
    return np.ascontiguousarray(rows).reshape(-1)


def read_cut(file: Path, entry: dict, cut: Cut, name: str, where: str) -> mx.array:
    """Only `cut` of the tensor `entry` (a safetensors header entry) of `file`, as an MLX
    array (the file's other bytes are never copied)."""
    shape = list(entry["shape"])
    axis = cut.axis % len(shape)
    taken = cut.stored(shape[axis], name, where)
    size = DTYPE_SIZES[entry["dtype"]]
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    start = 8 + n + entry["data_offsets"][0]
    if not math.prod(shape):
        raise UnsupportedError("an empty tensor is not split", path=where, field=name)
    words = np.memmap(file, dtype=f"<u{size}", mode="r", offset=start, shape=tuple(shape))
    index = (slice(None),) * axis + (slice(taken.start, taken.stop),)
    data = np.ascontiguousarray(words[index])
    del words
    out = mx.array(data)
    dtype = ST_DTYPES[entry["dtype"]]
    return out if out.dtype == dtype else out.view(dtype)
