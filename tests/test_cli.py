"""The command line as a subprocess on a tiny checkpoint written by transformers.

Proves: `python -m mlxlis` is the `mlxlis` command; `inspect` reports on stdout (pipeable) and
`--json` has the documented shape with values equal to the model's config.json (its memory
block equal to the K/V arithmetic under MLXLIS_MAX_MEMORY); a bad sampling flag is refused
(exit 2, one line naming the flag) before the model loads; importing mlxlis leaves glibc's
allocator settings alone while the commands opt in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MLXLIS = str(Path(sys.executable).with_name("mlxlis"))


def run(*args: str, module: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlxlis"] if module else [MLXLIS]
    env = {**os.environ, **(env or {})}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, env=env)


def test_python_m_mlxlis_is_the_command(tiny):
    folder, _ = tiny("llama")
    args = ("-m", str(folder), "--no-chat", "--max-tokens", "6", "Hello")
    via_module, via_script = run(*args, module=True), run(*args)
    assert via_module.returncode == via_script.returncode == 0, via_module.stderr
    assert via_module.stdout == via_script.stdout and via_module.stdout.strip()
    bad = run("inspect", "--nope", module=True)
    assert bad.returncode == 2 and "usage: mlxlis inspect" in bad.stderr


def test_inspect_reports_on_stdout_and_json_matches_config(tiny):
    folder, _ = tiny("llama")
    text = run("inspect", str(folder))
    assert text.returncode == 0 and text.stderr == ""
    assert "family: llama" in text.stdout and "template:" in text.stdout
    res = run("inspect", str(folder), "--json", env={"MLXLIS_MAX_MEMORY": "2M"})
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    cfg = json.loads((folder / "config.json").read_text())
    assert report["schema"] == 1 and report["family"] == "llama"
    c = report["config"]
    assert (c["layers"], c["hidden_size"], c["intermediate_size"]) == (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["intermediate_size"],
    )
    assert (c["attention_heads"], c["kv_heads"], c["vocab_size"]) == (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
    )
    assert c["rope"]["theta"] == cfg["rope_parameters"]["rope_theta"]
    assert c["context_length"] == cfg["max_position_embeddings"]
    assert set(report) >= {
        "model",
        "path",
        "format",
        "quant",
        "dtype",
        "device",
        "blas",
        "template",
        "weights",
        "stop_ids",
    }
    assert report["weights"]["bytes"] > 0
    # memory: dense float32 K and V of every layer per token; the longest context that fits
    # the 2 MiB MLXLIS_MAX_MEMORY gives, beside the weights
    m, hd = report["memory"], cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * 4
    assert m["kv_format"] == "dense" and m["kv_bytes_per_token"] == per_token
    assert m["budget_bytes"] == 2 << 20
    room = m["budget_bytes"] - report["weights"]["bytes"]
    assert m["max_context"] == min(room // per_token, c["context_length"])


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--min-p", "1"),
        ("--top-p", "0"),
        ("--temp", "-1"),
        ("--max-tokens", "0"),
        ("--seed", "x"),
        ("--presence-penalty", "3"),
        ("--logit-bias", "5"),
        ("--mirostat", "1"),
        ("--xtc-threshold", "0.9"),
        ("--dry-sequence-breakers", "[1]"),
    ],
)
def test_bad_sampling_flag_refused_before_loading(flag, value, tmp_path):
    """The model path does not exist: a flag check that ran after loading would report that
    instead."""
    res = run("-m", str(tmp_path / "missing"), flag, value, "Hi")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "must be" in lines[0], res.stderr
    assert "missing" not in res.stderr


def test_xtc_with_speculative_refused_before_loading(tmp_path):
    """--xtc-probability with --speculative: exit 2 naming the flag before any model loads
    (XTC's coin has no fixed distribution for the speculative ratio test)."""
    res = run(
        "-m",
        str(tmp_path / "missing"),
        "--speculative",
        "ngram",
        "--temp",
        "1",
        "--xtc-probability",
        "0.5",
        "Hi",
    )
    assert res.returncode == 2 and "--xtc-probability" in res.stderr, res.stderr
    assert "missing" not in res.stderr


MALLOPT_PROBE = """
import ctypes, sys
import mlxlis
# glibc maps a 30 MiB block with its own mmap by default (mallinfo2's hblkhd, bytes in mapped
# blocks, grows by it); setup_process() raises the mmap threshold to 32 MiB: the heap serves it
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks "
                                                "fsmblks uordblks fordblks keepcost").split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MI
libc.malloc.restype = ctypes.c_void_p
def mmapped(n=30 << 20):
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(n)
    grew = libc.mallinfo2().hblkhd - before >= n
    libc.free(ctypes.c_void_p(p))
    return grew
if sys.argv[1] == "setup":
    mlxlis.runtime.device.setup_process()
print(mmapped())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator settings")
def test_import_leaves_the_allocator_alone_setup_process_tunes_it():
    plain = subprocess.run(
        [sys.executable, "-c", MALLOPT_PROBE, "import"], capture_output=True, text=True, timeout=120
    )
    assert plain.stdout.split() == ["True"], plain.stderr  # glibc's defaults kept
    tuned = subprocess.run(
        [sys.executable, "-c", MALLOPT_PROBE, "setup"], capture_output=True, text=True, timeout=120
    )
    assert tuned.stdout.split() == ["False"], tuned.stderr  # now served from the heap
