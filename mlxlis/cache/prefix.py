"""The prefix cache: the caches of finished requests, kept by the token ids they hold.

A new prompt takes over the entry sharing its longest prefix, rewound to that prefix
(`mlxlis.cache.rewind`: KV caches to any position, recurrent states and rotated rings to a
snapshot), and prefills only the rest; `note` says how much the latest `take` reused and why
it stopped there. Only an entry in the prompt's KV format, made under the prompt's LoRA
adapter and scale (its `tag`), is taken (a server's requests may each ask for their own).
LRU, at most `max_bytes` (snapshots counted) and `max_entries` (a ChatSession keeps one: its
conversation).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable

from mlxlis.cache.base import Cache
from mlxlis.cache.disk import DiskCache
from mlxlis.cache.rewind import common_prefix, reachable, rewind, short_of
from mlxlis.cache.store import KVFormat, format_of

# (entry key, its caches, the ids they hold, the position wanted) -> the position reached
Rewind = Callable[[int, list[Cache], int, int], int]
# (the ids its caches hold, the caches, their bytes, their KV format, the adapter tag they
# were made under: "" the base's, else Model.lane's)
Entry = tuple[tuple[int, ...], list[Cache], int, KVFormat | None, str]
# keys unique in the process: a pipeline's other ranks keep every prefix cache's entries by key
_KEYS = itertools.count()


def rewind_here(key: int, caches: list[Cache], held: int, position: int) -> int:
    return rewind(caches, held, position)


class PrefixCache:
    """Caches of finished requests by the token ids they hold; LRU, at most `max_bytes`.
    `on_drop(key)` hears of each entry evicted to make room (a pipeline's other ranks drop
    their share of it too)."""

    def __init__(
        self,
        max_bytes: int,
        on_drop: Callable[[int], None] | None = None,
        max_entries: int | None = None,
        disk: DiskCache | None = None,
        write_through: bool = True,
    ):
        """`disk`: a second tier, on disk (disk.py): a prompt sharing more with a file than with
        any entry in memory reads it back; every entry put is also written there, or, without
        `write_through`, only when `save` is called."""
        self.max_bytes = max_bytes
        self.disk, self.write_through = disk, write_through
        self.max_entries = max_entries
        self.on_drop = on_drop
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self.bytes = 0  # held now: a plain int, so other threads (/health) read it safely
        self.note = ""  # what the latest `take` reused, and why no more (a request's log line)
        self._refused = ""  # why the latest caches offered were not kept

    def put(self, ids: list[int], caches: list[Cache], tag: str = "") -> int | None:
        """Keep `caches` (holding `ids`, made under adapter `tag`); their key, or None when
        they are not kept."""
        if ids and self.disk is not None and self.write_through:
            self.disk.write(ids, caches, tag)
        size = sum(a.nbytes for c in caches for a in c.state)
        if not ids or size > self.max_bytes:
            if ids:
                self._refused = f"the last caches offered ({size >> 20} MiB) were over its bound"
            return None
        key = next(_KEYS)
        self._entries[key] = (tuple(ids), caches, size, format_of(caches), tag)
        self.bytes += size
        while self.bytes > self.max_bytes or (
            self.max_entries is not None and len(self._entries) > self.max_entries
        ):
            old, (_, _, old_size, _, _) = self._entries.popitem(last=False)
            self.bytes -= old_size
            if self.on_drop is not None:
                self.on_drop(old)
        return key

    def take(
        self, ids: list[int], kv: KVFormat | None, rewind_to: Rewind = rewind_here, tag: str = ""
    ) -> tuple[list[Cache] | None, int]:
        """The caches in KV format `kv`, made under adapter `tag`, sharing the longest prefix
        with `ids` (removed from the store), rewound by `rewind_to` to that prefix (at least
        one id left to feed); (None, 0) when none helps (an entry that shares ids but cannot
        return into them stays; one whose rewind fails is dropped)."""
        best, best_n, best_reach = None, 0, -1
        for key, (held, caches, _, fmt, made) in self._entries.items():
            if fmt != kv or made != tag or not (n := common_prefix(held, ids)):
                continue
            # the entry whose layers all return furthest into the prompt (a ring or a recurrent
            # state only to its end or a snapshot), then the one sharing most
            reach = reachable(caches, min(n, len(ids) - 1))
            if (reach, n) > (best_reach, best_n):
                best, best_n, best_reach = key, n, reach
        path, on_disk = self.disk.best(ids, kv, tag) if self.disk is not None else (None, 0)
        if on_disk > best_n and (got := self.disk.load(path, kv, tag)) is not None:
            caches, held = got
            best, best_n, where = next(_KEYS), common_prefix(held, ids), " (read from disk)"
        elif best is None:
            self.note = self._nothing_shared()
            return None, 0
        elif best_reach == 0:  # shared, but no layer returns into it: kept for another prompt
            held, caches, _, _, _ = self._entries[best]
            position = min(best_n, len(ids) - 1)
            short = short_of(caches, position)
            self.note = reuse_note(best_n, len(ids), 0, position, 0, short)
            return None, 0
        else:
            held, caches, size, _, _ = self._entries.pop(best)
            self.bytes -= size
            where = ""
        position = min(best_n, len(ids) - 1)
        here, short = reachable(caches, position), short_of(caches, position)
        reused = rewind_to(best, caches, len(held), position)
        self.note = reuse_note(best_n, len(ids), reused, position, here, short) + where
        return (caches, reused) if reused else (None, 0)

    def save(self) -> int:
        """Write every entry in memory to the disk tier; how many (0 without one)."""
        if self.disk is None:
            return 0
        for held, caches, _, _, tag in self._entries.values():
            self.disk.write(list(held), caches, tag)
        return len(self._entries)

    def _nothing_shared(self) -> str:
        if self._entries:
            return f"no cached entry shares a prefix ({len(self._entries)} held)"
        why = f"; {self._refused}" if self._refused else ""
        return f"no cached entry shares a prefix (the prefix cache is empty{why})"

    def clear(self) -> None:
        """Drop every entry."""
        while self._entries:
            key, (_, _, size, _, _) = self._entries.popitem(last=False)
            self.bytes -= size
            if self.on_drop is not None:
                self.on_drop(key)


def reuse_note(shared: int, prompt: int, reused: int, position: int, here: int, short) -> str:
    """How much of a prompt of `prompt` ids an entry sharing `shared` gave (`reused`), and why
    no more: every layer went back to `position` (the last id is always fed again), or the
    `short` kinds of layer could only return to a snapshot; `here` is where this process's
    layers could go (a pipeline's other ranks may stop earlier)."""
    head = f"prefix {shared}/{prompt} shared with a cached entry; reused {reused}"
    kinds = " and ".join(short)
    if reused == shared:
        return head
    if reused == position:
        return f"{head} (the prompt's last token is fed again for its logits)"
    if reused < here:
        return f"{head} (another rank's layers return no further)"
    if reused == 0:
        return f"{head} ({kinds}: no snapshot at or before {position}; prefilled whole)"
    return f"{head} ({kinds} snapshot at {reused})"
