"""The state of a linear-attention (Gated DeltaNet) layer or of a gated short convolution
(its conv state alone), which cannot forget tokens: it returns to a position only through
a snapshot taken there."""

from __future__ import annotations

import mlx.core as mx


class RecurrentCache:
    """A linear-attention layer's state: the last kernel−1 inputs of its convolution and the
    (B, heads, k_dim, v_dim) recurrent state (None for a short convolution), after `offset`
    tokens. A recurrent state cannot
    forget tokens: to go back, it restores a snapshot taken at that position (the newest
    SNAPSHOTS are kept; each costs one copy of the state)."""

    SNAPSHOTS = 2
    label = "recurrent"
    shift = 0  # no positions (kv.py's `shift`)
    store = None  # no keys/values

    def __init__(self) -> None:
        self.conv_state: mx.array | None = None
        self.recurrent: mx.array | None = None
        self.offset = 0
        self._snapshots: list[tuple[int, mx.array | None, mx.array | None]] = []
        self.keep = 0  # the next update keeps the state after each of up to this many tokens
        # (offset, conv, state) after each token of the last update but its last (`keep`)
        self._steps: list[tuple[int, mx.array, mx.array]] = []

    def expect_rewind(self, n: int) -> None:
        """The next update (a speculative verification) may be trimmed back by up to `n` of
        its tokens: the layer keeps the state after each of them (`kept`)."""
        self.keep = n

    def kept(self, steps: list[tuple[int, mx.array, mx.array]]) -> None:
        """The layer's record of the update just made (`expect_rewind`): (offset, conv state,
        recurrent state) after each token but the last; an update made without it records
        []."""
        self._steps, self.keep = steps, 0

    def snapshot(self) -> None:
        """Remember the state at the current position (arrays are immutable: no copy of the
        recurrent state). The convolution's is copied out of the prompt chunk it is a view of:
        kept as it is, it would keep the chunk's whole (kernel − 1 + T, channels) input alive
        (the copy is evaluated with `state`)."""
        conv = None if self.conv_state is None else mx.contiguous(self.conv_state)
        self._snapshots = [s for s in self._snapshots if s[0] != self.offset]
        self._snapshots.append((self.offset, conv, self.recurrent))
        del self._snapshots[: -self.SNAPSHOTS]

    @property
    def trimmable(self) -> int:
        return 0

    def rewind_point(self, position: int) -> int:
        """The latest position ≤ `position` this cache can return to exactly."""
        if position >= self.offset:
            return self.offset
        kept = (p for p, _, _ in [*self._snapshots, *self._steps] if p <= position)
        return max(kept, default=0)

    def trim(self, n: int) -> int:
        """Go back `n` tokens if a snapshot sits exactly there; returns n, or 0 (untouched)."""
        if n <= 0:
            return 0
        target = self.offset - n
        for p, conv, state in [*self._steps, *self._snapshots]:
            if p == target:
                self.conv_state, self.recurrent, self.offset = conv, state, p
                self._snapshots = [s for s in self._snapshots if s[0] <= p]
                self._steps = []
                return n
        return 0

    def export(self) -> tuple[dict, dict[str, mx.array]]:
        """(facts, arrays) a file can hold: the live state and the snapshots'."""
        arrays: dict[str, mx.array] = {}
        held = [(self.offset, self.conv_state, self.recurrent), *self._snapshots]
        for i, (_, conv, state) in enumerate(held):
            if conv is not None:
                arrays[f"c{i}"] = conv
            if state is not None:
                arrays[f"r{i}"] = state
        return {"kind": "recurrent", "offsets": [h[0] for h in held]}, arrays

    def restore(self, facts: dict, arrays: dict[str, mx.array]) -> None:
        """Become the state `export` described (this one fresh; ValueError: not a recurrent
        layer's)."""
        if facts.get("kind") != "recurrent":
            raise ValueError(f"a {facts.get('kind')!r} layer where this model has a recurrent one")
        held = [
            (int(o), arrays.get(f"c{i}"), arrays.get(f"r{i}"))
            for i, o in enumerate(facts["offsets"])
        ]
        (self.offset, self.conv_state, self.recurrent), *self._snapshots = held

    @property
    def state(self) -> list[mx.array]:
        """The live state and the snapshots' (each array once: a snapshot shares the live
        recurrent state until the next token replaces it)."""
        kept = [*self._snapshots, *self._steps]
        held = [self.conv_state, self.recurrent, *(a for s in kept for a in s[1:])]
        return list({id(a): a for a in held if a is not None}.values())
