"""What every per-layer cache is to the code above it (the prefix cache, rewinds, the
generation core): a Protocol, so a new kind (a quantized KV cache, say) is one class."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

if TYPE_CHECKING:
    from mlxlis.cache.store import Store


class Cache(Protocol):
    """One layer's cache of one sequence."""

    offset: int  # positions fed so far
    shift: int  # how far RoPE positions run ahead of `offset` (Qwen3.5's images; else 0)
    label: str  # its kind, in words (why a rewind stopped: "recurrent", "sliding window")

    @property
    def store(self) -> Store | None:
        """How its keys/values are kept (dense or quantized: its KV format, `store.fmt`); None
        for a cache that holds none."""
        ...

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


class BatchedKV(Cache, Protocol):
    """A KV cache a KVBatch stacks with others while their sequences decode together (kv.py's:
    the batch holds its buffers meanwhile, batch.py): what the batch reads of it."""

    step: int  # positions a block of its buffers holds
    tailed: bool  # in a quantized format, it keeps its newest block's positions dense too
    tail_start: int  # the first position of that dense tail (0: not tailed)

    @property
    def held(self) -> int:
        """Valid slots in its buffers (the first `held`)."""
        ...

    @property
    def tail(self) -> tuple[mx.array, mx.array] | None:
        """The dense tail's keys and values, (B, n_kv_heads, offset - tail_start, head_dim)
        each; None when it holds none."""
        ...

    def claim_one(self) -> tuple[int, int]:
        """Bookkeeping of a one-token write the batch does: (the slot it goes to, valid slots
        after it)."""
        ...

    def visible(self, slot: int, width: int) -> mx.array | None:
        """After a one-token write into `slot`: which of the first `width` slots the new query
        sees, (width,) bool, or None for every valid one."""
        ...
