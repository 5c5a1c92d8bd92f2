"""Compressed entries (DeepSeek V4's compressed attention): one entry per closed window of
`rate` positions, held in a KVCache of windows (the entries as its keys, no values) while
the cache counts positions, so a layer's JointCache advances, trims, snapshots and saves it
beside its token-aligned parts. Trimming back to position p keeps the p // rate windows
closed by then; the positions of an open window are recomputed from the token-aligned raw
projections the layer keeps beside it (a KVCache), so any position is reachable exactly."""

from __future__ import annotations

from mlxlis.cache.kv import KVCache

import mlx.core as mx


class EntryCache:
    """The entries (B, 1, windows, dims) of the closed windows after `offset` positions."""

    label = "compressed"
    shift = 0
    store = None  # not a KV format's keys/values: never quantized

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.offset = 0
        self.windows = KVCache()

    def append(self, entries: mx.array, positions: int) -> mx.array:
        """`positions` more fed, closing the windows whose entries (B, n, dims) are given ->
        every entry so far (B, windows, dims)."""
        self.offset += positions
        if self.offset // self.rate != self.windows.offset + entries.shape[1]:
            raise RuntimeError(f"{entries.shape[1]} entries for {positions} positions")
        if entries.shape[1]:
            b = entries.shape[0]
            empty = mx.zeros((b, 1, entries.shape[1], 0), entries.dtype)
            keys, _ = self.windows.update_and_fetch(entries[:, None], empty)
            return keys[:, 0]
        if self.windows.offset:
            return self.windows.keys[:, 0, : self.windows.offset]
        return entries

    @property
    def state(self) -> list[mx.array]:
        return self.windows.state

    @property
    def trimmable(self) -> int:
        return self.offset

    def rewind_point(self, position: int) -> int:
        return min(position, self.offset)

    def trim(self, n: int) -> int:
        if n <= 0 or n > self.offset:
            return 0
        self.offset -= n
        drop = self.windows.offset - self.offset // self.rate
        if drop and self.windows.trim(drop) != drop:
            raise RuntimeError(f"the compressed entries could not drop {drop} windows")
        return n

    def expect_rewind(self, n: int) -> None:
        """Nothing to keep: any position is reachable."""

    def snapshot(self) -> None:
        """Nothing to keep: any position is reachable."""

    def export(self) -> tuple[dict, dict[str, mx.array]]:
        facts, arrays = self.windows.export()
        return {"kind": "compressed", "offset": self.offset, "windows": facts}, arrays

    def restore(self, facts: dict, arrays: dict[str, mx.array]) -> None:
        if facts.get("kind") != "compressed":
            raise ValueError(f"a {facts.get('kind')!r} layer where this model has a compressed one")
        self.offset = int(facts["offset"])
        self.windows.restore(facts["windows"], arrays)
