"""KV caches: a preallocated one grown in steps (full attention), a rotating one holding only
the last `window` positions (sliding-window layers), and that ring over one attention chunk
(chunked layers, whose queries see only the keys of their own chunk)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxlis.cache.store import DENSE, KVFormat, Store, Stored, Tailed, store_for

import mlx.core as mx

if TYPE_CHECKING:
    from mlxlis.cache.batch import KVBatch


class _Lendable:
    """A KV cache whose buffers a KVBatch may hold for a while (the serving engine's batched
    decoding): reading them, or changing the cache any other way, takes them back first."""

    _keys: Stored | None = None
    _values: Stored | None = None
    _batch: KVBatch | None = None  # holding this cache's keys/values as its row `_row`
    _row = 0
    store: Store = DENSE  # dense or quantized keys/values (store.py)
    tailed, tail_start = False, 0  # a KVCache's dense tail (store.py): [tail_start, offset)
    _tail: tuple[mx.array, mx.array] | None = None  # (B, n_kv_heads, ·, head_dim) each
    # positions RoPE runs ahead of `offset` (0 but after Qwen3.5's images, whose M-RoPE
    # positions advance less than their tokens): set by the generation core, not saved
    shift = 0

    @property
    def keys(self) -> Stored | None:
        self._settle()
        return self._keys

    @keys.setter
    def keys(self, value: Stored | None) -> None:
        self._keys = value

    @property
    def values(self) -> Stored | None:
        self._settle()
        return self._values

    @values.setter
    def values(self, value: Stored | None) -> None:
        self._values = value

    @property
    def tail(self) -> tuple[mx.array, mx.array] | None:
        self._settle()
        return self._tail

    def visible(self, slot: int, width: int) -> mx.array | None:
        """After a one-token write into `slot` (a KVBatch's step): which of the first `width`
        slots the new query sees, (width,) bool, or None for every valid one."""
        return None

    def _settle(self) -> None:
        """Take the buffers back from a batch holding them (every row of it goes back)."""
        if self._batch is not None:
            self._batch.dissolve()


class KVCache(_Lendable):
    """Keys/values of every past position, preallocated in blocks of `step` positions. In a
    quantized format with a tail (store.py), the positions since `tail_start` — at most the
    newest block's, until it fills — are also kept dense (`_tail`), and attention reads them
    so (a store.Tailed pair)."""

    step = 256
    label = "full attention"

    def __init__(self, fmt: KVFormat | None = None) -> None:
        self.store = store_for(fmt)
        self.tailed = fmt is not None and fmt.tail
        self.keys: Stored | None = None
        self.values: Stored | None = None
        self.offset = 0

    @property
    def held(self) -> int:
        """Valid positions in the buffers (the first `held`)."""
        return self.offset

    def claim_one(self) -> tuple[int, int]:
        """Bookkeeping of a one-token write done by a KVBatch: (the slot it goes to, valid
        slots after it); a tail whose block it fills starts again after it."""
        self.offset += 1
        if self.tailed and self.offset % self.step == 0:
            self.tail_start = self.offset
        return self.offset - 1, self.offset

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[Stored | Tailed, Stored | Tailed]:
        # keys/values: (B, n_kv_heads, T, head_dim); returned as the store holds them
        self._settle()
        prev, st = self.offset, self.store
        dense = (keys, values)
        keys, values = st.take(keys), st.take(values)  # quantized once, if the store is
        t = keys.shape[2]
        if self.keys is None or prev + t > self.keys.shape[2]:
            b, h, _, d = keys.shape
            n_steps = (self.step + t - 1) // self.step
            k_new = st.zeros((b, h, n_steps * self.step, d), keys.dtype)
            v_new = st.zeros((b, h, n_steps * self.step, values.shape[3]), values.dtype)
            if self.keys is not None:
                self.keys = st.concat([self.keys[..., :prev, :], k_new])
                self.values = st.concat([self.values[..., :prev, :], v_new])
            else:
                self.keys, self.values = k_new, v_new
        self.offset += t
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        if self.tailed:
            return self._grow_tail(*dense)
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def _grow_tail(self, k: mx.array, v: mx.array) -> tuple[Stored | Tailed, Stored | Tailed]:
        """The new positions' dense k, v onto the tail, which keeps only the newest block's
        positions; what attention reads: the quantized ones before the tail, then the tail."""
        if self._tail is not None:
            k, v = (mx.concatenate([a, b], axis=2) for a, b in zip(self._tail, (k, v), strict=True))
        block = self.offset // self.step * self.step
        if block > self.tail_start:  # a block filled: its positions stay quantized only
            k, v = k[..., block - self.tail_start :, :], v[..., block - self.tail_start :, :]
            self.tail_start = block
        self._tail = (mx.array(k), mx.array(v)) if k.shape[2] else None  # not the chunk's view
        return self._read()

    def _read(self) -> tuple[Stored | Tailed, Stored | Tailed]:
        ts, n = self.tail_start, self.offset
        if self._tail is None:
            return self.keys[..., :n, :], self.values[..., :n, :]
        if ts == 0:
            return self._tail
        tk, tv = self._tail
        return Tailed(self.keys[..., :ts, :], tk), Tailed(self.values[..., :ts, :], tv)

    @property
    def trimmable(self) -> int:
        """Every position it holds can be forgotten exactly."""
        return self.offset

    def rewind_point(self, position: int) -> int:
        """The latest position ≤ `position` this cache can be trimmed back to: any it holds."""
        return min(position, self.offset)

    def snapshot(self) -> None:
        """Nothing to keep: a KV cache returns to any position it holds."""

    def expect_rewind(self, n: int) -> None:
        """Nothing to keep: a KV cache returns to any position it holds."""

    def trim(self, n: int) -> int:
        """Forget the last `n` positions (for reusing a common prefix); returns how many. The
        tail keeps what is left of it (positions before it stay quantized only)."""
        self._settle()
        n = min(self.offset, n)
        self.offset -= n
        if self.tailed:
            keep = self.offset - self.tail_start
            if keep <= 0:
                self.tail_start, self._tail = self.offset, None
            elif self._tail is not None:
                self._tail = tuple(a[..., :keep, :] for a in self._tail)
        return n

    @property
    def state(self) -> list[mx.array]:
        quantized = self.store.arrays(self.keys) + self.store.arrays(self.values)
        return quantized + list(self.tail or ())

    def export(self) -> tuple[dict, dict[str, mx.array]]:
        """(facts, arrays) a file can hold: the valid positions' keys and values (and the
        tail's dense copies)."""
        arrays = {}
        if self.offset:
            put(arrays, "k", self.store, self.keys[..., : self.offset, :])
            put(arrays, "v", self.store, self.values[..., : self.offset, :])
        if self.tail is not None:
            arrays["tk"], arrays["tv"] = self.tail
        facts = {"kind": "kv", "offset": self.offset, "tail_start": self.tail_start}
        return facts, arrays

    def restore(self, facts: dict, arrays: dict[str, mx.array]) -> None:
        """Become the cache `export` described (this one fresh, in the same format;
        ValueError: not what a KV cache exported)."""
        kind(facts, "kv")
        self.offset = int(facts["offset"])
        if self.offset:
            self.keys, self.values = take(arrays, "k", self.store), take(arrays, "v", self.store)
            check_pair(self.keys, self.values, self.offset)
        self.tail_start = int(facts.get("tail_start", self.offset))
        n = self.offset - self.tail_start
        if not self.tailed or n <= 0:
            if n < 0 or "tk" in arrays:
                raise ValueError(f"a tail from {self.tail_start} after {self.offset} positions")
            self.tail_start = self.offset if self.tailed else 0
            return
        if n >= self.step:
            raise ValueError(f"a tail of {n} positions, more than a block")
        self._tail = (arrays["tk"], arrays["tv"])
        check_pair(*self._tail, n)
        if self._tail[0].shape[2] != n:
            raise ValueError(f"a tail of {self._tail[0].shape[2]} positions, not {n}")


def kind(facts: dict, want: str) -> None:
    if facts.get("kind") != want:
        raise ValueError(f"a {facts.get('kind')!r} layer where this model has a {want!r} one")


def check_pair(keys: Stored, values: Stored, positions: int) -> None:
    """ValueError unless keys and values are one sequence's (1, n_kv_heads, ≥ positions, ·)."""
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys {keys.shape} and values {values.shape} do not pair")
    if keys.shape[0] != 1 or keys.shape[2] < positions:
        raise ValueError(f"keys {keys.shape} do not hold {positions} positions of one sequence")


def put(arrays: dict[str, mx.array], name: str, store: Store, x: Stored) -> None:
    """`x`'s arrays into `arrays` as name.0, name.1, … (one for dense, three quantized)."""
    for i, a in enumerate(store.arrays(x)):
        arrays[f"{name}.{i}"] = a


def take(arrays: dict[str, mx.array], name: str, store: Store) -> Stored:
    """What `put` wrote under `name`, in `store`'s form (KeyError: missing)."""
    parts = []
    while f"{name}.{len(parts)}" in arrays:
        parts.append(arrays[f"{name}.{len(parts)}"])
    return store.assemble(parts)


def window_mask(
    q_start: int, t: int, k_start: int, k_len: int, window: int | None, chunk: int | None = None
) -> mx.array:
    """Boolean (t, k_len) mask from absolute positions: query p sees keys in (p − window, p]
    (transformers' sliding rule `kv_idx > q_idx - sliding_window`); window None = causal;
    with `chunk`, only keys of p's own chunk (transformers' `kv_idx // c == q_idx // c`)."""
    q = mx.arange(q_start, q_start + t)[:, None]
    k = mx.arange(k_start, k_start + k_len)[None, :]
    keep = k <= q
    if window is not None:
        keep = keep & (k > q - window)
    if chunk is not None:
        keep = keep & (k // chunk == q // chunk)
    return keep


class RotatingKVCache(_Lendable):
    """Keys/values of the last `window` positions only, for sliding-window layers.

    Single-token steps write into a ring of `window` slots; the ring's order does not matter
    because every slot is visible to the new query. A multi-token chunk is attended against
    the ring (oldest first) plus the chunk, under a mask from absolute positions (`mask`);
    then the newest `window` of them are kept. Memory: `window` positions, plus one chunk
    while it is being attended, plus a copy of the window per snapshot.

    Once positions have rotated out, the ring returns exactly only to its newest position or
    to a snapshot: a copy of the window taken at a position a later prompt will share (the
    end of a conversation before its generation prompt), the newest SNAPSHOTS kept.
    """

    step = 256
    # a window's copy each (Gemma 3 12B: 40 sliding layers x 8 MB in float16): one, where the
    # next turn returns (a second would mostly hold the turn before, which it rarely does)
    SNAPSHOTS = 1
    label = "sliding window"

    def __init__(self, window: int, fmt: KVFormat | None = None) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be positive, got {window}")
        self.window = window
        self.store = store_for(fmt)
        self.keys: Stored | None = None
        self.values: Stored | None = None
        self.offset = 0  # positions seen so far
        self._size = 0  # valid slots (≤ window)
        self._idx = 0  # ring slot the next single-token write goes to (the oldest when full)
        # (offset, valid slots, keys, values oldest first): arrays the live ring never writes
        self._snapshots: list[tuple[int, int, Stored, Stored]] = []
        self._keep = 0  # positions the next multi-token update keeps past the window
        # (offset, keys, values): the positions a verification pushed out of the window last
        self._spill: tuple[int, Stored, Stored] | None = None

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

    def _ordered(self) -> tuple[Stored, Stored] | None:
        """Valid keys/values, oldest first."""
        if self.keys is None or self._size == 0:
            return None
        if self._size < self.window or self._idx == 0:
            return self.keys[..., : self._size, :], self.values[..., : self._size, :]
        i, cat = self._idx, self.store.concat
        return (
            cat([self.keys[..., i:, :], self.keys[..., :i, :]]),
            cat([self.values[..., i:, :], self.values[..., :i, :]]),
        )

    def mask(self, t: int) -> mx.array | None:
        """Mask for the next update of `t` positions (call it before update_and_fetch)."""
        if t == 1:
            return None  # a single query sees every slot the ring holds after the write
        return window_mask(self.offset, t, self.offset - self._size, self._size + t, self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Stored, Stored]:
        # keys/values: (B, n_kv_heads, T, head_dim); returned as the store holds them
        self._settle()
        t, st = keys.shape[2], self.store
        keys, values = st.take(keys), st.take(values)  # quantized once, if the store is
        self.offset += t
        self._spill, keep, self._keep = None, self._keep, 0
        if t == 1:
            return self._write_one(keys, values)
        old = self._ordered()
        if old is not None:
            keys, values = st.concat([old[0], keys]), st.concat([old[1], values])
        out = keys.shape[2] - self.window  # positions that rotate out now
        if keep and out > 0:  # the newest of them, for a rewind into this update (`trim`)
            a = max(0, out - keep)
            self._spill = (
                self.offset,
                st.contiguous(keys[..., a:out, :]),
                st.contiguous(values[..., a:out, :]),
            )
        # keep the newest `window` positions, oldest first (a copy, so the chunk can be freed)
        self.keys = st.copy(keys[..., -self.window :, :])
        self.values = st.copy(values[..., -self.window :, :])
        self._size = self.keys.shape[2]
        self._idx = self._size % self.window
        return keys, values  # (B, n_kv_heads, size_before + T, head_dim), oldest first

    def _write_one(self, keys: Stored, values: Stored) -> tuple[Stored, Stored]:
        st = self.store
        if self._size < self.window:  # still filling: append, growing in blocks up to window
            cap = 0 if self.keys is None else self.keys.shape[2]
            if self._size == cap:
                b, h, _, d = keys.shape
                grow = min(self.step, self.window - cap)
                k_new = st.zeros((b, h, grow, d), keys.dtype)
                v_new = st.zeros((b, h, grow, values.shape[3]), values.dtype)
                if self.keys is None:
                    self.keys, self.values = k_new, v_new
                else:
                    self.keys = st.concat([self.keys[..., :cap, :], k_new])
                    self.values = st.concat([self.values[..., :cap, :], v_new])
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
        return max(0, self._size - self.window + 1) + self._spilled()

    def _spilled(self) -> int:
        """How many rotated-out positions the last update kept (`expect_rewind`)."""
        sp = self._spill
        return sp[1].shape[2] if sp is not None and sp[0] == self.offset else 0

    def expect_rewind(self, n: int) -> None:
        """The next multi-token update keeps up to `n` of the positions it pushes out of the
        window, so trimming up to `n` of its positions stays exact."""
        self._keep = n

    def rewind_point(self, position: int) -> int:
        """`position` while what it needs there has not rotated out, else the latest snapshot
        at or before it (0: none)."""
        if self.offset - position <= self.trimmable:
            return min(position, self.offset)
        return max((s[0] for s in self._snapshots if s[0] <= position), default=0)

    def snapshot(self) -> None:
        """Remember the current position: a copy of the window, oldest first. `_write_one`
        assigns into the live buffers in place, so the copy is an array of its own."""
        old = self._ordered()
        if old is None:
            return
        # evaluated with `state`
        keys, values = self.store.contiguous(old[0]), self.store.contiguous(old[1])
        self._snapshots = [s for s in self._snapshots if s[0] != self.offset]
        self._snapshots.append((self.offset, self._size, keys, values))
        del self._snapshots[: -self.SNAPSHOTS]

    def trim(self, n: int) -> int:
        """Forget the last `n` positions; returns how many were forgotten: all of `n` (or every
        position, as KVCache does when n > offset), or 0, leaving the cache untouched, when
        positions needed afterwards have already rotated out and no snapshot sits exactly at
        offset − n (re-prefill in that case)."""
        self._settle()
        if self._size == self.offset:
            n = min(n, self.offset)
        elif n > self.trimmable:
            return self._restore(self.offset - n)
        if n <= 0:
            return 0
        old = self._ordered()
        size = self._size
        if old is not None:
            keys, values = old
            if n > size - self.window + 1 and self._spilled():  # back into the spilled ones
                keys = self.store.concat([self._spill[1], keys])
                values = self.store.concat([self._spill[2], values])
                size += self._spilled()
            start = max(0, size - n - self.window)
            self.keys = keys[..., start : size - n, :]
            self.values = values[..., start : size - n, :]
            size -= start
        self._size = size - n
        self._idx = self._size % self.window
        self.offset -= n
        self._spill = None
        self._forget_after(self.offset)
        return n

    def _restore(self, position: int) -> int:
        """Return to the snapshot at `position`: how many positions that forgot, or 0 (none)."""
        snap = next((s for s in self._snapshots if s[0] == position), None)
        if snap is None or position <= 0:
            return 0
        n = self.offset - position
        _, size, keys, values = snap
        # slices: objects of their own, so writes into the ring never reach the snapshot's
        self.keys, self.values = keys[..., :size, :], values[..., :size, :]
        self.offset, self._size, self._idx = position, size, size % self.window
        self._spill = None
        self._forget_after(position)
        return n

    def _forget_after(self, position: int) -> None:
        """Snapshots past `position` are of a future that will not come: dropped."""
        self._snapshots = [s for s in self._snapshots if s[0] <= position]

    def export(self) -> tuple[dict, dict[str, mx.array]]:
        """(facts, arrays) a file can hold: the window oldest first, and the snapshots."""
        arrays, st = {}, self.store
        old = self._ordered()
        if old is not None:
            put(arrays, "k", st, old[0])
            put(arrays, "v", st, old[1])
        snaps = []
        for i, (offset, size, keys, values) in enumerate(self._snapshots):
            put(arrays, f"s{i}k", st, keys)
            put(arrays, f"s{i}v", st, values)
            snaps.append([offset, size])
        facts = {"kind": "ring", "window": self.window, "offset": self.offset}
        return facts | {"size": self._size, "snapshots": snaps}, arrays

    def restore(self, facts: dict, arrays: dict[str, mx.array]) -> None:
        """Become the ring `export` described (this one fresh, of the same window and format)."""
        kind(facts, "ring")
        if int(facts["window"]) != self.window:
            raise ValueError(f"window {facts['window']}, not {self.window}")
        st = self.store
        self.offset, self._size = int(facts["offset"]), int(facts["size"])
        if not 0 <= self._size <= min(self.window, self.offset):
            raise ValueError(f"{self._size} slots held after {self.offset} positions")
        if self._size:
            self.keys, self.values = take(arrays, "k", st), take(arrays, "v", st)
            check_pair(self.keys, self.values, self._size)
        self._idx = self._size % self.window
        self._snapshots = [
            (int(o), int(n), take(arrays, f"s{i}k", st), take(arrays, f"s{i}v", st))
            for i, (o, n) in enumerate(facts["snapshots"])
        ]
        for _, n, k, v in self._snapshots:
            check_pair(k, v, n)

    @property
    def state(self) -> list[mx.array]:
        live = [] if self.keys is None else [self.keys, self.values]
        spill = [] if self._spill is None else list(self._spill[1:])
        held = live + spill + [a for s in self._snapshots for a in s[2:]]
        return [a for x in held for a in self.store.arrays(x)]


class ChunkedKVCache(RotatingKVCache):
    """The ring over one attention chunk (Llama 4's chunked layers): a query at position p sees
    the keys from its chunk's start ⌊p / chunk⌋·chunk to p, all of them among the newest
    `chunk` positions, so a ring of `chunk` slots holds them; the masks leave out the slots of
    the chunk before. Rewinding, snapshots and files are the ring's."""

    label = "attention chunk"

    def mask(self, t: int) -> mx.array | None:
        """Mask for the next update of `t` positions (call it before update_and_fetch)."""
        if t > 1:
            k_start = self.offset - self._size
            return window_mask(self.offset, t, k_start, self._size + t, None, self.window)
        slot = self._size if self._size < self.window else self._idx  # the new key's slot
        seen = self._seen(slot, min(self._size + 1, self.window), self.offset)
        return None if seen is None else seen[None, :]

    def visible(self, slot: int, width: int) -> mx.array | None:
        return self._seen(slot, width, self.offset - 1)  # claim_one moved offset already

    def _seen(self, slot: int, width: int, position: int) -> mx.array | None:
        """Slots 0..width−1 the query at `position` (its key in `slot`) sees: slot j holds the
        position (slot − j) mod window before it, seen while within the query's chunk."""
        since = position % self.window  # positions of this chunk before the query
        if since >= width - 1:
            return None
        age = (slot - mx.arange(width)) % self.window
        return age <= since

    def export(self) -> tuple[dict, dict[str, mx.array]]:
        facts, arrays = super().export()
        return facts | {"kind": "chunk"}, arrays

    def restore(self, facts: dict, arrays: dict[str, mx.array]) -> None:
        kind(facts, "chunk")
        super().restore(facts | {"kind": "ring"}, arrays)
