"""A GGUF v2/v3 reader over an mmap: metadata, tensor table, zero-copy tensor bytes.

Layout (little-endian): magic "GGUF", u32 version, u64 tensor_count, u64 kv_count, the
key/value pairs, the tensor infos (name, u32 n_dims, u64 dims[n_dims] innermost first,
u32 ggml type, u64 offset relative to the data section), padding to `general.alignment`
(default 32), then the data section.

Everything read from the file is checked against `limits` and against the bytes left in the
file before use; every failure is an `MlxlisError` naming the file and the field or tensor.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis import limits
from mlxlis.errors import (
    FileFormatError,
    MissingTensorError,
    MlxlisError,
    ModelNotFoundError,
    UnsupportedFormatError,
    UnsupportedQuantError,
)

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, elements per block, bytes per block); matches ggml.h / gguf-py.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}

# GGUF metadata value types.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(8, 13)
_SCALARS: dict[int, str] = {  # value type -> struct code (also a fixed-size numpy code)
    T_UINT8: "B",
    T_INT8: "b",
    T_UINT16: "H",
    T_INT16: "h",
    T_UINT32: "I",
    T_INT32: "i",
    T_FLOAT32: "f",
    T_UINT64: "Q",
    T_INT64: "q",
    T_FLOAT64: "d",
}
_STRUCTS = {t: struct.Struct("<" + c) for t, c in _SCALARS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int  # GGMLQuantizationType value
    type_name: str  # "Q4_K", "F32", ...; "UNKNOWN_<id>" for a type id this reader does not know
    shape: tuple[int, ...]  # numpy / row-major order, i.e. GGUF dims reversed (rows, cols)
    offset: int  # absolute byte offset in the file
    nbytes: int  # 0 when the type is unknown (its size cannot be computed)


class _Parser:
    """A bounds-checked cursor over the header bytes."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, msg: str, field: str) -> FileFormatError:
        return FileFormatError(msg, path=self.path, field=field)

    def need(self, n: int, field: str) -> int:
        """Reserve n bytes at the cursor; returns their start."""
        start = self.pos
        if n > self.size - start:
            raise self.fail(
                f"truncated: needs {n} bytes at offset {start}, file has {self.size}", field
            )
        self.pos = start + n
        return start

    def u32(self, field: str) -> int:
        return _U32.unpack_from(self.buf, self.need(4, field))[0]

    def u64(self, field: str) -> int:
        return _U64.unpack_from(self.buf, self.need(8, field))[0]

    def string(self, field: str, limit: int = limits.GGUF_MAX_STRING_BYTES) -> str:
        n = self.u64(field)
        if n > limit:
            raise self.fail(f"string length {n} exceeds the limit {limit}", field)
        start = self.need(n, field)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"invalid UTF-8 at byte {start + e.start}", field) from None

    def value(self, vtype: int, field: str, depth: int = 0) -> Any:
        if vtype in _STRUCTS:
            st = _STRUCTS[vtype]
            return st.unpack_from(self.buf, self.need(st.size, field))[0]
        if vtype == T_BOOL:
            b = self.buf[self.need(1, field)]
            if b > 1:
                raise self.fail(f"bool value {b} is neither 0 nor 1", field)
            return bool(b)
        if vtype == T_STRING:
            return self.string(field)
        if vtype == T_ARRAY:
            return self.array(field, depth + 1)
        raise self.fail(f"unknown value type {vtype}", field)

    def array(self, field: str, depth: int) -> Any:
        if depth > limits.GGUF_MAX_ARRAY_DEPTH:
            raise self.fail(f"arrays nested deeper than {limits.GGUF_MAX_ARRAY_DEPTH}", field)
        itype = self.u32(field)
        count = self.u64(field)
        if count > limits.GGUF_MAX_ARRAY_LEN:
            raise self.fail(f"array length {count} exceeds the limit", field)
        if itype in _SCALARS or itype == T_BOOL:
            code = np.dtype("<" + _SCALARS.get(itype, "B"))
            start = self.need(count * code.itemsize, field)
            arr = np.frombuffer(self.buf, code, count, start).copy()  # copy: don't pin the mmap
            if itype == T_BOOL:
                if count and arr.max() > 1:
                    raise self.fail("bool array holds a value other than 0 or 1", field)
                arr = arr.view(np.bool_)
            return arr.astype(arr.dtype.newbyteorder("="), copy=False)
        if itype == T_STRING:
            return self.string_array(count, field)
        if itype == T_ARRAY:
            return [self.array(f"{field}[{i}]", depth + 1) for i in range(count)]
        raise self.fail(f"unknown array element type {itype}", field)

    def string_array(self, count: int, field: str) -> list[str]:
        # Tight loop over the mmap: this is what makes a 262k-token vocabulary fast to open.
        buf, pos, size = self.buf, self.pos, self.size
        if count * 8 > size - pos:
            raise self.fail(f"truncated: {count} strings cannot fit in the file", field)
        unpack, limit = _U64.unpack_from, limits.GGUF_MAX_STRING_BYTES
        out: list[str] = []
        append = out.append
        i = 0
        try:
            for i in range(count):
                if pos + 8 > size:
                    raise self.fail(f"truncated at element {i} (offset {pos})", field)
                n = unpack(buf, pos)[0]
                pos += 8
                if n > limit or pos + n > size:
                    raise self.fail(f"element {i}: length {n} at offset {pos} overruns", field)
                append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError:
            raise self.fail(f"element {i} is not valid UTF-8 (offset {pos})", field) from None
        self.pos = pos
        return out


