"""What a model holds in memory: its weights, and what a sequence's caches hold as its context
grows — so that a model that cannot fit, or a request that would outgrow the memory, is
refused before anything is allocated (runtime/memory.py gives the budget).

The caches' sizes come from the caches themselves, not from a formula per family: one token is
fed through fresh caches in the model's KV format and each cache is measured. A full-attention
layer's KV cache then holds `step` positions (bytes per position = its bytes / step; its
full-precision tail, if it has one, this one position: the tail's bytes per position); a
sliding-window ring holds at most `window` positions, plus its snapshots' copies of the window;
a recurrent layer's state has one size whatever the length, plus its snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxlis.cache import JointCache, KVCache, RecurrentCache, RotatingKVCache
from mlxlis.cache.store import KVChoice
from mlxlis.models.model import Model

import mlx.core as mx
from mlx.utils import tree_flatten

RING_COPIES = 1 + RotatingKVCache.SNAPSHOTS  # a ring's live window and its snapshots


@dataclass(frozen=True)
class Footprint:
    """Bytes of a model (`weights`) and of one sequence's caches at a given context."""

    weights: int
    per_token: int  # KV bytes each position adds on full-attention layers
    rings: tuple[tuple[int, int], ...]  # (window, bytes per position) of each sliding layer
    fixed: int  # bytes whatever the length: recurrent states and their snapshots
    tail: int = 0  # bytes per position of the full-precision tails (the newest block's)

    def kv_bytes(self, tokens: int) -> int:
        """One sequence's cache bytes after exactly `tokens` positions (prompt and reply)."""
        rings = sum(min(tokens, w) * b for w, b in self.rings) * RING_COPIES
        tail = self.tail * (tokens % KVCache.step)
        return self.per_token * tokens + rings + self.fixed + tail

    def reserve(self, tokens: int) -> int:
        """The most one sequence's caches hold on the way to `tokens` positions (a tail is
        largest just before its block fills)."""
        filled = tokens // KVCache.step * KVCache.step - 1  # the last such point before it
        return max(self.kv_bytes(tokens), self.kv_bytes(filled) if filled > 0 else 0)

    def max_context(self, room: int, limit: int) -> int:
        """The longest context (≤ limit) whose caches fit in `room` bytes; 0 if none does."""
        lo, hi = 0, limit
        while lo < hi:  # reserve grows with the length: the largest that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.reserve(mid) <= room else (lo, mid - 1)
        return lo


def weight_arrays(model: Model) -> dict[int, int]:
    """The network's arrays by identity, with their bytes (a tied embedding and head are one
    array, counted once)."""
    return {id(a): a.nbytes for _, a in tree_flatten(model.net.parameters())}


def weight_bytes(model: Model) -> int:
    return sum(weight_arrays(model).values())


def footprint(model: Model, kv: KVChoice = "model") -> Footprint:
    """Measured on one token fed through fresh caches (in the model's KV format, or `kv`)."""
    caches = model.make_cache(kv)
    mx.eval(model.net(mx.array([[0]], mx.int32), cache=caches, last_only=True))
    per_token, rings, fixed, tail = 0, [], 0, 0
    parts = [p for c in caches for p in (c.parts if isinstance(c, JointCache) else (c,))]
    for c in parts:
        size = sum(a.nbytes for a in c.state)
        if isinstance(c, RotatingKVCache):
            rings.append((c.window, size // c.keys.shape[2]))
        elif isinstance(c, KVCache):  # a tail holds this one position, dense, too
            tail_bytes = sum(a.nbytes for a in c.tail or ())
            per_token += (size - tail_bytes) // c.keys.shape[2]
            tail += tail_bytes
        elif isinstance(c, RecurrentCache):
            fixed += size * (1 + RecurrentCache.SNAPSHOTS)
        else:  # a kind of cache this module does not know: counted as it stands
            fixed += size
    return Footprint(weight_bytes(model), per_token, tuple(rings), fixed, tail)
