"""Split GGUF files (llama.cpp's `gguf-split` layout) read as one model.

The parts are written here from a real tiny GGUF as tools/gguf-split/gguf-split.cpp writes them
(`split_strategy`): part i is named PREFIX-0000{i+1}-of-0000N.gguf (`llama_split_path`); the
first part carries every metadata key of the original, then `split.no` (u16), `split.count`
(u16) and `split.tensors.count` (i32); the other parts carry those three keys only; tensors go
in file order, `--split-max-tensors` per part, each part with its own tensor offsets and data
section; `--no-tensor-first-split` leaves the first part with metadata only. The bytes are
assembled by hand (struct), read back by gguf-py, independently of mlxlis' reader.
"""

from __future__ import annotations

import struct
from pathlib import Path

import mlxlis
from mlxlis.errors import FileFormatError, ModelNotFoundError
from mlxlis.loading.gguf_split import read_gguf

import gguf
import numpy as np
import pytest
from conftest import trajectory
from test_conventions import write_llama_gguf

ALIGN = 32
U16, I32 = 2, 5  # GGUF value types


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def kv(key: str, vtype: int, value: int) -> bytes:
    code = {U16: "<H", I32: "<i"}[vtype]
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + struct.pack(code, value)


def read_parts(path: Path) -> tuple[list[bytes], list[tuple[str, list[int], int, bytes]]]:
    """(each metadata pair's raw bytes, (name, dims in GGUF order, type, data) per tensor)."""
    reader = gguf.GGUFReader(path)
    raw = path.read_bytes()
    kvs = []
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # gguf-py's names for the header counts, not metadata
        size = sum(p.nbytes for p in f.parts)
        kvs.append(raw[f.offset : f.offset + size])
    tensors = [
        (t.name, [int(d) for d in t.shape], int(t.tensor_type), raw[t.data_offset :][: t.n_bytes])
        for t in reader.tensors
    ]
    return kvs, tensors


def write_gguf(path: Path, kvs: list[bytes], tensors: list) -> None:
    """A GGUF v3 file: header, metadata pairs, tensor infos, padding, aligned data."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    for b in kvs:
        out += b
    offset, datas = 0, []
    for name, dims, ttype, data in tensors:
        n = name.encode()
        out += struct.pack("<Q", len(n)) + n + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        out += struct.pack("<IQ", ttype, offset)
        datas.append(data + b"\0" * (_pad(len(data)) - len(data)))
        offset += _pad(len(data))
    out += b"\0" * (_pad(len(out)) - len(out))
    path.write_bytes(bytes(out) + b"".join(datas))


def requantize(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> None:
    """`src` with each F32 matrix whose rows fit `qtype`'s blocks quantized by gguf-py (the
    others kept F32, as llama.cpp's quantizer falls back on such tensors)."""
    kvs, tensors = read_parts(src)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    out = []
    for name, dims, ttype, data in tensors:
        if ttype == gguf.GGMLQuantizationType.F32 and len(dims) == 2 and dims[0] % block == 0:
            arr = np.frombuffer(data, np.float32).reshape(dims[::-1])  # (rows, cols)
            data, ttype = gguf.quants.quantize(arr, qtype).tobytes(), int(qtype)
        out.append((name, dims, ttype, data))
    write_gguf(dst, kvs, out)


