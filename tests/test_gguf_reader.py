"""mlxlis.loading.gguf: reference parity with gguf-py's GGUFReader on the real models, and a
specific, file-naming MlxlisError for every kind of malformed file.

Synthetic files are written by gguf-py's GGUFWriter (an independent writer), then truncated or
patched byte by byte at positions located in the written bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path

from mlxlis import limits
from mlxlis.errors import (
    FileFormatError,
    MlxlisError,
    ModelNotFoundError,
    UnsupportedFormatError,
    UnsupportedQuantError,
)
from mlxlis.loading import catalog
from mlxlis.loading.gguf import GGML_TYPES
from mlxlis.loading.gguf_split import read_gguf

import numpy as np
import pytest
from conftest import gguf_py_reader, memory_bound
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter

REAL = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]

METADATA = {  # key -> (value as written, expected value type id)
    "test.u8": (200, GGUFValueType.UINT8),
    "test.i16": (-300, GGUFValueType.INT16),
    "test.u32": (7, GGUFValueType.UINT32),
    "test.i64": (-(2**40), GGUFValueType.INT64),
    "test.u64": (2**63 + 5, GGUFValueType.UINT64),
    "test.f32": (0.25, GGUFValueType.FLOAT32),
    "test.f64": (1e-300, GGUFValueType.FLOAT64),
    "test.bool": (True, GGUFValueType.BOOL),
    "test.str": ("héllo ✓ 日本", GGUFValueType.STRING),
    "test.strs": (["a", "", "bé", "🙂"], GGUFValueType.ARRAY),
    "test.ints": ([1, -2, 3], GGUFValueType.ARRAY),
    "test.floats": ([0.5, -1.5], GGUFValueType.ARRAY),
    "test.flags": ([True, False, True], GGUFValueType.ARRAY),
    "dup.aa": ("first", GGUFValueType.STRING),
    "dup.bb": ("second", GGUFValueType.STRING),
}
Q8_BYTES = np.random.default_rng(0).integers(0, 256, (2, 2 * 34), dtype=np.uint8)  # 2 × 64


def write_gguf(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    """Metadata of every value type and three tensors (F32 2-D, Q8_0 2-D, F16 1-D)."""
    w = GGUFWriter(path, "llama", endianess=endianess)
    for key, (val, vtype) in METADATA.items():
        if vtype == GGUFValueType.ARRAY:
            w.add_array(key, val)
        else:
            w.add_key_value(key, val, vtype)
    w.add_tensor("t.aa", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.add_tensor("t.bb", Q8_BYTES, raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("t.cc", np.linspace(-1, 1, 5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "good.gguf")


def patch(path: Path, at: int, data: bytes) -> None:
    blob = bytearray(path.read_bytes())
    blob[at : at + len(data)] = data
    path.write_bytes(bytes(blob))


def info_pos(path: Path, name: str) -> dict[str, int]:
    """Byte positions of a tensor info's fields (found after the last metadata key)."""
    blob = path.read_bytes()
    at = blob.index(struct.pack("<Q", len(name)) + name.encode(), blob.index(b"dup.bb")) + 8
    at += len(name)
    n_dims = struct.unpack_from("<I", blob, at)[0]
    return {
        "name": at - len(name),
        "n_dims": at,
        "dims": at + 4,
        "type": at + 4 + 8 * n_dims,
        "offset": at + 8 + 8 * n_dims,
    }


def value_pos(path: Path, key: str) -> int:
    """Position of the u32 value type that follows a metadata key."""
    return path.read_bytes().index(key.encode()) + len(key)


def expect(path: Path, cls: type[MlxlisError], field: str | None = None) -> MlxlisError:
    with pytest.raises(cls) as info:
        read_gguf(path).close()
    assert str(path) in str(info.value)
    if field is not None:
        assert info.value.field == field, str(info.value)
    return info.value


# --- reference parity -----------------------------------------------------------------------


def test_type_table_matches_gguf_py():
    """Reference parity: our ggml type table (id, name, block, bytes) equals gguf-py's."""
    for qt, (block, size) in GGML_QUANT_SIZES.items():
        assert GGML_TYPES[int(qt)] == (qt.name, block, size)


