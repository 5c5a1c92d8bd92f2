"""Several sequences' caches decoding together: CacheBatch (one layer's caches, one token
each) and KVBatch (their KV buffers stacked for one masked attention)."""

from __future__ import annotations

from mlxlis.cache.base import BatchedKV
from mlxlis.cache.store import Stored, Tailed

import mlx.core as mx


class CacheBatch:
    """One layer's caches of several sequences decoding together, one token each (the
    serving engine's batched step): the layer runs its projections on the whole batch and its
    attention / recurrence on each sequence's own cache, so each row equals its lone run."""

    def __init__(self, caches: list) -> None:
        self.caches = caches


class KVBatch:
    """The keys/values of B sequences' KV caches (one layer) stacked into (B, n_kv_heads, cap,
    head_dim) buffers while they decode together, so a step's attention is one masked product
    over the batch instead of B small ones (the per-operation cost on a CPU: SmolLM2, 8
    sequences, half of a step went to its 240 per-sequence attentions).

    The caches lend their buffers (each is the row `_row`) and keep their own counters; the
    first use of one that is not this batch's step (a lone step, a trim, reading its state)
    hands every row back (`dissolve`). Stacking copies the caches once; then each step writes
    one slot per row (the cache's `claim_one`: a KV cache's next position, a ring's next slot)
    and each row attends over its first `held` slots (a ring's order does not matter to one
    query, as in RotatingKVCache); the stack is padded to the longest row.

    KV caches with a full-precision tail (store.py) lend it too, stacked (B, kv, step, dim):
    row b's tail slot j holds its position tail_start_b + j, and a row attends over its
    quantized positions before its tail, then its tail (a store.Tailed pair; the mask covers
    both)."""

    step = 256  # capacity grows in blocks of this many slots

    def __init__(self, caches: list[BatchedKV], k: mx.array, v: mx.array) -> None:
        """Stack `caches`, whose new keys and values are shaped like k, v (B, kv, T, dim)."""
        self.members = list(caches)
        self.store = st = caches[0].store  # the caches of one layer share their format
        dtype = next((c._keys.dtype for c in caches if c._keys is not None), k.dtype)
        self.cap = -(-(max(c.held for c in caches) + 1) // self.step) * self.step
        b, h = len(caches), k.shape[1]
        self.keys = st.zeros((b, h, self.cap, k.shape[3]), dtype)
        self.values = st.zeros((b, h, self.cap, v.shape[3]), dtype)
        self.tailed = caches[0].tailed
        if self.tailed:  # dense: (B, kv, step, dim), each row's tail from slot 0
            step = caches[0].step
            self.tail = [mx.zeros((b, h, step, x.shape[3]), x.dtype) for x in (k, v)]
        for row, c in enumerate(caches):
            n = c.held
            if n:
                self.keys[row : row + 1, :, :n] = c._keys[..., :n, :]
                self.values[row : row + 1, :, :n] = c._values[..., :n, :]
            if self.tailed and c.tail is not None:
                for buf, a in zip(self.tail, c.tail, strict=True):
                    buf[row : row + 1, :, : a.shape[2]] = a
            c._keys = c._values = c._tail = None  # the batch holds them now
            c._batch, c._row = self, row

    @classmethod
    def step_of(cls, caches: list[BatchedKV], k: mx.array, v: mx.array) -> tuple[mx.array, ...]:
        """Write k, v (B, n_kv_heads, 1, head_dim) into the caches' batch (stacking them first
        unless they are already, in this order): the (B, kv, S, head_dim) keys and values to
        attend over and the (B, 1, 1, S) mask of each row's valid slots."""
        batch = caches[0]._batch
        if (
            batch is None
            or len(batch.members) != len(caches)
            or any(a is not b for a, b in zip(batch.members, caches, strict=True))
        ):
            for c in caches:
                c._settle()
            batch = cls(caches, k, v)
        return batch._step(k, v)

    def _step(self, k: mx.array, v: mx.array) -> tuple[Stored, Stored, mx.array]:
        starts = [c.tail_start for c in self.members]  # before this token
        slots, valid = zip(*(c.claim_one() for c in self.members), strict=True)
        st = self.store
        if max(slots) >= self.cap:
            grow = [
                st.zeros((*a.shape[:2], self.step, a.shape[3]), a.dtype)
                for a in (self.keys, self.values)
            ]
            self.keys = st.concat([self.keys, grow[0]])
            self.values = st.concat([self.values, grow[1]])
            self.cap += self.step
        at = mx.array(slots, mx.int32)[:, None, None, None]  # (B, 1, 1, 1): each row's slot
        self.keys = st.put_rows(self.keys, at, st.take(k))
        self.values = st.put_rows(self.values, at, st.take(v))
        s = max(valid)
        if self.tailed:
            return self._tailed(k, v, slots, starts, s)
        mask = mx.arange(s)[None, :] < mx.array(valid)[:, None]  # (B, S)
        seen = [c.visible(i, s) for c, i in zip(self.members, slots, strict=True)]
        if any(x is not None for x in seen):  # an attention chunk's ring: its chunk's slots
            mask = mask & mx.stack([mx.ones((s,), mx.bool_) if x is None else x for x in seen])
        return self.keys[:, :, :s], self.values[:, :, :s], mask[:, None, None, :]

    def _tailed(self, k, v, slots, starts, s) -> tuple[Tailed, Tailed, mx.array]:
        """This token also into each row's tail (slot - tail_start); rows attend over their
        positions before the tail start, then their tail up to this token."""
        at = mx.array([p - t for p, t in zip(slots, starts, strict=True)])[:, None, None, None]
        self.tail = [
            mx.put_along_axis(buf, mx.broadcast_to(at, x.shape), x.astype(buf.dtype), axis=2)
            for buf, x in zip(self.tail, (k, v), strict=True)
        ]
        before = mx.array(starts)[:, None]  # the head: positions < tail_start (before it moves)
        width = max(p - t for p, t in zip(slots, starts, strict=True)) + 1
        used = (at[:, 0, 0, 0] + 1)[:, None]  # tail slots in use, this token's included
        mask = mx.concatenate(
            [mx.arange(s)[None, :] < before, mx.arange(width)[None, :] < used], axis=1
        )  # (B, S + width)
        tk, tv = (buf[:, :, :width] for buf in self.tail)
        head_k, head_v = self.keys[:, :, :s], self.values[:, :, :s]
        return Tailed(head_k, tk), Tailed(head_v, tv), mask[:, None, None, :]

    def dissolve(self) -> None:
        """Give every cache its row back (a copy of its valid slots); the batch is done."""
        members, self.members = self.members, []
        for c in members:
            n, row = c.held, c._row
            c._batch = None
            if n:
                c._keys = self.store.contiguous(self.keys[row : row + 1, :, :n])
                c._values = self.store.contiguous(self.values[row : row + 1, :, :n])
            if self.tailed:
                used = n - c.tail_start
                c._tail = tuple(mx.contiguous(b[row : row + 1, :, :used]) for b in self.tail)
                c._tail = c._tail if used else None
        # copied now: a copy left lazy would hold the whole stack alive (a cache kept by the
        # prefix cache is not evaluated again until a later prompt takes it)
        mx.eval([a for c in members for x in (c._keys, c._values) for a in self.store.arrays(x)])
        mx.eval([a for c in members for a in (c.tail or ())])
        self.keys = self.values = self.tail = None