def split_gguf(src: Path, prefix: Path, per_part: int, no_tensor_first: bool = False) -> list[Path]:
    """gguf-split --split-max-tensors `per_part` [--no-tensor-first-split] of `src`."""
    kvs, tensors = read_parts(src)
    groups = [tensors[i : i + per_part] for i in range(0, len(tensors), per_part)]
    if no_tensor_first:
        groups.insert(0, [])
    paths = []
    for i, group in enumerate(groups):
        split = [
            kv("split.no", U16, i),
            kv("split.count", U16, len(groups)),
            kv("split.tensors.count", I32, len(tensors)),
        ]
        path = prefix.with_name(f"{prefix.name}-{i + 1:05d}-of-{len(groups):05d}.gguf")
        write_gguf(path, (kvs if i == 0 else []) + split, group)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def q8_gguf(tiny, tmp_path_factory) -> Path:
    """The tiny llama as a GGUF with Q8_0 matrices (and F32 where rows do not fit)."""
    folder, ref = tiny("llama")
    tmp = tmp_path_factory.mktemp("split")
    write_llama_gguf(tmp / "f32.gguf", ref, folder)
    requantize(tmp / "f32.gguf", tmp / "tiny-Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    return tmp / "tiny-Q8_0.gguf"


@pytest.mark.parametrize("no_tensor_first", [False, True])
def test_split_gguf_gives_the_unsplit_files_logits_exactly(q8_gguf, tmp_path, no_tensor_first):
    """A model split in 3 (or 4 with a metadata-only first part) by gguf-split's layout loads
    as one model from its first part and from any other part, and gives exactly the unsplit
    file's float32 logits (quantized and dense blocks alike); gguf-py reads each part."""
    parts = split_gguf(
        q8_gguf, tmp_path / "tiny-Q8_0", per_part=12, no_tensor_first=no_tensor_first
    )
    assert len(parts) == (4 if no_tensor_first else 3)
    for p in parts:
        r = gguf.GGUFReader(p)
        assert int(r.fields["split.count"].parts[-1][0]) == len(parts)
    assert sum(len(gguf.GGUFReader(p).tensors) for p in parts) == len(
        gguf.GGUFReader(q8_gguf).tensors
    )
    whole = mlxlis.load(q8_gguf, "float32")
    assert "Q8_0" in whole.quant_summary and "F32" in whole.quant_summary
    ids = trajectory(40, vocab=whole.config.vocab_size)
    expected = np.array(whole.logits(ids))
    for opened in (parts[0], parts[-1]):
        split = mlxlis.load(opened, "float32")
        assert np.array_equal(np.array(split.logits(ids)), expected)
        assert split.quant_summary == whole.quant_summary  # the same tensors, the same types
    with read_gguf(parts[1]) as gf:
        assert gf.path == parts[0] and len(gf.parts) == len(parts)


def test_split_gguf_errors_name_the_part(q8_gguf, tmp_path):
    """A missing part, a part numbered wrongly and a tensor count that disagrees each fail with
    an MlxlisError naming the file and field; nothing is loaded from an incomplete split."""
    parts = split_gguf(q8_gguf, tmp_path / "m", per_part=12)
    parts[2].rename(tmp_path / "aside.gguf")
    with pytest.raises(ModelNotFoundError, match="m-00003-of-00003.gguf.*part 3 of 3"):
        mlxlis.load(parts[0], "float32")
    (tmp_path / "aside.gguf").rename(parts[2])

    kvs, tensors = read_parts(parts[1])  # part 2 that says it is part 3
    write_gguf(parts[1], [kv("split.no", U16, 2)] + kvs[1:], tensors)
    with pytest.raises(FileFormatError, match="m-00002-of-00003.gguf: split.no"):
        read_gguf(parts[0])

    parts = split_gguf(q8_gguf, tmp_path / "n", per_part=12)
    kvs, tensors = read_parts(parts[2])
    write_gguf(parts[2], kvs, tensors[:-1])  # a tensor lost
    with pytest.raises(FileFormatError, match="split.tensors.count"):
        read_gguf(parts[0])


def test_a_part_renamed_off_the_pattern_is_an_error(q8_gguf, tmp_path):
    """A part whose name lost llama.cpp's -0000i-of-0000N suffix cannot lead to its siblings:
    a FileFormatError saying so, not a model missing tensors."""
    parts = split_gguf(q8_gguf, tmp_path / "p", per_part=12)
    renamed = parts[0].rename(tmp_path / "p.gguf")
    with pytest.raises(FileFormatError, match="p.gguf: split.count: .*PREFIX-00001-of-00003"):
        read_gguf(renamed)
