"""The disk cache's files as untrusted input (disk.py): whatever is in the folder may have been
put there or changed by someone else, so nothing in it is believed until it is proved ours.

- The folder's key: 32 random bytes in `.prefix-key`, created once (O_EXCL, mode 0600) and
  used only if it is a regular file of this user that nobody else may read or write.
- An entry's seal: HMAC-SHA256 under that key of everything the entry says — its header's facts
  (model fingerprint, KV format, ids, layers) and every tensor's name, dtype, shape and bytes.
  Without the key no one can make an entry, or change one, that passes.
- Opening: by name relative to the folder's descriptor, never following a symbolic link
  (O_NOFOLLOW), without waiting on a FIFO (O_NONBLOCK); the descriptor is then checked (a
  regular file, one link, this user's, writable by no one else, within the folder's bound)
  before a byte is read, and everything after — the header's bounds, MLX's parse, the
  seal — reads that descriptor, never the name again.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import math
import os
import secrets
import stat
import struct
import time

import mlx.core as mx

KEY_NAME = ".prefix-key"  # not *.safetensors: never taken for an entry
KEY_BYTES = 32
HEADER_MAX = 64 << 20  # a header longer than this is not one of ours
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# the safetensors dtypes and their bytes per element (what MLX writes and reads)
ITEM = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4}
ITEM |= {"I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}


class NotOurs(ValueError):
    """Not a file this cache wrote (a link, a FIFO, a folder, another user's file): ignored,
    neither read nor deleted."""


def seal(key: bytes, meta: dict[str, str], arrays: dict[str, mx.array]) -> str:
    """The HMAC-SHA256 of an entry: its metadata (but the seal itself) and its tensors."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    facts = {k: v for k, v in meta.items() if k != "mac"}
    h.update(json.dumps(facts, sort_keys=True).encode() + b"\0")  # NUL: never inside JSON
    for name in sorted(arrays):
        a = arrays[name]
        # each tensor's description, then exactly the bytes its dtype and shape call for
        h.update(json.dumps([name, str(a.dtype), list(a.shape)]).encode() + b"\0")
        h.update(memoryview(mx.contiguous(a).view(mx.uint8)))  # its bytes, whatever the dtype
    return h.hexdigest()


def open_regular(dir_fd: int, name: str, max_bytes: int) -> tuple[int, os.stat_result]:
    """A descriptor of the entry `name` and its stat: NotOurs unless it is one of our files,
    ValueError when it is larger than the folder may hold (OSError: could not open it)."""
    try:
        fd = os.open(name, READ, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # what O_NOFOLLOW gives for a symbolic link
            raise NotOurs("a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        why = not_ours(st, 0o022)
        if why:
            raise NotOurs(why)
        if st.st_size > max_bytes:
            raise ValueError(f"{st.st_size} bytes: more than the folder holds")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def not_ours(st: os.stat_result, others: int) -> str:
    """Why a file of stat `st` is not one this cache wrote ('' when it may be): the
    permission bits `others` must be clear (no one else may write it, or also read it)."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink != 1:  # a hard link to some file elsewhere: ours are renamed, never linked
        return f"{st.st_nlink} links to one file"
    if st.st_uid != os.geteuid():
        return f"owned by another user ({st.st_uid})"
    if st.st_mode & others:
        return f"mode {stat.S_IMODE(st.st_mode):o}"
    return ""


def read_header(fd: int, size: int) -> dict:
    """The safetensors header of the open file `fd` of `size` bytes, checked before anything
    parses its tensors: in bounds, metadata of strings, and each tensor a known dtype whose
    shape's bytes are exactly its span within the file (ValueError: not that)."""
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > min(HEADER_MAX, size - 8):
        raise ValueError("its header's length is out of bounds")
    text = os.pread(fd, n, 8)
    try:
        header = json.loads(text)
    except RecursionError:  # nested deeper than any header: not ours
        raise ValueError("its header is nested too deep") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not an object")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("no metadata of strings")
    data = size - 8 - n
    for name, t in header.items():
        if name != "__metadata__" and not fits(t, data):
            raise ValueError(f"tensor {name!r} does not fit its span of the file")
    return header


def fits(t: object, data: int) -> bool:
    """Whether a header's tensor entry `t` is a known dtype, a shape and a span of the `data`
    bytes after the header holding exactly that shape's bytes."""
    if not isinstance(t, dict) or t.get("dtype") not in ITEM:
        return False
    shape, span = t.get("shape"), t.get("data_offsets")
    if not naturals(shape) or not naturals(span) or len(span) != 2:
        return False
    start, end = span
    return start <= end <= data and end - start == math.prod(shape) * ITEM[t["dtype"]]


def naturals(xs: object) -> bool:
    """Whether `xs` is a list of non-negative ints (JSON's true and 1.5 are not)."""
    return isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)


def folder_key(dir_fd: int) -> tuple[bytes, bool]:
    """The folder's key and whether it was made now; OSError when there is none to be had
    (none, and the folder cannot be written), ValueError when the file there is not one.

    The key lives in the folder it guards, beside its entries: it must be there wherever the
    folder is (after a restart, on a volume mounted read-only, in a container with no home
    folder), and it is what keeps out anyone who may write into the folder but not read this
    user's 0600 files (another user of a shared or group-writable folder, entries copied in
    from another folder). A key elsewhere would not stop this user's own processes either: they
    can read it wherever it is; a folder shared with processes not trusted as this user is not
    protected (give each server a folder of its own)."""
    for _ in range(50):  # another server making it at the same moment: wait for its bytes
        try:
            fd = os.open(KEY_NAME, READ, dir_fd=dir_fd)
        except FileNotFoundError:
            try:
                return make_key(dir_fd), True
            except FileExistsError:
                continue  # made by another process since: read it
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"{KEY_NAME} is a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            if why := not_ours(st, 0o077):
                raise ValueError(f"{KEY_NAME} is not this cache's key: {why}")
            key = os.pread(fd, KEY_BYTES + 1, 0)
        finally:
            os.close(fd)
        if len(key) == KEY_BYTES:
            return key, False
        if len(key) > KEY_BYTES or time.time() - st.st_mtime > 5:  # no one is writing it
            raise ValueError(f"{KEY_NAME} is not this cache's key: {len(key)} bytes")
        time.sleep(0.02)
    raise ValueError(f"{KEY_NAME} stayed unfinished")


def make_key(dir_fd: int) -> bytes:
    """A new key in the folder: created once (O_EXCL; FileExistsError if another process won),
    readable by this user alone."""
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(KEY_NAME, CREATE, 0o600, dir_fd=dir_fd)
    try:
        if os.write(fd, key) != KEY_BYTES:
            raise OSError(errno.EIO, "the key was written short")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(KEY_NAME, dir_fd=dir_fd)
        raise
    os.close(fd)
    return key
