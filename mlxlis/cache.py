"""Per-layer caches: KV caches (a preallocated one grown in steps, a rotating one for
sliding-window layers) and the recurrent state of linear-attention layers.

Reusing a common prefix (ChatSession) asks each cache how far back it can go exactly
(`rewind_to`): a KV cache to any position it holds, a rotating one while the positions it
needs have not rotated out, a recurrent state only to a position it kept a snapshot of
(`RecurrentCache.snapshot`, taken at the end of each prompt)."""

from __future__ import annotations

import mlx.core as mx


class _Lendable:
    """A KV cache whose buffers a KVBatch may hold for a while (the serving engine's batched
    decoding): reading them, or changing the cache any other way, takes them back first."""

    _keys: mx.array | None = None
    _values: mx.array | None = None
    _batch: KVBatch | None = None  # holding this cache's keys/values as its row `_row`
    _row = 0

    @property
    def keys(self) -> mx.array | None:
        self._settle()
        return self._keys

    @keys.setter
    def keys(self, value: mx.array | None) -> None:
        self._keys = value

    @property
    def values(self) -> mx.array | None:
        self._settle()
        return self._values

    @values.setter
    def values(self, value: mx.array | None) -> None:
        self._values = value

    def _settle(self) -> None:
        """Take the buffers back from a batch holding them (every row of it goes back)."""
        if self._batch is not None:
            self._batch.dissolve()


