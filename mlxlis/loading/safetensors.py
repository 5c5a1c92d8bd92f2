"""Safetensors folders (Hugging Face layout): validated headers, lazy arrays.

The header of every file is parsed and checked here (length, JSON, dtypes, shapes, offsets
inside the file and not overlapping) before MLX sees it; `mx.load` then gives lazy arrays that
are only read from disk when the model materialises them.
"""

from __future__ import annotations

import math
import stat
import struct
from pathlib import Path

from mlxlis import limits
from mlxlis.bounded import loads_json, read_json_file
from mlxlis.errors import FileFormatError, UnsupportedError

import mlx.core as mx

DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
SUPPORTED_DTYPES = ("F32", "F16", "BF16", "U32", "I32", "I64", "U8")  # I64: index buffers
ST_DTYPES = {  # the MLX dtype a supported one is read as
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "I64": mx.int64,
    "U8": mx.uint8,
}
MAX_DIMS = limits.SAFETENSORS_MAX_DIMS  # tensors of rank > 8 do not occur in decoders


def read_header(path: Path) -> dict[str, dict]:
    """Parse and validate one safetensors header; returns {name: {dtype, shape, data_offsets}}."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise FileFormatError("not a regular file", path=path)
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FileFormatError("file shorter than the 8-byte header length", path=path)
            (n,) = struct.unpack("<Q", head)
            if n > limits.SAFETENSORS_MAX_HEADER or n > size - 8:
                raise FileFormatError(
                    f"header length {n} exceeds the file ({size} bytes) or the "
                    f"{limits.SAFETENSORS_MAX_HEADER}-byte limit",
                    path=path,
                    field="header",
                )
            raw = f.read(n)
    except OSError as e:
        raise FileFormatError(f"cannot read ({e.strerror or e})", path=path) from None
    if len(raw) < n:
        raise FileFormatError("file shrank while its header was read", path=path, field="header")
    # duplicate names and NaN are refused: MLX's own parser must see the header we checked
    header = loads_json(
        raw,
        path=path,
        error=FileFormatError,
        field="header",
        max_depth=limits.JSON_MAX_DEPTH,
        unique_keys=True,
        strict_numbers=True,
    )
    if not isinstance(header, dict):
        raise FileFormatError("header is not a JSON object", path=path, field="header")
    meta = header.pop("__metadata__", None)
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
    ):
        raise FileFormatError(
            "__metadata__ must map strings to strings", path=path, field="__metadata__"
        )
    if len(header) > limits.SAFETENSORS_MAX_TENSORS:
        raise FileFormatError(
            f"{len(header)} tensors exceeds the limit of {limits.SAFETENSORS_MAX_TENSORS}",
            path=path,
            field="header",
        )
    data_size = size - 8 - n
    spans = []
    for name, entry in header.items():
        _check_entry(path, name, entry, data_size)
        spans.append((*entry["data_offsets"], name))
    spans.sort()
    for (_s0, e0, a), (s1, _e1, b) in zip(spans, spans[1:], strict=False):
        if s1 < e0:
            raise FileFormatError(
                f"data of {b!r} overlaps {a!r} (offsets {s1} < {e0})", path=path, field=b
            )
    return header


def _check_entry(path: Path, name: str, entry: object, data_size: int) -> None:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise FileFormatError("entry lacks dtype/shape/data_offsets", path=path, field=name)
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise FileFormatError(f"dtype {dtype!r} is not a string", path=path, field=name)
    if dtype not in DTYPE_SIZES:
        raise UnsupportedError(f"unknown dtype {dtype!r}", path=path, field=name)
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedError(
            f"dtype {dtype} is not supported (supported: {', '.join(SUPPORTED_DTYPES)})",
            path=path,
            field=name,
        )
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= limits.GGUF_MAX_DIM
            for d in shape
        )
    ):
        raise FileFormatError(f"bad shape {shape!r}", path=path, field=name)
    if math.prod(shape) > limits.SAFETENSORS_MAX_ELEMENTS:
        raise FileFormatError(
            f"shape {shape} exceeds {limits.SAFETENSORS_MAX_ELEMENTS} elements",
            path=path,
            field=name,
        )
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
    ):
        raise FileFormatError(f"bad data_offsets {offs!r}", path=path, field=name)
    begin, end = offs
    if not 0 <= begin <= end <= data_size:
        raise FileFormatError(
            f"data_offsets {offs} lie outside the {data_size}-byte data section",
            path=path,
            field=name,
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise FileFormatError(
            f"{end - begin} bytes for shape {shape} {dtype} (expected {expected})",
            path=path,
            field=name,
        )


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards listed by model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json_file(
            index, limits.INDEX_JSON_MAX_BYTES, FileFormatError, what="safetensors index"
        )
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise FileFormatError(
                "invalid index (needs a weight_map object of file names)",
                path=index,
                field="weight_map",
            )
        files = sorted(set(wmap.values()))
        if len(files) > limits.SAFETENSORS_MAX_FILES:
            raise FileFormatError(
                f"{len(files)} shards exceeds the limit of {limits.SAFETENSORS_MAX_FILES}",
                path=index,
                field="weight_map",
            )
        paths = []
        root = folder.resolve()
        for name in files:
            if "\0" in name or not name.endswith(".safetensors"):
                raise FileFormatError(
                    f"shard {name!r} is not a .safetensors file", path=index, field="weight_map"
                )
            p = folder / name  # not resolved: the Hugging Face cache links shards to blobs
            if p.parent.resolve() != root or not p.is_file():
                raise FileFormatError(f"shard {name!r} is missing", path=index, field="weight_map")
            paths.append(p)
        return paths
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if len(others) > limits.SAFETENSORS_MAX_FILES:
        raise FileFormatError(
            f"{len(others)} .safetensors files exceeds the limit of {limits.SAFETENSORS_MAX_FILES}",
            path=folder,
        )
    if others:
        return others
    raise FileFormatError("no model.safetensors or model.safetensors.index.json", path=folder)


def load_tensors(folder: Path) -> dict[str, mx.array]:
    """Every tensor of the folder as a lazy MLX array, after validating each header."""
    tensors: dict[str, mx.array] = {}
    owner: dict[str, Path] = {}
    for path in weight_files(folder):
        header = read_header(path)
        try:
            arrays = mx.load(str(path))
        except (RuntimeError, ValueError, OSError) as e:
            raise FileFormatError(f"cannot load: {e}", path=path) from None
        for name in header:
            if name in tensors:
                raise FileFormatError(
                    f"tensor also present in {owner[name].name}", path=path, field=name
                )
            if name not in arrays:  # MLX read the header differently from this validator
                raise FileFormatError("tensor missing from MLX's reading", path=path, field=name)
            tensors[name] = arrays[name]
            owner[name] = path
    return tensors


def module_sizes(folder: Path, rename) -> dict[str, int]:
    """Module tensor name -> bytes in the files, from the validated headers only (no tensor
    read); `rename(checkpoint name)` gives the module name, None for a tensor the family
    drops."""
    sizes: dict[str, int] = {}
    for path in weight_files(folder):
        for key, entry in read_header(path).items():
            name = rename(key)
            if name is not None:
                begin, end = entry["data_offsets"]
                sizes[name] = end - begin
    return sizes
