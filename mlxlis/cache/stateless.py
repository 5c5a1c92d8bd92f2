"""The cache of a layer that keeps nothing between positions (Nemotron-H's MLP and expert
layers, each a whole block of its own): it only counts the positions fed, so the model's caches
stay one per layer and agree on where the sequence is; it returns to any position."""

from __future__ import annotations

import mlx.core as mx


class StatelessCache:
    """Positions fed so far (`offset`), nothing else: trims and rewinds anywhere, snapshots
    nothing, exports only its offset."""

    label = "stateless"
    shift = 0  # no positions (kv.py's `shift`)
    store = None  # no keys/values

    def __init__(self) -> None:
        self.offset = 0

    def advance(self, n: int) -> None:
        """The layer ran on `n` more positions."""
        self.offset += n

    @property
    def state(self) -> list[mx.array]:
        return []

    @property
    def trimmable(self) -> int:
        return self.offset

    def rewind_point(self, position: int) -> int:
        return max(0, min(position, self.offset))

    def trim(self, n: int) -> int:
        if n <= 0 or n > self.offset:
            return 0
        self.offset -= n
        return n

    def expect_rewind(self, n: int) -> None:
        """Nothing to keep: any position is one to return to."""

    def snapshot(self) -> None:
        """Nothing to remember."""

    def export(self) -> tuple[dict, dict[str, mx.array]]:
        return {"kind": "stateless", "offset": self.offset}, {}

    def restore(self, facts: dict, arrays: dict[str, mx.array]) -> None:
        """Become the cache `export` described (ValueError: another kind of layer's)."""
        if facts.get("kind") != "stateless" or arrays:
            raise ValueError(f"a {facts.get('kind')!r} layer where this model has a stateless one")
        self.offset = int(facts["offset"])
