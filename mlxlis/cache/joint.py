"""One layer's caches kept as one: a layer that holds more than one kind of state (Qwen4-Exp: a
DeltaNet's state beside its n-gram embeddings' context; attention's keys beside its token
indexer's keys) has one cache to the code above it, whose parts advance together and return
together, to a position every part can reach exactly."""

from __future__ import annotations

from mlxlis.cache.base import Cache

import mlx.core as mx


class JointCache:
    """Parts that are fed the same positions (`offset` is the first's); a trim, a snapshot, a
    rewind or a file's copy applies to each, and a rewind only to a position all can reach."""

    def __init__(self, *parts: Cache) -> None:
        self.parts = parts

    @property
    def offset(self) -> int:
        return self.parts[0].offset

    @property
    def shift(self) -> int:
        return self.parts[0].shift

    @shift.setter
    def shift(self, value: int) -> None:
        for p in self.parts:
            p.shift = value

    @property
    def store(self):
        """The KV store of its first part that has one (the KV format the caches are in), or
        None (store.format_of reads it)."""
        return next((p.store for p in self.parts if p.store is not None), None)

    @property
    def label(self) -> str:
        return " + ".join(dict.fromkeys(p.label for p in self.parts))

    @property
    def state(self) -> list[mx.array]:
        return [a for p in self.parts for a in p.state]

    @property
    def trimmable(self) -> int:
        return min(p.trimmable for p in self.parts)

    def rewind_point(self, position: int) -> int:
        target = position
        while (back := min(p.rewind_point(target) for p in self.parts)) != target:
            target = back
        return target

    def trim(self, n: int) -> int:
        """Forget the newest `n` positions in every part, or in none (returns 0)."""
        if n <= 0 or self.rewind_point(self.offset - n) != self.offset - n:
            return 0
        if not all(p.trim(n) == n for p in self.parts):  # a part broke its rewind_point
            raise RuntimeError(f"a {self.label} cache could not return {n} positions")
        return n

    def expect_rewind(self, n: int) -> None:
        for p in self.parts:
            p.expect_rewind(n)

    def snapshot(self) -> None:
        for p in self.parts:
            p.snapshot()

    def export(self) -> tuple[dict, dict[str, mx.array]]:
        """(facts, arrays) a file can hold: each part's, its arrays under `P{i}.`."""
        facts, arrays = [], {}
        for i, p in enumerate(self.parts):
            f, a = p.export()
            facts.append(f)
            arrays |= {f"P{i}.{k}": v for k, v in a.items()}
        return {"kind": "joint", "parts": facts}, arrays

    def restore(self, facts: dict, arrays: dict[str, mx.array]) -> None:
        """Become the cache `export` described (this one fresh; ValueError: another kind)."""
        parts = facts.get("parts") if facts.get("kind") == "joint" else None
        if not isinstance(parts, list) or len(parts) != len(self.parts):
            raise ValueError(f"a {facts.get('kind')!r} layer where this model has a joint one")
        for i, (p, f) in enumerate(zip(self.parts, parts, strict=True)):
            own = {k[len(f"P{i}.") :]: v for k, v in arrays.items() if k.startswith(f"P{i}.")}
            p.restore(f, own)