def test_synthetic_file_reads_back_what_gguf_writer_wrote(good: Path):
    """Reference parity with gguf-py's writer: every value, type, shape and tensor byte."""
    with read_gguf(good) as f:
        assert f.version == 3 and f.alignment == 32
        assert f.metadata["general.architecture"] == "llama"
        for key, (val, vtype) in METADATA.items():
            assert f.metadata_types[key] == vtype, key
            got = f.metadata[key]
            if isinstance(got, np.ndarray):
                assert got.tolist() == val, key
            else:
                assert got == val and type(got) is type(val), key
        assert f.metadata["test.ints"].dtype == np.int32
        assert f.metadata["test.flags"].dtype == np.bool_
        assert list(f.tensors) == ["t.aa", "t.bb", "t.cc"]
        a, b, c = f.tensors.values()
        assert (a.type_name, a.shape, a.nbytes) == ("F32", (4, 8), 128)
        assert (b.type_name, b.shape, b.nbytes) == ("Q8_0", (2, 64), Q8_BYTES.size)
        assert (c.type_name, c.shape, c.nbytes) == ("F16", (5,), 10)
        assert all(t.offset % 32 == 0 for t in f.tensors.values())
        assert np.array_equal(f.raw("t.aa").view(np.float32), np.arange(32, dtype=np.float32))
        assert np.array_equal(f.raw("t.bb"), Q8_BYTES.reshape(-1))
        halves = np.linspace(-1, 1, 5, dtype=np.float16)
        assert np.array_equal(f.raw("t.cc").view(np.float16), halves)


@pytest.mark.real
@pytest.mark.parametrize(  # `make test-all`: gguf-py takes 8 to 15 s a real file; the reader
    "name",  # reads back what gguf-py wrote in a synthetic file in make test
    [pytest.param(n, marks=pytest.mark.extended) for n in REAL],
)
def test_real_model_matches_gguf_reader(name: str):
    """Reference parity with gguf-py's GGUFReader on a real model: every metadata key, type and
    value, every tensor's name/type/shape/offset/size and its bytes."""
    if not catalog.is_pulled(name):
        pytest.skip(f"{name} not pulled (make models)")
    path = catalog.model_path(name)
    ref = gguf_py_reader(name)  # gguf-py's GGUFReader, shared with test_chat_template
    with read_gguf(path) as f:
        fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
        assert list(f.metadata) == list(fields)
        for key, field in fields.items():
            assert f.metadata_types[key] == field.types[0], key
            got, want = f.metadata[key], field.contents()
            if isinstance(got, np.ndarray):
                assert got.dtype == field.parts[-1].dtype.newbyteorder("="), key
                assert np.array_equal(got, np.asarray(want, dtype=got.dtype)), key
            else:
                assert got == want and type(got) is type(want), key
        assert f.data_offset == ref.data_offset and f.alignment == ref.alignment
        assert [t.name for t in ref.tensors] == list(f.tensors)
        for rt in ref.tensors:
            t = f.tensors[rt.name]
            assert t.ggml_type == rt.tensor_type and t.type_name == rt.tensor_type.name
            assert t.shape == tuple(int(d) for d in reversed(rt.shape)), rt.name
            assert (t.offset, t.nbytes) == (rt.data_offset, rt.n_bytes), rt.name
            assert np.array_equal(f.raw(rt.name), rt.data.reshape(-1).view(np.uint8)), rt.name


@pytest.mark.real
@pytest.mark.extended  # `make test-all` (7 s): a memory bound, close to a benchmark
def test_opening_the_262k_vocabulary_is_lean():
    """A work bound for the 262 144-token vocabulary (the time is in `make bench`): reading
    Gemma 3's metadata allocates 24 MiB of Python objects here (the strings themselves);
    gguf-py's reader, which makes numpy views per field part, allocates 654 MiB."""
    if not catalog.is_pulled("gemma3-270m"):
        pytest.skip("gemma3-270m not pulled (make models)")
    path = catalog.model_path("gemma3-270m")
    with read_gguf(path):
        pass  # first use imports and sets up what the reader needs, outside the bound
    with memory_bound(64 << 20, "metadata"), read_gguf(path) as f:
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 262144