class GGUFFile:
    """An open GGUF file: `metadata`, `tensors` (file order) and zero-copy `raw` bytes."""

    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]  # int/float/bool/str; string arrays -> list[str]; numeric -> ndarray
    metadata_types: dict[str, int]  # key -> GGUF value type id (9 = array)
    tensors: dict[str, GGUFTensor]
    data_offset: int  # absolute start of the data section

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self._mm = _open_mmap(self.path)
        try:
            self._parse(self._mm)
        except BaseException:
            self.close()
            raise

    def _parse(self, buf: mmap.mmap) -> None:
        p = _Parser(buf, len(buf), self.path)
        magic = buf[p.need(4, "magic") : 4]
        if magic != GGUF_MAGIC:
            raise p.fail(f"bad magic {magic!r}, expected b'GGUF' (not a GGUF file)", "magic")
        self.version = p.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                msg = f"big-endian GGUF (v{swapped}) is not supported"
            else:
                msg = f"GGUF version {self.version} is not supported (only 2 and 3)"
            raise UnsupportedFormatError(msg, path=self.path, field="version")
        n_tensors = p.u64("tensor_count")
        n_kv = p.u64("kv_count")
        if n_tensors > limits.GGUF_MAX_TENSORS:
            raise p.fail(f"{n_tensors} tensors exceeds the limit", "tensor_count")
        if n_kv > limits.GGUF_MAX_KV:
            raise p.fail(f"{n_kv} key/value pairs exceeds the limit", "kv_count")
        self.metadata, self.metadata_types = {}, {}
        for i in range(n_kv):
            key = p.string(f"kv[{i}].key", limits.GGUF_MAX_KEY_BYTES)
            if key in self.metadata:
                raise p.fail("duplicate metadata key", key)
            vtype = p.u32(key)
            self.metadata[key] = p.value(vtype, key)
            self.metadata_types[key] = vtype
        self.alignment = self._read_alignment(p)
        infos = [_read_tensor_info(p, i) for i in range(n_tensors)]
        self.data_offset = -(-p.pos // self.alignment) * self.alignment
        self.tensors = {}
        for name, dims, type_id, rel in infos:
            if name in self.tensors:
                raise p.fail("duplicate tensor name", name)
            self.tensors[name] = self._make_tensor(p, name, dims, type_id, rel)
        _check_overlaps(self.tensors.values(), self.path)

    def _read_alignment(self, p: _Parser) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        a = self.metadata["general.alignment"]
        if self.metadata_types["general.alignment"] != T_UINT32:
            raise p.fail("must be a uint32", "general.alignment")
        if a == 0 or a & (a - 1) or a > limits.GGUF_MAX_ALIGNMENT:
            raise p.fail(
                f"{a} is not a power of two ≤ {limits.GGUF_MAX_ALIGNMENT}", "general.alignment"
            )
        return a

    def _make_tensor(
        self, p: _Parser, name: str, dims: tuple[int, ...], type_id: int, rel: int
    ) -> GGUFTensor:
        if rel % self.alignment:
            raise p.fail(
                f"data offset {rel} is not a multiple of the alignment {self.alignment}", name
            )
        offset = self.data_offset + rel
        shape = tuple(reversed(dims))
        if type_id not in GGML_TYPES:  # recorded; convert_tensor raises UnsupportedQuantError
            if offset > p.size:
                raise p.fail(f"data offset {offset} is past the end of the file", name)
            return GGUFTensor(name, type_id, f"UNKNOWN_{type_id}", shape, offset, 0)
        type_name, block, type_size = GGML_TYPES[type_id]
        if dims[0] % block:
            raise p.fail(
                f"row length {dims[0]} is not a multiple of the {type_name} block size {block}",
                name,
            )
        nbytes = math.prod(dims) // block * type_size
        if offset + nbytes > p.size:
            raise p.fail(
                f"tensor data [{offset}, {offset + nbytes}) runs past the end of the "
                f"file ({p.size} bytes)",
                name,
            )
        return GGUFTensor(name, type_id, type_name, shape, offset, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mmap (no copy)."""
        if self._mm is None:
            raise ValueError(f"{self.path}: GGUF file is closed")
        t = self.tensors.get(name)
        if t is None:
            raise MissingTensorError("no such tensor in the file", path=self.path, field=name)
        if t.type_name.startswith("UNKNOWN_"):
            raise UnsupportedQuantError(
                f"unknown ggml type id {t.ggml_type}", path=self.path, field=name
            )
        return np.frombuffer(self._mm, np.uint8, t.nbytes, t.offset)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop the tensor's file pages (or those wholly inside its bytes [start, stop)) from
        this process's resident set once they are converted: MADV_DONTNEED on a read-only file
        mapping, so the OS page cache keeps them and a later read maps them again. Keeps the
        load's peak RSS near the converted weights."""
        t = self.tensors.get(name)
        if self._mm is None or t is None or not t.nbytes:
            return
        page = mmap.PAGESIZE
        if stop is None:  # the whole tensor, with the pages it shares with its neighbours
            lo, hi = t.offset + start - (t.offset + start) % page, t.offset + t.nbytes
        else:
            lo = -(-(t.offset + start) // page) * page
            hi = (t.offset + min(stop, t.nbytes)) // page * page
        if hi <= lo:
            return
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (AttributeError, OSError, ValueError):  # no madvise here: only memory is at stake
            pass

    def close(self) -> None:
        """Release the mapping; arrays from `raw` that are still alive keep it mapped."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views from raw() still exist; the OS unmaps when they go
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"


def peek_metadata(path: str | Path, keys: Iterable[str]) -> dict[str, Any]:
    """The values of `keys` in a GGUF file's metadata, reading only as far as the last of them
    (a listing needs `general.architecture`, not the vocabulary behind it)."""
    wanted, found = set(keys), {}
    path = Path(path)
    mm = _open_mmap(path)
    try:
        p = _Parser(mm, len(mm), path)
        if mm[p.need(4, "magic") : 4] != GGUF_MAGIC:
            raise p.fail("bad magic (not a GGUF file)", "magic")
        if p.u32("version") not in SUPPORTED_VERSIONS:
            raise UnsupportedFormatError("unsupported GGUF version", path=path, field="version")
        p.u64("tensor_count")
        n_kv = p.u64("kv_count")
        for i in range(min(n_kv, limits.GGUF_MAX_KV)):
            if not wanted - found.keys():
                break
            key = p.string(f"kv[{i}].key", limits.GGUF_MAX_KEY_BYTES)
            value = p.value(p.u32(key), key)
            if key in wanted:
                found[key] = value
    finally:
        mm.close()
    return found


def _open_mmap(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:  # magic + version + two u64 counts
                raise FileFormatError(
                    f"truncated: {size} bytes is too small for a GGUF header",
                    path=path,
                    field="header",
                )
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ModelNotFoundError("no such file", path=path) from None
    except IsADirectoryError:
        raise FileFormatError("is a directory, not a GGUF file", path=path) from None
    except OSError as e:
        raise MlxlisError(f"cannot open: {e.strerror or e}", path=path) from None


def _read_tensor_info(p: _Parser, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = p.string(f"tensor[{i}].name", limits.GGUF_MAX_TENSOR_NAME_BYTES)
    n_dims = p.u32(name)
    if not 1 <= n_dims <= limits.GGUF_MAX_DIMS:
        raise p.fail(f"n_dims {n_dims} is outside 1..{limits.GGUF_MAX_DIMS}", name)
    dims = struct.unpack_from(f"<{n_dims}Q", p.buf, p.need(8 * n_dims, name))
    if any(not 1 <= d <= limits.GGUF_MAX_DIM for d in dims):
        raise p.fail(f"dims {list(dims)} outside 1..{limits.GGUF_MAX_DIM}", name)
    if math.prod(dims) > limits.GGUF_MAX_ELEMENTS:
        raise p.fail(f"dims {list(dims)} exceed {limits.GGUF_MAX_ELEMENTS} elements", name)
    type_id = p.u32(name)
    rel = p.u64(name)
    return name, dims, type_id, rel


def _check_overlaps(tensors: Iterable[GGUFTensor], path: Path) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise FileFormatError(f"data overlaps tensor {a!r}", path=path, field=b)
