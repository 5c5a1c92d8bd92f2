"""Every malformed or unsupported input gives its specific MlxlisError, naming file and field,
through the API and through the CLI (exit 2, one line on stderr, no traceback)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mlxlis
from mlxlis import errors

import numpy as np
import pytest
from safetensors.numpy import save_file


def raw_safetensors(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + blob + data)


@pytest.fixture
def ckpt(tiny, tmp_path):
    """A writable copy of the tiny Llama checkpoint."""
    folder, _ = tiny("llama")
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def tensors_of(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(folder / "model.safetensors")


BAD_FILES = {
    "truncated_length": (lambda p: p.write_bytes(b"\x10\x00"), errors.FileFormatError, "8-byte"),
    "header_past_eof": (
        lambda p: raw_safetensors(p, {}, length=10**6),
        errors.FileFormatError,
        "header length",
    ),
    "bad_json": (lambda p: raw_safetensors(p, b"{not json"), errors.FileFormatError, "JSON"),
    "outside_file": (
        lambda p: raw_safetensors(
            p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8
        ),
        errors.FileFormatError,
        "outside",
    ),
    "overlap": (
        lambda p: raw_safetensors(
            p,
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
        ),
        errors.FileFormatError,
        "overlaps",
    ),
    "size_mismatch": (
        lambda p: raw_safetensors(
            p, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8
        ),
        errors.FileFormatError,
        "expected 12",
    ),
    "unknown_dtype": (
        lambda p: raw_safetensors(
            p, {"a": {"dtype": "F7", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2
        ),
        errors.UnsupportedError,
        "unknown dtype",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_malformed_safetensors(ckpt, case):
    """Each broken header → its specific error naming the file (and the tensor where one is)."""
    make, exc, words = BAD_FILES[case]
    make(ckpt / "model.safetensors")
    with pytest.raises(exc, match=words) as info:
        mlxlis.load(ckpt, "float32")
    assert "model.safetensors" in str(info.value)


def test_missing_tensor_is_named(ckpt):
    t = tensors_of(ckpt)
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, ckpt / "model.safetensors")
    with pytest.raises(errors.MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        mlxlis.load(ckpt, "float32")


def test_unexpected_tensor_is_named(ckpt):
    t = tensors_of(ckpt)
    t["model.layers.0.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(t, ckpt / "model.safetensors")
    with pytest.raises(errors.UnexpectedTensorError, match=r"model\.layers\.0\.extra\.weight"):
        mlxlis.load(ckpt, "float32")


def test_misshaped_tensor_names_both_shapes(ckpt):
    t = tensors_of(ckpt)
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    save_file(t, ckpt / "model.safetensors")
    with pytest.raises(errors.ShapeMismatchError, match=r"k_proj.*\(64, 64\).*\(32, 64\)"):
        mlxlis.load(ckpt, "float32")


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth"])
def test_pickle_files_refused(tmp_path, suffix):
    """Pickled checkpoints are refused by name, never unpickled (the file would run code)."""
    p = tmp_path / f"pytorch_model{suffix}"
    p.write_bytes(b"\x80\x04cos\nsystem\n")  # a pickle that would call os.system
    with pytest.raises(errors.UnsupportedFormatError, match="never unpickled"):
        mlxlis.load(p)
    folder = tmp_path / "only_bin"
    folder.mkdir()
    shutil.copy(p, folder / p.name)
    (folder / "config.json").write_text("{}")
    with pytest.raises(errors.UnsupportedFormatError, match="never unpickled"):
        mlxlis.load(folder)


CONFIG_EDITS = {
    "unknown_model_type": ({"model_type": "gpt_neox"}, errors.UnsupportedError, "model_type"),
    "unsupported_rope": (
        {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
        errors.UnsupportedError,
        "dynamic",
    ),
    "missing_hidden": ({"hidden_size": None}, errors.ConfigError, "hidden_size"),
    "bad_kv_heads": ({"num_key_value_heads": 3}, errors.ConfigError, "num_key_value_heads"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_EDITS))
def test_bad_config(ckpt, case):
    edit, exc, words = CONFIG_EDITS[case]
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(edit)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(exc, match=words) as info:
        mlxlis.load(ckpt, "float32")
    assert "config.json" in str(info.value)


def test_invalid_config_json(ckpt):
    (ckpt / "config.json").write_text("{oops")
    with pytest.raises(errors.ConfigError, match="invalid JSON"):
        mlxlis.load(ckpt, "float32")


def test_unknown_dtype_and_missing_path(ckpt, tmp_path):
    with pytest.raises(errors.UnsupportedError, match="dtype"):
        mlxlis.load(ckpt, "float8")
    with pytest.raises(errors.ModelNotFoundError):
        mlxlis.load(tmp_path / "nope")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxlis", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("case", ["bad_json", "outside_file", "unknown_dtype"])
def test_cli_reports_bad_file_in_one_line(ckpt, case):
    """The CLI turns each error into exit code 2 and one stderr line, no traceback."""
    BAD_FILES[case][0](ckpt / "model.safetensors")
    res = run_cli("-m", str(ckpt), "--no-chat", "Hello")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("mlxlis: error:")
        and "model.safetensors" in lines[0]
    )
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_cli_refuses_pickle(tmp_path):
    p = tmp_path / "model.pt"
    p.write_bytes(b"\x80\x04N.")
    res = run_cli("-m", str(p), "--no-chat", "Hello")
    assert res.returncode == 2 and "never unpickled" in res.stderr and "Traceback" not in res.stderr


def test_cli_one_shot_prints_continuation(tiny):
    """End to end: `mlxlis -m DIR --no-chat PROMPT` streams a continuation to stdout, exit 0."""
    folder, _ = tiny("llama")
    res = run_cli("-m", str(folder), "--no-chat", "--max-tokens", "8", "--verbose", "Hello")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() != ""
    assert "tok/s" in res.stderr and "family: llama" in res.stderr


# the same sizes, as config.json and as GGUF metadata spell them: one bound for both formats
SIZES = [  # (config.json key, GGUF key, a value past the bound or not positive)
    ("num_hidden_layers", "llama.block_count", 20_000),
    ("num_hidden_layers", "llama.block_count", 3_000_000),
    ("hidden_size", "llama.embedding_length", 1 << 21),
    ("intermediate_size", "llama.feed_forward_length", 1 << 30),
    ("num_attention_heads", "llama.attention.head_count", 0),
    ("max_position_embeddings", "llama.context_length", 1 << 40),
]


def sized_gguf(path: Path, override: dict[str, int]) -> Path:
    """A small llama GGUF (written by gguf-py) whose metadata sizes are `override`n."""
    from gguf import GGUFValueType, GGUFWriter

    meta = {
        "llama.block_count": 2,
        "llama.embedding_length": 8,
        "llama.feed_forward_length": 16,
        "llama.attention.head_count": 2,
        "llama.context_length": 64,
        **override,
    }
    w = GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        kind = GGUFValueType.UINT64 if value >= 2**32 else GGUFValueType.UINT32
        w.add_key_value(key, value, kind)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("hf_key", "gguf_key", "value"), SIZES)
def test_sizes_bounded_alike_in_config_json_and_gguf(ckpt, tmp_path, hf_key, gguf_key, value):
    """Every size a model file states is checked against limits.SIZE_BOUNDS before anything is
    built from it, for both formats (unbounded, a GGUF with block_count 3 000 000 would spend
    minutes building layers). The error names the file and the key as that file spells it."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[hf_key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.ConfigError, match=hf_key) as info:
        mlxlis.load(ckpt, "float32")
    assert "config.json" in str(info.value)
    path = sized_gguf(tmp_path / "sized.gguf", {gguf_key: value})
    with pytest.raises(errors.ConfigError, match=gguf_key.replace(".", r"\.")) as info:
        mlxlis.load(path, "float32")
    assert str(path) in str(info.value)


def test_integral_float_sizes_load_as_integers(ckpt):
    """config.json written by some tools spells sizes as floats (16.0): they load as integers
    (a float head_dim used to reach MLX's initialisers and fail there)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_key_value_heads"] = float(cfg["num_key_value_heads"])
    cfg["head_dim"] = float(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model = mlxlis.load(ckpt, "float32")
    c = model.config
    assert type(c.num_key_value_heads) is int and type(c.head_dim) is int
    assert model.logits([1, 2, 3]).shape == (3, c.vocab_size)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_gguf_non_finite_size_is_a_config_error(tmp_path, value):
    from gguf import GGUFValueType, GGUFWriter

    path = tmp_path / "nonfinite.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_key_value("llama.embedding_length", value, GGUFValueType.FLOAT32)  # read first
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(errors.ConfigError, match=r"llama\.embedding_length"):
        mlxlis.load(path, "float32")
