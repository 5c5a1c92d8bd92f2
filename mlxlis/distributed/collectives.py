"""The collectives of a tensor group, and the modules that join a rank's slices through them.

A tensor group is either every launched rank (`World`: MLX's all_sum and all_gather on the
group) or, for tensor groups inside pipeline stages, a pair of ring neighbours (`Pair`):
MLX's ring backend neither splits a group nor sends past a neighbour, so a pair's sum is
built from one exchange (send, then receive on the lower rank; receive, then send on the
higher), evaluated as it is built. Both ranks of a pair add the same two arrays in rank
order, so they hold the same sum.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import mlx.nn as nn


class Collectives(Protocol):
    def size(self) -> int: ...

    def all_sum(self, x: mx.array) -> mx.array:
        """Every member's `x` added (the same result on each)."""
        ...

    def all_gather(self, x: mx.array) -> mx.array:
        """Every member's `x` concatenated on axis 0, in member order."""
        ...


class World:
    """Every launched rank: MLX's own collectives."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def size(self) -> int:
        return self.group.size()

    def all_sum(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=self.group)

    def all_gather(self, x: mx.array) -> mx.array:
        return mx.distributed.all_gather(x, group=self.group)


class Pair:
    """Two ring neighbours `me` and `peer` of `group`, exchanging their arrays."""

    def __init__(self, group: mx.distributed.Group, me: int, peer: int):
        self.group, self.me, self.peer = group, me, peer

    def size(self) -> int:
        return 2

    def _both(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(the lower rank's array, the higher's), on both ranks. Evaluated here, in order: a
        receive has no inputs, so nothing in the graph would order it after the send."""
        if self.me < self.peer:  # send first, then receive
            mx.eval(mx.distributed.send(x, self.peer, group=self.group))
            theirs = mx.distributed.recv_like(x, self.peer, group=self.group)
            mx.eval(theirs)
            return x, theirs
        theirs = mx.distributed.recv_like(x, self.peer, group=self.group)
        mx.eval(theirs)
        mx.eval(mx.distributed.send(x, self.peer, group=self.group))
        return theirs, x

    def all_sum(self, x: mx.array) -> mx.array:
        low, high = self._both(x)
        return low + high

    def all_gather(self, x: mx.array) -> mx.array:
        return mx.concatenate(self._both(x), axis=0)


class SumRanks(nn.Module):
    """A row-parallel projection: this rank's input columns of `inner`, the partial products
    summed over the ranks (one all_sum), then the bias once."""

    def __init__(self, inner: nn.Module, group: Collectives):
        super().__init__()
        if "bias" in inner:  # added once, after the sum
            self.bias = inner.pop("bias")
        self.inner = inner
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = self._group.all_sum(self.inner(x))
        return y + self["bias"] if "bias" in self else y


class VocabEmbedding(nn.Module):
    """This rank's rows [lo, hi) of the embedding: a lookup sums, over the ranks, the rows
    each holds (zeros for ids outside them: adding zeros is exact); `as_linear` (a tied head)
    gathers every rank's slice of the logits in vocabulary order."""

    def __init__(self, inner: nn.Module, rows: range, group: Collectives):
        super().__init__()
        self.inner = inner
        self._lo, self._n = rows.start, len(rows)
        self._group = group

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self._lo
        mine = (local >= 0) & (local < self._n)
        rows = self.inner(mx.where(mine, local, 0))  # (B, T, hidden)
        rows = mx.where(mine[..., None], rows, mx.zeros((), rows.dtype))
        return self._group.all_sum(rows)

    def as_linear(self, x: mx.array) -> mx.array:
        return gather_vocab(self.inner.as_linear(x), self._group)


class VocabHead(nn.Module):
    """An untied head's rows [lo, hi) of the vocabulary: the logits' slices gathered."""

    def __init__(self, inner: nn.Module, group: Collectives):
        super().__init__()
        self.inner = inner
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        return gather_vocab(self.inner(x), self._group)


def gather_vocab(local: mx.array, group: Collectives) -> mx.array:
    """(B, T, V/N) logits on each rank -> (B, T, V) in vocabulary (rank) order."""
    n = group.size()
    b, t, v = local.shape
    every = group.all_gather(local)  # (N·B, T, V/N), rank-major
    every = every.reshape(n, b, t, v).transpose(1, 2, 0, 3)  # (B, T, N, V/N)
    return every.reshape(b, t, n * v)
