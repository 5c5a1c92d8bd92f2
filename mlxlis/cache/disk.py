"""The prefix cache's second tier: finished requests' caches as files, read back when a later
prompt — in this process or after a restart — shares more of their start than anything in
memory does.

One safetensors file per entry, named by a hash of the model's fingerprint and the token ids.
Its header (metadata) says what it is: `mlxlis` "prefix-1", the `fingerprint` of the model that
made it, its `kv_format` (JSON: null for dense, else bits, group size and tail), the `ids` (JSON),
each layer's facts (`layers`: kind, offset, window, snapshots; cache/kv.py and recurrent.py
`export`) and `sha256`, a hash of every tensor's bytes. A prompt reads back only an entry in
its own KV format; entries of the model's other formats stay.
An entry is written under a temporary name and renamed into place (never half-written); the
folder is kept under `max_bytes`, least recently used first (a file's mtime is its use).

Nothing doubtful is loaded: a file that does not parse, whose hash or layers do not match, or
that another model wrote is skipped with one line to `warn` and deleted; a write
that fails (a full disk) is one line and no entry. Either way the prompt is prefilled cold.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from mlxlis.cache.base import Cache
from mlxlis.cache.rewind import common_prefix
from mlxlis.cache.store import KVFormat, format_of

import mlx.core as mx

TAG = "prefix-1"
SUFFIX = ".safetensors"
HEADER_MAX = 64 << 20  # a header longer than this is not one of ours


def content_hash(arrays: dict[str, mx.array]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{a.shape}".encode())
        h.update(memoryview(mx.contiguous(a).view(mx.uint8)))  # its bytes, whatever the dtype
    return h.hexdigest()


def read_header(path: Path) -> dict[str, str]:
    """A safetensors file's metadata, from its header alone (ValueError: not safetensors)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > HEADER_MAX:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(f.read(n))
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return meta


def format_json(kv: KVFormat | None) -> str:
    if kv is None:
        return "null"
    return json.dumps({"bits": kv.bits, "group_size": kv.group_size, "tail": kv.tail})


def format_from_json(text: str) -> KVFormat | None:
    """What format_json wrote (ValueError, KeyError, TypeError: not that)."""
    got = json.loads(text)
    if got is None:
        return None
    return KVFormat(int(got["bits"]), int(got["group_size"]), bool(got["tail"]))


