"""The state of a linear-attention (Gated DeltaNet) layer, which cannot forget tokens: it
returns to a position only through a snapshot taken there."""

from __future__ import annotations

import mlx.core as mx


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
