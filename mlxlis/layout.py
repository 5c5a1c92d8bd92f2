"""Input-major weight layout for CPU decoding (opt-in: `mlxlis.load(..., input_major=True)`).

MLX computes `x @ W.T` for a Linear; on CPU that is a BLAS sgemm with a transposed operand.
Storing the weight input-major, (in, out) contiguous, and computing `x @ W_t` made a single
49152×576 head product 1.6× faster in isolation (27 ms -> 17 ms, 2-core x86, OpenBLAS). End to
end it did not pay: SmolLM2 decoded at 10.2–11.3 tok/s either way, and Qwen2.5 dropped from
3.7–4.2 to 2.6–2.7 tok/s with 4–5 s more load time. So it is off by default; it stays
available, and tested, for machines where it measures faster.

A tied embedding is stored once, input-major too: lookups gather columns, the head is a plain
product (one array, never two). Applied after binding, so checkpoint names and shapes are
checked in the Hugging Face layout; the swapped modules hold `weight_t`, so nothing reads them
as HF-shaped by mistake.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# A weight above this size keeps its row-major layout: its transpose costs more load time
# (≈1.3 s for Gemma 3's 671 MB tied table) than the "ready in 2 s" budget leaves.
MAX_TRANSPOSE_BYTES = 256 * 2**20


def transposed(w: mx.array) -> mx.array:
    """W.T as a new contiguous array. MLX's strided copy of a large transpose is slow (5 s for
    671 MB here), so numpy-typed arrays are copied in row blocks straight into the new MLX
    buffer (0.25 s for 113 MB), through MLX's documented writable numpy view."""
    if w.dtype not in (mx.float32, mx.float16):
        return mx.contiguous(w.T)
    out = mx.zeros((w.shape[1], w.shape[0]), w.dtype)
    mx.eval(out, w)
    dst, src = np.array(out, copy=False), np.array(w, copy=False)
    if not dst.flags.writeable:
        return mx.contiguous(w.T)
    for i in range(0, src.shape[0], 64):  # 64 rows: a block that stays in cache
        dst[:, i : i + 64] = src[i : i + 64].T
    return out


class InputMajorLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = transposed(linear.weight)  # (in, out)
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight_t
        return y + self.bias if "bias" in self else y


class InputMajorEmbedding(nn.Module):
    """A tied embedding stored (hidden, vocab): the head's product needs no transpose."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight_t = transposed(embedding.weight)  # (hidden, vocab)

    def __call__(self, ids: mx.array) -> mx.array:
        # (hidden, *ids.shape) -> (*ids.shape, hidden)
        return mx.moveaxis(mx.take(self.weight_t, ids, axis=1), 0, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def to_input_major(net: nn.Module, linears: bool = True) -> int:
    """Swap every dense Linear (and a tied dense embedding) for its input-major form, one
    module at a time so the transient copy is one tensor. Returns how many were swapped."""
    tied = bool(getattr(getattr(net, "config", None), "tie_word_embeddings", False))

    def swap(child: object) -> nn.Module | None:
        if linears and type(child) is nn.Linear and child.weight.nbytes <= MAX_TRANSPOSE_BYTES:
            new: nn.Module = InputMajorLinear(child)
        elif (
            tied
            and type(child) is nn.Embedding
            and child.weight.nbytes <= MAX_TRANSPOSE_BYTES
        ):
            new = InputMajorEmbedding(child)
        else:
            return None
        mx.eval(new.parameters())
        return new

    swapped = 0
    for _, parent in net.named_modules():
        for key, child in list(parent.children().items()):
            items = child if isinstance(child, list) else [child]
            for i, item in enumerate(items):
                new = swap(item)
                if new is None:
                    continue
                if isinstance(child, list):
                    child[i] = new
                else:
                    setattr(parent, key, new)
                swapped += 1
    return swapped
