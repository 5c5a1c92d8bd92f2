"""Going back in a model's caches: how far every layer can return exactly, trimming them
there, and the snapshots recurrent layers and sliding-window rings keep where later prompts
will return.

Reusing a common prefix (the prefix cache) asks each cache how far back it can go exactly
(`Cache.rewind_point`): a KV cache to any position it holds, a rotating one while the
positions it needs have not rotated out or else to a snapshot, a recurrent state only to a
snapshot. Snapshots are taken where the generation core is asked to (`Request.snapshot_at`: a
chat's end before its generation prompt, which the next turn shares) or else at the end of
each prompt."""

from __future__ import annotations

from collections.abc import Sequence

from mlxlis.cache.base import Cache


def common_prefix(a, b) -> int:
    """How many leading ids two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reachable(caches: Sequence[Cache], position: int) -> int:
    """The latest position ≤ `position` every one of `caches` can be trimmed back to exactly
    (any for a KV cache, a snapshot for a recurrent state)."""
    target = position
    while (back := min(c.rewind_point(target) for c in caches)) != target:
        target = back
    return target


def rewind(caches: Sequence[Cache], held: int, position: int) -> int:
    """Trim a model's caches, which hold `held` tokens, back to the latest position ≤
    `position` every layer can return to exactly (`reachable`); returns that position, or 0
    when none above 0 could be reached."""
    target = reachable(caches, position)
    drop = held - target
    if target <= 0 or not all(c.trim(drop) == drop for c in caches):
        return 0
    return target


def snapshot(caches: Sequence[Cache]) -> None:
    """At a position a later prompt will share: recurrent states cannot be trimmed and rings
    lose what rotates out, so each keeps a snapshot there (KV caches need none)."""
    for c in caches:
        c.snapshot()


def short_of(caches: Sequence[Cache], position: int) -> list[str]:
    """The kinds of layer that cannot return to `position` exactly (why a rewind stops short)."""
    return sorted({c.label for c in caches if c.rewind_point(position) < position})


def trimmable(caches: Sequence[Cache]) -> int:
    """How many newest positions every cache of a model can forget exactly (`trim` limit)."""
    return min((c.trimmable for c in caches), default=0)