# --- malformed files ------------------------------------------------------------------------


def test_every_truncation_is_a_file_format_error(good: Path, tmp_path: Path):
    """Cutting the file at any byte before the end of the last tensor's data -> FileFormatError
    (never IndexError / struct.error / UnicodeDecodeError), message naming the file."""
    with read_gguf(good) as f:
        end = max(t.offset + t.nbytes for t in f.tensors.values())
    blob = good.read_bytes()
    cut_file = tmp_path / "cut.gguf"
    for cut in range(end):
        cut_file.write_bytes(blob[:cut])
        expect(cut_file, FileFormatError)


def test_random_header_corruption_never_escapes_the_hierarchy(good: Path, tmp_path: Path):
    """Fuzz: 400 files with 1–4 header bytes randomised either open or raise an MlxlisError."""
    rng = np.random.default_rng(0)
    blob = good.read_bytes()
    with read_gguf(good) as f:
        header_end = f.data_offset
    bad = tmp_path / "fuzz.gguf"
    for _ in range(400):
        data = bytearray(blob)
        for at in rng.integers(0, header_end, rng.integers(1, 5)):
            data[at] = rng.integers(0, 256)
        bad.write_bytes(bytes(data))
        try:
            read_gguf(bad).close()
        except MlxlisError as e:
            assert str(bad) in str(e)


def test_bad_magic(good: Path):
    patch(good, 0, b"GGML")
    assert "magic" in str(expect(good, FileFormatError, "magic"))


@pytest.mark.parametrize("version", [1, 4, 0xFFFF])
def test_unsupported_version(good: Path, version: int):
    patch(good, 4, struct.pack("<I", version))
    expect(good, UnsupportedFormatError, "version")


def test_big_endian_file_is_refused(tmp_path: Path):
    path = write_gguf(tmp_path / "be.gguf", GGUFEndian.BIG)
    assert "big-endian" in str(expect(path, UnsupportedFormatError, "version"))


@pytest.mark.parametrize(
    ("at", "field", "value"),
    [
        (8, "tensor_count", limits.GGUF_MAX_TENSORS + 1),
        (16, "kv_count", limits.GGUF_MAX_KV + 1),
        (8, "tensor_count", 1000),  # within the limit, but the file ends first
    ],
)
def test_counts_beyond_limits_or_file(good: Path, at: int, field: str, value: int):
    patch(good, at, struct.pack("<Q", value))
    expect(good, FileFormatError)


def test_huge_string_length(good: Path):
    at = good.read_bytes().index(b"test.str") + len("test.str") + 4
    patch(good, at, struct.pack("<Q", 2**62))
    assert "limit" in str(expect(good, FileFormatError, "test.str"))


def test_huge_array_length(good: Path):
    at = value_pos(good, "test.ints") + 8  # after the array's element type
    patch(good, at, struct.pack("<Q", limits.GGUF_MAX_ARRAY_LEN + 1))
    expect(good, FileFormatError, "test.ints")
    patch(good, at, struct.pack("<Q", 10**6))  # within the limit, past the end of the file
    expect(good, FileFormatError, "test.ints")


def test_string_array_element_overruns(good: Path):
    at = value_pos(good, "test.strs") + 4 + 4 + 8  # first element's length
    patch(good, at, struct.pack("<Q", 2**40))
    expect(good, FileFormatError, "test.strs")


@pytest.mark.parametrize("where", ["value", "element"])
def test_unknown_value_type(good: Path, where: str):
    at = value_pos(good, "test.ints") + (0 if where == "value" else 4)
    patch(good, at, struct.pack("<I", 77))
    assert "type 77" in str(expect(good, FileFormatError, "test.ints"))


@pytest.mark.parametrize("key", ["test.str", "test.strs"])
def test_invalid_utf8(good: Path, key: str):
    at = good.read_bytes().index("é".encode(), value_pos(good, key))
    patch(good, at, b"\xff")
    assert "UTF-8" in str(expect(good, FileFormatError, key))