class KVCache(_Lendable):
    """Keys/values of every past position, preallocated in blocks of `step` positions."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    @property
    def held(self) -> int:
        """Valid positions in the buffers (the first `held`)."""
        return self.offset

    def claim_one(self) -> tuple[int, int]:
        """Bookkeeping of a one-token write done by a KVBatch: (the slot it goes to, valid
        slots after it)."""
        self.offset += 1
        return self.offset - 1, self.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys/values: (B, n_kv_heads, T, head_dim)
        self._settle()
        prev = self.offset
        t = keys.shape[2]
        if self.keys is None or prev + t > self.keys.shape[2]:
            b, h, _, d = keys.shape
            n_steps = (self.step + t - 1) // self.step
            k_new = mx.zeros((b, h, n_steps * self.step, d), keys.dtype)
            v_new = mx.zeros((b, h, n_steps * self.step, values.shape[3]), values.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys[..., :prev, :], k_new], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], v_new], axis=2)
            else:
                self.keys, self.values = k_new, v_new
        self.offset += t
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def trim(self, n: int) -> int:
        """Forget the last `n` positions (for reusing a common prefix); returns how many."""
        self._settle()
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


def window_mask(q_start: int, t: int, k_start: int, k_len: int, window: int | None) -> mx.array:
    """Boolean (t, k_len) mask from absolute positions: query p sees keys in (p − window, p]
    (transformers' sliding rule `kv_idx > q_idx - sliding_window`); window None = causal."""
    q = mx.arange(q_start, q_start + t)[:, None]
    k = mx.arange(k_start, k_start + k_len)[None, :]
    keep = k <= q
    if window is not None:
        keep = keep & (k > q - window)
    return keep


class RotatingKVCache(_Lendable):
    """Keys/values of the last `window` positions only, for sliding-window layers.

    Single-token steps write into a ring of `window` slots; the ring's order does not matter
    because every slot is visible to the new query. A multi-token chunk is attended against
    the ring (oldest first) plus the chunk, under a mask from absolute positions (`mask`);
    then the newest `window` of them are kept. Memory: `window` positions, plus one chunk
    while it is being attended.
    """

    step = 256

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be positive, got {window}")
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0  # positions seen so far
        self._size = 0  # valid slots (≤ window)
        self._idx = 0  # ring slot the next single-token write goes to (the oldest when full)

    @property
    def held(self) -> int:
        """Valid slots in the buffers (the first `held`, in ring order)."""
        return self._size

    def claim_one(self) -> tuple[int, int]:
        """Bookkeeping of a one-token write done by a KVBatch: (the slot it goes to, valid
        slots after it)."""
        self.offset += 1
        return self._next_slot()

    def _next_slot(self) -> tuple[int, int]:
        """Advance the ring by one position: (its slot, valid slots after it)."""
        i = self._size if self._size < self.window else self._idx
        self._size = min(self._size + 1, self.window)
        self._idx = (i + 1) % self.window
        return i, self._size

    def _ordered(self) -> tuple[mx.array, mx.array] | None:
        """Valid keys/values, oldest first."""
        if self.keys is None or self._size == 0:
            return None
        if self._size < self.window or self._idx == 0:
            return self.keys[..., : self._size, :], self.values[..., : self._size, :]
        i = self._idx
        return (
            mx.concatenate([self.keys[..., i:, :], self.keys[..., :i, :]], axis=2),
            mx.concatenate([self.values[..., i:, :], self.values[..., :i, :]], axis=2),
        )

    def mask(self, t: int) -> mx.array | None:
        """Mask for the next update of `t` positions (call it before update_and_fetch)."""
        if t == 1:
            return None  # a single query sees every slot the ring holds after the write
        return window_mask(self.offset, t, self.offset - self._size, self._size + t, self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys/values: (B, n_kv_heads, T, head_dim)
        self._settle()
        t = keys.shape[2]
        self.offset += t
        if t == 1:
            return self._write_one(keys, values)
        old = self._ordered()
        if old is not None:
            keys = mx.concatenate([old[0], keys], axis=2)
            values = mx.concatenate([old[1], values], axis=2)
        # keep the newest `window` positions, oldest first (a copy, so the chunk can be freed)
        self.keys = mx.array(keys[..., -self.window :, :])
        self.values = mx.array(values[..., -self.window :, :])
        self._size = self.keys.shape[2]
        self._idx = self._size % self.window
        return keys, values  # (B, n_kv_heads, size_before + T, head_dim), oldest first

    def _write_one(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._size < self.window:  # still filling: append, growing in blocks up to window
            cap = 0 if self.keys is None else self.keys.shape[2]
            if self._size == cap:
                b, h, _, d = keys.shape
                grow = min(self.step, self.window - cap)
                k_new = mx.zeros((b, h, grow, d), keys.dtype)
                v_new = mx.zeros((b, h, grow, values.shape[3]), values.dtype)
                if self.keys is None:
                    self.keys, self.values = k_new, v_new
                else:
                    self.keys = mx.concatenate([self.keys[..., :cap, :], k_new], axis=2)
                    self.values = mx.concatenate([self.values[..., :cap, :], v_new], axis=2)
        i, size = self._next_slot()
        self.keys[..., i : i + 1, :] = keys
        self.values[..., i : i + 1, :] = values
        return self.keys[..., :size, :], self.values[..., :size, :]

    @property
    def trimmable(self) -> int:
        """How many of the newest positions `trim` can forget and still be exact afterwards.

        Once positions have rotated out, after trimming n the cache must still hold the
        window − 1 positions before the new end; it holds `_size − n` of them."""
        if self._size == self.offset:  # nothing rotated out yet
            return self.offset
        return max(0, self._size - self.window + 1)

    def trim(self, n: int) -> int:
        """Forget the last `n` positions; returns how many were forgotten: all of `n` (or every
        position, as KVCache does when n > offset), or 0, leaving the cache untouched, when
        positions needed afterwards have already rotated out (re-prefill in that case)."""
        self._settle()
        if self._size == self.offset:
            n = min(n, self.offset)
        elif n > self.trimmable:
            return 0
        if n <= 0:
            return 0
        old = self._ordered()
        if old is not None:
            self.keys = old[0][..., : self._size - n, :]
            self.values = old[1][..., : self._size - n, :]
        self._size -= n
        self._idx = self._size % self.window
        self.offset -= n
        return n

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


class RecurrentCache:
    """A linear-attention layer's state: the last kernel−1 inputs of its convolution and the
    (B, heads, k_dim, v_dim) recurrent state, after `offset` tokens. A recurrent state cannot
    forget tokens: to go back, it restores a snapshot taken at that position (the newest
    SNAPSHOTS are kept; each costs one copy of the state)."""

    SNAPSHOTS = 2

    def __init__(self) -> None:
        self.conv_state: mx.array | None = None
        self.recurrent: mx.array | None = None
        self.offset = 0
        self._snapshots: list[tuple[int, mx.array | None, mx.array | None]] = []

    def snapshot(self) -> None:
        """Remember the state at the current position (arrays are immutable: no copy)."""
        self._snapshots = [s for s in self._snapshots if s[0] != self.offset]
        self._snapshots.append((self.offset, self.conv_state, self.recurrent))
        del self._snapshots[: -self.SNAPSHOTS]

    @property
    def trimmable(self) -> int:
        return 0

    def rewind_point(self, position: int) -> int:
        """The latest position ≤ `position` this cache can return to exactly."""
        if position >= self.offset:
            return self.offset
        return max((p for p, _, _ in self._snapshots if p <= position), default=0)

    def trim(self, n: int) -> int:
        """Go back `n` tokens if a snapshot sits exactly there; returns n, or 0 (untouched)."""
        if n <= 0:
            return 0
        target = self.offset - n
        for p, conv, state in self._snapshots:
            if p == target:
                self.conv_state, self.recurrent, self.offset = conv, state, p
                self._snapshots = [s for s in self._snapshots if s[0] <= p]
                return n
        return 0

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv_state, self.recurrent) if a is not None]


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
    query, as in RotatingKVCache); the stack is padded to the longest row."""

    step = 256  # capacity grows in blocks of this many slots

    def __init__(self, caches: list, k: mx.array, v: mx.array) -> None:
        """Stack `caches`, whose new keys and values are shaped like k, v (B, kv, T, dim)."""
        self.members = list(caches)
        dtype = next((c._keys.dtype for c in caches if c._keys is not None), k.dtype)
        self.cap = -(-(max(c.held for c in caches) + 1) // self.step) * self.step
        b, h = len(caches), k.shape[1]
        self.keys = mx.zeros((b, h, self.cap, k.shape[3]), dtype)
        self.values = mx.zeros((b, h, self.cap, v.shape[3]), dtype)
        for row, c in enumerate(caches):
            n = c.held
            if n:
                self.keys[row : row + 1, :, :n] = c._keys[..., :n, :]
                self.values[row : row + 1, :, :n] = c._values[..., :n, :]
            c._keys = c._values = None  # the batch holds them now
            c._batch, c._row = self, row

    @classmethod
    def step_of(cls, caches: list, k: mx.array, v: mx.array) -> tuple[mx.array, ...]:
        """Write k, v (B, n_kv_heads, 1, head_dim) into the caches' batch (stacking them first
        unless they are already, in this order): the (B, kv, S, head_dim) keys and values to
        attend over and the (B, 1, 1, S) mask of each row's valid slots."""
        batch = caches[0]._batch
        if batch is None or len(batch.members) != len(caches) or any(
            a is not b for a, b in zip(batch.members, caches, strict=True)
        ):
            for c in caches:
                c._settle()
            batch = cls(caches, k, v)
        return batch._step(k, v)

    def _step(self, k: mx.array, v: mx.array) -> tuple[mx.array, ...]:
        slots, valid = zip(*(c.claim_one() for c in self.members), strict=True)
        if max(slots) >= self.cap:
            grow = [mx.zeros((*a.shape[:2], self.step, a.shape[3]), a.dtype)
                    for a in (self.keys, self.values)]  # fmt: skip
            self.keys = mx.concatenate([self.keys, grow[0]], axis=2)
            self.values = mx.concatenate([self.values, grow[1]], axis=2)
            self.cap += self.step
        at = mx.array(slots, mx.int32)[:, None, None, None]  # (B, 1, 1, 1): each row's slot
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, k.shape),
                                      k.astype(self.keys.dtype), axis=2)  # fmt: skip
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, v.shape),
                                        v.astype(self.values.dtype), axis=2)  # fmt: skip
        s = max(valid)
        mask = mx.arange(s)[None, :] < mx.array(valid)[:, None]  # (B, S)
        return self.keys[:, :, :s], self.values[:, :, :s], mask[:, None, None, :]

    def dissolve(self) -> None:
        """Give every cache its row back (a copy of its valid slots); the batch is done."""
        members, self.members = self.members, []
        for c in members:
            n, row = c.held, c._row
            c._batch = None
            if n:
                c._keys = mx.contiguous(self.keys[row : row + 1, :, :n])
                c._values = mx.contiguous(self.values[row : row + 1, :, :n])
        # copied now: a copy left lazy would hold the whole stack alive (a cache kept by the
        # prefix cache is not evaluated again until a later prompt takes it)
        mx.eval([a for c in members for a in (c._keys, c._values) if a is not None])
        self.keys = self.values = None


