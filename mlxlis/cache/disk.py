"""The prefix cache's second tier: finished requests' caches as files, read back when a later
prompt — in this process or after a restart — shares more of their start than anything in
memory does.

One safetensors file per entry, named by a hash of the model's fingerprint and the token ids.
Its header (metadata) says what it is: `mlxlis` "prefix-2", the `fingerprint` of the model that
made it, its `kv_format` (JSON: null for dense, else bits, group size and tail), the LoRA
`adapter` tag it was made under ("" or absent: the base's; prefix.py), the `ids` (JSON),
each layer's facts (`layers`: kind, offset, window, snapshots; cache/kv.py and recurrent.py
`export`) and `mac`, an HMAC-SHA256 under the folder's own key of all of those and of every
tensor's name, dtype, shape and bytes (sealed.py). A prompt reads back only an entry in its own
KV format and adapter; entries of the model's other formats and adapters stay.
An entry is written under a temporary name and renamed into place (never half-written); the
folder is kept under `max_bytes`, least recently used first (a file's mtime is its use).

The folder's files are untrusted input (sealed.py): the folder named is opened once (a symbolic
link there is the operator's choice, followed then) and every entry by name within it, never
through a link. What is not a regular file of this user — a link, a FIFO, a hard link — is
ignored with one line to `warn`, never read nor deleted. An entry that does not parse, does not
fit its file, is not sealed by this folder's key, or that another model wrote is skipped with
one line and deleted; a write that fails (a full disk) is one line and no entry. Either way the
prompt is prefilled cold. A folder that cannot be written (read-only, not this user's) is read
only — entries read back, nothing written, touched or deleted — said in one line, at start or
at the first write that fails so; one with no usable key is not used at all (one line).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from mlxlis.cache.base import Cache
from mlxlis.cache.rewind import common_prefix
from mlxlis.cache.sealed import CREATE, NotOurs, folder_key, open_regular, read_header, seal
from mlxlis.cache.store import KVFormat, format_of

import mlx.core as mx

TAG = "prefix-2"  # "prefix-1" entries (a plain hash, no seal) are refused, and deleted
SUFFIX = ".safetensors"
# a write that failed for want of room: one line for it, and later writes still tried
NO_ROOM = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


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


def adapter_tag(meta: dict[str, str]) -> str:
    """The adapter tag an entry was made under ("" absent: written before adapters were)."""
    tag = meta.get("adapter", "")
    if not isinstance(tag, str):
        raise ValueError("its adapter is not text")
    return tag


def reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e)


class DiskCache:
    """Entries in `folder`, at most `max_bytes`, of the model `fingerprint`; `make(kv)` gives
    fresh caches in KV format `kv` to restore an entry into; `warn` hears of every bad file
    and of a folder it cannot write (once)."""

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
        # each entry's ids, KV format and adapter tag
        self._index: dict[Path, tuple[tuple[int, ...], KVFormat | None, str]] = {}
        self._used: dict[Path, int] = {}  # a file's last use (its mtime, in ns), kept here too
        self._clock = 0  # the latest use given: uses stay ordered within one tick of the clock
        self.writable = False
        self.key: bytes | None = None  # None: the cache is off (no folder, or no key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._dir = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            self.warn(f"prefix cache: cannot use {self.folder} ({reason(e)}): not used")
            return
        weakref.finalize(self, os.close, self._dir)
        try:
            self.key, made = folder_key(self._dir)
        except (OSError, ValueError) as e:
            self.warn(f"prefix cache: {self.folder} has no usable key ({reason(e)}): not used")
            return
        self.writable = True
        if not made:  # (a key just made proves the folder writable)
            self._probe()
        for entry in sorted(os.scandir(self._dir), key=lambda e: e.name):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                self._scan(entry.name)

    def _probe(self) -> None:
        """Read-only unless the folder can be written: a file made and removed there (root
        writes whatever a folder's mode says, not on a read-only mount: so try, not ask)."""
        name = f".probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.close(os.open(name, CREATE, 0o600, dir_fd=self._dir))
            os.unlink(name, dir_fd=self._dir)
        except OSError as e:
            self._read_only(e)

    def _read_only(self, e: OSError) -> None:
        """The folder cannot be written: said once; from now on nothing is written, touched
        or deleted there, and its entries are still read."""
        if self.writable:
            self.writable = False
            self.warn(
                f"prefix cache: {self.folder} cannot be written ({reason(e)}): read-only from "
                "now on (its entries read back, nothing written, touched or deleted)"
            )

    def _lost(self, name: str, e: OSError) -> None:
        """An OSError changing the file `name`: gone already (another process evicted it) is
        forgotten; anything else makes the folder read-only."""
        if e.errno == errno.ENOENT:
            self._forget(name)
        else:
            self._read_only(e)

    def _forget(self, name: str) -> None:
        self._index.pop(self.folder / name, None)
        self._used.pop(self.folder / name, None)

    def _scan(self, name: str) -> None:
        try:
            fd, st = open_regular(self._dir, name, self.max_bytes)
            try:
                meta = read_header(fd, st.st_size)["__metadata__"]
            finally:
                os.close(fd)
            self._check(meta)
            ids = tuple(int(i) for i in json.loads(meta["ids"]))
            kv = format_from_json(meta["kv_format"])
            tag = adapter_tag(meta)
        except NotOurs as e:
            self.warn(f"prefix cache: ignored {name}: {e}")
            return
        except (OSError, ValueError, KeyError, TypeError) as e:  # MlxlisError is a ValueError
            self._drop(name, e)
            return
        self._index[self.folder / name] = (ids, kv, tag)
        self._used[self.folder / name] = st.st_mtime_ns
        self._clock = max(self._clock, st.st_mtime_ns)

    def _touch(self, name: str, fd: int | None = None) -> None:
        """`name` (open as `fd`) used now: its mtime (what a restart orders by) and the order
        kept here (alone, in a folder that cannot be written)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        self._used[self.folder / name] = self._clock
        if not self.writable:
            return
        try:
            if fd is not None:
                os.utime(fd, ns=(self._clock, self._clock))
            else:
                os.utime(name, ns=(self._clock,) * 2, dir_fd=self._dir, follow_symlinks=False)
        except OSError as e:
            self._lost(name, e)

    def _check(self, meta: dict[str, str]) -> None:
        """ValueError unless the metadata is that of one of this model's entries."""
        if meta.get("mlxlis") != TAG:
            raise ValueError("not a prefix cache entry of this version")
        if meta.get("fingerprint") != self.fingerprint:
            raise ValueError(f"made by another model ({meta.get('fingerprint')})")

    def _drop(self, name: str, why: object) -> None:
        """A bad entry: forgotten, deleted (the name only: a link put there since is removed,
        never what it points to) and said; in a read-only folder only forgotten and said."""
        self._forget(name)
        if self.writable:
            try:
                os.unlink(name, dir_fd=self._dir)
            except OSError as e:
                self._lost(name, e)
        done = "skipped and deleted" if self.writable else "skipped"
        self.warn(f"prefix cache: {done} {name}: {why}")

    def best(self, ids: list[int], kv: KVFormat | None, tag: str = "") -> tuple[Path | None, int]:
        """The entry in KV format `kv` made under adapter `tag` sharing the longest prefix
        with `ids`, and how long."""
        best, n, size = None, 0, 0
        for path, (held, fmt, made) in self._index.items():
            if fmt != kv or made != tag:
                continue
            k = common_prefix(held, ids)  # of equals, the one holding least past it (prefix.py)
            if k > n or (k and k == n and len(held) < size):
                best, n, size = path, k, len(held)
        return best, n

    def load(
        self, path: Path, kv: KVFormat | None, tag: str = ""
    ) -> tuple[list[Cache], tuple[int, ...]] | None:
        """The caches `path` holds (in KV format `kv`, under adapter `tag`) and their ids, or
        None (a bad file:
        warned and deleted; not our file: warned and left)."""
        name = path.name
        try:
            fd, st = open_regular(self._dir, name, self.max_bytes)
        except NotOurs as e:  # a link or the like put there since the folder was read
            self._forget(name)
            self.warn(f"prefix cache: ignored {name}: {e}")
            return None
        except FileNotFoundError:  # evicted by another process sharing the folder
            self._forget(name)
            return None
        except (OSError, ValueError) as e:
            self._drop(name, e)
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                read_header(fd, st.st_size)  # its bounds, before MLX parses it
                arrays, meta = mx.load(f, format="safetensors", return_metadata=True)
                mx.eval(list(arrays.values()))  # read now, from this descriptor
                caches, ids = self._restore(meta, arrays, kv, tag)
                self._touch(name, f.fileno())
        except Exception as e:  # noqa: BLE001 — whatever is wrong with it, it is not loaded
            self._drop(name, e)
            return None
        return caches, ids

    def _restore(
        self, meta: dict[str, str], arrays: dict[str, mx.array], kv: KVFormat | None, tag: str
    ) -> tuple[list[Cache], tuple[int, ...]]:
        """The caches in KV format `kv` an entry's metadata and tensors make, and their ids
        (ValueError and the like: not a sound entry of this model and folder)."""
        self._check(meta)  # again: the file may have changed since the folder was read
        if not hmac.compare_digest(meta.get("mac", ""), seal(self.key, meta, arrays)):
            raise ValueError("its seal does not match (altered, or not written here)")
        if (fmt := format_from_json(meta["kv_format"])) != kv:
            raise ValueError(f"its KV format changed to {fmt or 'dense'}")
        if adapter_tag(meta) != tag:
            raise ValueError("its adapter changed")
        ids = tuple(int(i) for i in json.loads(meta["ids"]))
        layers = json.loads(meta["layers"])
        caches = self.make(kv)
        if len(layers) != len(caches):
            raise ValueError(f"{len(layers)} layers, not {len(caches)}")
        for i, (c, facts) in enumerate(zip(caches, layers, strict=True)):
            own = {k.split(".", 1)[1]: a for k, a in arrays.items() if k.startswith(f"L{i}.")}
            c.restore(facts, own)
        return caches, ids

    def write(self, ids: list[int], caches: list[Cache], tag: str = "") -> None:
        """Keep `caches` (holding `ids`, made under adapter `tag`) as a file; a failure is one
        warning, no entry."""
        if self.key is None or not self.writable:
            return
        kv = format_of(caches)
        key = f"{self.fingerprint}|{format_json(kv)}|{tag}|{ids}"
        name = hashlib.sha256(key.encode()).hexdigest()[:32] + SUFFIX
        if self.folder / name in self._index:
            self._touch(name)
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
            "adapter": tag,
            "ids": json.dumps(list(ids)),
            "layers": json.dumps(layers),
        }
        meta["mac"] = seal(self.key, meta, arrays)
        tmp = f".{os.getpid()}-{name}.part"  # hidden, and not *.safetensors: never scanned
        try:
            fd = os.open(tmp, CREATE, 0o600, dir_fd=self._dir)
            with os.fdopen(fd, "wb") as f:
                mx.save_safetensors(f, arrays, metadata=meta)
            os.replace(tmp, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except (OSError, RuntimeError) as e:  # MLX may report a failed write as a RuntimeError
            try:
                os.unlink(tmp, dir_fd=self._dir)
            except OSError:
                pass  # never made, or the folder's trouble is said below
            if isinstance(e, OSError) and e.errno not in NO_ROOM:
                self._read_only(e)
            else:
                self.warn(f"prefix cache: could not write {name}: {reason(e)}")
            return
        self._index[self.folder / name] = (tuple(ids), kv, tag)
        self._touch(name)
        self._evict()

    def _evict(self) -> None:
        """Least recently used first, until the folder is within its bound."""
        sizes = {}
        for p in list(self._index):
            try:
                sizes[p] = os.stat(p.name, dir_fd=self._dir, follow_symlinks=False).st_size
            except OSError:
                self._forget(p.name)  # gone: another process evicted it
        total = sum(sizes.values())
        for p in sorted(sizes, key=lambda p: self._used.get(p, 0)):
            if total <= self.max_bytes or not self.writable:
                break
            total -= sizes[p]
            self._forget(p.name)
            try:
                os.unlink(p.name, dir_fd=self._dir)
            except OSError as e:
                self._lost(p.name, e)
