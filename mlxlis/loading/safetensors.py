"""Safetensors folders (Hugging Face layout): validated headers, lazy arrays.

The header of every file is parsed and checked here (length, JSON, dtypes, shapes, offsets
inside the file and not overlapping) before MLX sees it; `mx.load` then gives lazy arrays that
are only read from disk when the model materialises them.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import mlx.core as mx

from ..errors import FileFormatError, UnsupportedError
from . import limits

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
SUPPORTED_DTYPES = ("F32", "F16", "BF16", "U32", "I32", "U8")
MAX_DIMS = 8  # safetensors tensors of rank > 8 do not occur in decoders


def read_header(path: Path) -> dict[str, dict]:
    """Parse and validate one safetensors header; returns {name: {dtype, shape, data_offsets}}."""
    try:
        size = path.stat().st_size
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
        raise FileFormatError(f"cannot read ({e.strerror})", path=path) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FileFormatError(
            f"header is not valid JSON ({e})", path=path, field="header"
        ) from None
    if not isinstance(header, dict):
        raise FileFormatError("header is not a JSON object", path=path, field="header")
    header.pop("__metadata__", None)
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
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            files = sorted(set(data["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise FileFormatError(
                "invalid index (needs a weight_map object)", path=index, field="weight_map"
            ) from None
        paths = []
        for name in files:
            p = (folder / name).resolve()
            if not isinstance(name, str) or p.parent != folder.resolve() or not p.is_file():
                raise FileFormatError(f"shard {name!r} is missing", path=index, field="weight_map")
            paths.append(p)
        return paths
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    raise FileFormatError("no model.safetensors or model.safetensors.index.json", path=folder)


def load_tensors(folder: Path) -> dict[str, mx.array]:
    """Every tensor of the folder as a lazy MLX array, after validating each header."""
    tensors: dict[str, mx.array] = {}
    owner: dict[str, Path] = {}
    for path in weight_files(folder):
        header = read_header(path)
        arrays = mx.load(str(path))
        for name in header:
            if name in tensors:
                raise FileFormatError(
                    f"tensor also present in {owner[name].name}", path=path, field=name
                )
            tensors[name] = arrays[name]
            owner[name] = path
    return tensors