def test_bool_that_is_not_0_or_1(good: Path):
    patch(good, value_pos(good, "test.bool") + 4, b"\x02")
    expect(good, FileFormatError, "test.bool")


def test_duplicate_key(good: Path):
    patch(good, good.read_bytes().index(b"dup.bb"), b"dup.aa")
    assert "duplicate" in str(expect(good, FileFormatError, "dup.aa"))


def test_duplicate_tensor_name(good: Path):
    patch(good, info_pos(good, "t.bb")["name"], b"t.aa")
    assert "duplicate" in str(expect(good, FileFormatError, "t.aa"))


@pytest.mark.parametrize(
    ("n_dims", "dims"), [(5, None), (0, None), (2, (0, 2)), (2, (64, 2**31)), (2, (63, 2))]
)
def test_bad_dims(good: Path, n_dims: int, dims: tuple[int, int] | None):
    pos = info_pos(good, "t.bb")
    if dims is None:
        patch(good, pos["n_dims"], struct.pack("<I", n_dims))
    else:
        patch(good, pos["dims"], struct.pack("<2Q", *dims))
    expect(good, FileFormatError, "t.bb")


def test_row_not_a_multiple_of_the_block_names_the_type(good: Path):
    patch(good, info_pos(good, "t.bb")["dims"], struct.pack("<Q", 48))
    assert "Q8_0 block size 32" in str(expect(good, FileFormatError, "t.bb"))


def test_misaligned_offset(good: Path):
    pos = info_pos(good, "t.bb")
    rel = struct.unpack_from("<Q", good.read_bytes(), pos["offset"])[0]
    patch(good, pos["offset"], struct.pack("<Q", rel + 4))
    assert "alignment" in str(expect(good, FileFormatError, "t.bb"))


def test_tensor_data_past_end_of_file(good: Path):
    patch(good, info_pos(good, "t.cc")["offset"], struct.pack("<Q", 2**20))
    assert "past the end" in str(expect(good, FileFormatError, "t.cc"))


def test_overlapping_tensors(good: Path):
    patch(good, info_pos(good, "t.bb")["offset"], struct.pack("<Q", 64))  # inside t.aa's bytes
    assert "overlaps" in str(expect(good, FileFormatError, "t.bb"))


def test_unknown_ggml_type_is_recorded_then_refused(good: Path):
    """The table reads; using the tensor raises UnsupportedQuantError naming tensor and id."""
    patch(good, info_pos(good, "t.bb")["type"], struct.pack("<I", 200))
    with read_gguf(good) as f:
        t = f.tensors["t.bb"]
        assert (t.ggml_type, t.type_name) == (200, "UNKNOWN_200")
        with pytest.raises(UnsupportedQuantError, match="200") as info:
            f.raw("t.bb")
        assert info.value.field == "t.bb" and str(good) in str(info.value)


@pytest.mark.parametrize(
    ("value", "vtype"),
    [(3, GGUFValueType.UINT32), (0, GGUFValueType.UINT32), (32, GGUFValueType.UINT64)],
)
def test_bad_alignment(tmp_path: Path, value: int, vtype: GGUFValueType):
    w = GGUFWriter(tmp_path / "a.gguf", "llama")
    w.add_key_value("general.alignment", value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect(tmp_path / "a.gguf", FileFormatError, "general.alignment")


def test_missing_empty_and_directory(tmp_path: Path):
    expect(tmp_path / "nope.gguf", ModelNotFoundError)
    (tmp_path / "empty.gguf").write_bytes(b"")
    expect(tmp_path / "empty.gguf", FileFormatError)
    expect(tmp_path, FileFormatError)


def test_raw_is_zero_copy_and_outlives_close(good: Path):
    """raw() views the mmap (no copy); closing with a view alive neither fails nor frees it."""
    f = read_gguf(good)
    view = f.raw("t.aa")
    assert not view.flags.owndata and not view.flags.writeable
    f.close()
    assert view.view(np.float32)[31] == 31.0
    with pytest.raises(ValueError):
        f.raw("t.aa")