def rewind_point(cache, position: int) -> int:
    """The latest position ≤ `position` that one layer's cache can be trimmed back to."""
    if isinstance(cache, RecurrentCache):
        return cache.rewind_point(position)
    if isinstance(cache, RotatingKVCache):
        return position if cache.offset - position <= cache.trimmable else 0
    return min(position, cache.offset)


def common_prefix(a, b) -> int:
    """How many leading ids two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reachable(caches: list, position: int) -> int:
    """The latest position ≤ `position` every one of `caches` can be trimmed back to exactly
    (any for a KV cache, a snapshot for a recurrent state)."""
    target = position
    while (back := min(rewind_point(c, target) for c in caches)) != target:
        target = back
    return target


def rewind(caches: list, held: int, position: int) -> int:
    """Trim a model's caches, which hold `held` tokens, back to the latest position ≤
    `position` every layer can return to exactly (`reachable`); returns that position, or 0
    when none above 0 could be reached."""
    target = reachable(caches, position)
    drop = held - target
    if target <= 0 or not all(c.trim(drop) == drop for c in caches):
        return 0
    return target


def snapshot(caches: list) -> None:
    """At the end of a prompt: recurrent states cannot be trimmed, so each keeps a snapshot
    there (the position a later prompt sharing this one can return to)."""
    for c in caches:
        if isinstance(c, RecurrentCache):
            c.snapshot()


def trimmable(caches: list) -> int:
    """How many newest positions every cache of a model can forget exactly (`trim` limit)."""
    return min(
        (c.trimmable if isinstance(c, (RotatingKVCache, RecurrentCache)) else c.offset
         for c in caches),
        default=0,
    )  # fmt: skip
