"""What every per-layer cache is to the code above it (the prefix cache, rewinds, the
generation core): a Protocol, so a new kind (a quantized KV cache, say) is one class."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class Cache(Protocol):
    """One layer's cache of one sequence."""

    offset: int  # positions fed so far
    shift: int  # how far RoPE positions run ahead of `offset` (Qwen3.5's images; else 0)
    label: str  # its kind, in words (why a rewind stopped: "recurrent", "sliding window")

    @property
    def state(self) -> list[mx.array]:
        """The arrays it holds, its snapshots' included (to evaluate, or to count bytes)."""
        ...

    @property
    def trimmable(self) -> int:
        """How many of the newest positions `trim` can forget and stay exact."""
        ...

    def rewind_point(self, position: int) -> int:
        """The latest position ≤ `position` it can be trimmed back to exactly (0: none)."""
        ...

    def trim(self, n: int) -> int:
        """Forget the newest `n` positions; returns `n`, or 0 leaving it untouched."""
        ...

    def expect_rewind(self, n: int) -> None:
        """The next update (a speculative verification) may be trimmed back by up to `n` of
        its positions: keep what that needs (a ring its spilled positions, a recurrent state
        the state after each of them)."""
        ...

    def snapshot(self) -> None:
        """Remember the current position as one to return to (recurrent states and rings whose
        positions rotate out need it; its memory counts in `state`)."""
        ...