class DiskCache:
    """Entries in `folder`, at most `max_bytes`, of the model `fingerprint`; `make(kv)` gives
    fresh caches in KV format `kv` to restore an entry into; `warn` hears of every bad file."""

    def __init__(
        self,
        folder: str | Path,
        max_bytes: int,
        fingerprint: str,
        make: Callable[[KVFormat | None], list[Cache]],
        warn: Callable[[str], None],
    ):
        self.folder, self.max_bytes, self.fingerprint = Path(folder), max_bytes, fingerprint
        self.make, self.warn = make, warn
        self.folder.mkdir(parents=True, exist_ok=True)
        self._index: dict[Path, tuple[tuple[int, ...], KVFormat | None]] = {}
        self._used: dict[Path, int] = {}  # a file's last use (its mtime, in ns), kept here too
        self._clock = 0  # the latest use given: uses stay ordered within one tick of the clock
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            self._scan(path)

    def _scan(self, path: Path) -> None:
        try:
            meta = read_header(path)
            self._check(meta)
            ids = tuple(int(i) for i in json.loads(meta["ids"]))
            kv = format_from_json(meta["kv_format"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # MlxlisError is a ValueError
            self._drop(path, e)
            return
        self._index[path] = (ids, kv)
        self._used[path] = path.stat().st_mtime_ns
        self._clock = max(self._clock, self._used[path])

    def _touch(self, path: Path) -> None:
        """`path` used now: its mtime (what a restart orders by) and the order kept here."""
        self._clock = max(time.time_ns(), self._clock + 1)
        self._used[path] = self._clock
        os.utime(path, ns=(self._clock, self._clock))

    def _check(self, meta: dict[str, str]) -> None:
        """ValueError unless the metadata is that of one of this model's entries."""
        if meta.get("mlxlis") != TAG:
            raise ValueError("not a prefix cache entry")
        if meta.get("fingerprint") != self.fingerprint:
            raise ValueError(f"made by another model ({meta.get('fingerprint')})")

    def _drop(self, path: Path, why: object) -> None:
        self.warn(f"prefix cache: skipped and deleted {path.name}: {why}")
        self._index.pop(path, None)
        self._used.pop(path, None)
        path.unlink(missing_ok=True)

    def best(self, ids: list[int], kv: KVFormat | None) -> tuple[Path | None, int]:
        """The entry in KV format `kv` sharing the longest prefix with `ids`, and how long."""
        best, n, size = None, 0, 0
        for path, (held, fmt) in self._index.items():
            if fmt != kv:
                continue
            k = common_prefix(held, ids)  # of equals, the one holding least past it (prefix.py)
            if k > n or (k and k == n and len(held) < size):
                best, n, size = path, k, len(held)
        return best, n

    def load(self, path: Path, kv: KVFormat | None) -> tuple[list[Cache], tuple[int, ...]] | None:
        """The caches `path` holds (in KV format `kv`) and their ids, or None (a bad file:
        warned and deleted)."""
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            self._check(meta)  # again: the file may have changed since the folder was read
            if meta.get("sha256") != content_hash(arrays):
                raise ValueError("its contents do not match its hash")
            if (fmt := format_from_json(meta["kv_format"])) != kv:
                raise ValueError(f"its KV format changed to {fmt or 'dense'}")
            ids = tuple(int(i) for i in json.loads(meta["ids"]))
            layers = json.loads(meta["layers"])
            caches = self.make(kv)
            if len(layers) != len(caches):
                raise ValueError(f"{len(layers)} layers, not {len(caches)}")
            for i, (c, facts) in enumerate(zip(caches, layers, strict=True)):
                own = {k.split(".", 1)[1]: a for k, a in arrays.items() if k.startswith(f"L{i}.")}
                c.restore(facts, own)
        except Exception as e:  # noqa: BLE001 — whatever is wrong with it, it is not loaded
            self._drop(path, e)
            return None
        self._touch(path)
        return caches, ids

    def write(self, ids: list[int], caches: list[Cache]) -> None:
        """Keep `caches` (holding `ids`) as a file; a failure is one warning, no entry."""
        kv = format_of(caches)
        key = f"{self.fingerprint}|{format_json(kv)}|{ids}"
        name = hashlib.sha256(key.encode()).hexdigest()[:32] + SUFFIX
        path = self.folder / name
        if path in self._index:
            self._touch(path)
            return
        arrays, layers = {}, []
        for i, c in enumerate(caches):
            facts, own = c.export()
            layers.append(facts)
            arrays |= {f"L{i}.{k}": a for k, a in own.items()}
        mx.eval(list(arrays.values()))
        meta = {
            "mlxlis": TAG,
            "fingerprint": self.fingerprint,
            "kv_format": format_json(kv),
            "ids": json.dumps(list(ids)),
            "layers": json.dumps(layers),
            "sha256": content_hash(arrays),
        }
        tmp = self.folder / ".writing" / f"{os.getpid()}-{name}"  # MLX keeps the suffix
        try:
            tmp.parent.mkdir(exist_ok=True)
            mx.save_safetensors(str(tmp), arrays, metadata=meta)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:  # MLX reports a failed write as a RuntimeError
            tmp.unlink(missing_ok=True)
            self.warn(f"prefix cache: could not write {name}: {getattr(e, 'strerror', None) or e}")
            return
        self._index[path] = (tuple(ids), kv)
        self._touch(path)
        self._evict()

    def _evict(self) -> None:
        """Least recently used first, until the folder is within its bound."""
        sizes = {p: p.stat().st_size for p in self._index if p.exists()}
        total = sum(sizes.values())
        for p in sorted(sizes, key=lambda p: self._used.get(p, 0)):
            if total <= self.max_bytes:
                break
            total -= sizes[p]
            self._index.pop(p, None)
            self._used.pop(p, None)
            p.unlink(missing_ok=True)
