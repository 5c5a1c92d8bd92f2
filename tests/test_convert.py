"""`mlxlis convert`: GGUF -> MLX/HF folder without requantisation.

Round trip (self-consistency of the writer): the converted folder, loaded back through the
safetensors path, reproduces the GGUF's logits bit for bit in fp32.
mlx-lm (an independent implementation) loads the converted folders; its logits and greedy text
match mlxlis'.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlxlis
from mlxlis.errors import MlxlisError
from mlxlis.loading import catalog

import mlx.core as mx
import numpy as np
import pytest
from conftest import CTRL_C_CHILD, real_quantized

PROMPT = "The capital of France is"


def need(name: str) -> None:
    if not catalog.is_pulled(name):
        pytest.skip(f"{name} not pulled (make models)")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            need(name)
            from mlxlis.commands.convert import convert

            out = convert(name, tmp_path_factory.mktemp("conv") / name, dtype="float32")
            made[name] = (out, real_quantized(name))  # shared with test_gguf_models
        return made[name]

    return get


@pytest.mark.real
# the larger two in `make test-all`: the same code path, 60 s more here
@pytest.mark.parametrize(
    "name",
    [
        "smollm2-135m",
        pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.extended),
        pytest.param("gemma3-270m", marks=pytest.mark.extended),
    ],
)
def test_round_trip_bitwise(converted, name):
    out, gguf_model = converted(name)
    again = mlxlis.load(out, "float32")
    ids = gguf_model.tokenizer.encode("Round trip: a small test of 1234 tokens, ok?")
    assert again.tokenizer.encode("Round trip: a small test of 1234 tokens, ok?") == ids
    # the first positions use every weight; products of quantized blocks are slow on a CPU
    assert bool(mx.array_equal(again.logits(ids[:8]), gguf_model.logits(ids[:8])))
    manifest = json.loads((out / "mlxlis-manifest.json").read_text())
    assert manifest["source_sha256"] == catalog.CATALOG[name].sha256
    assert manifest["quantized_modules"]  # the quantized blocks were kept, not densified
    if gguf_model.template is None:
        assert again.template is None
    else:  # the template travels with the files (its source is now the folder's file)
        assert again.template.text == gguf_model.template.text


@pytest.mark.real
@pytest.mark.extended  # `make test-all` (6 s): each family's convert test has mlx-lm read it
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_mlx_lm_loads_converted(converted, name):
    """mlx-lm reads the quantization block (per-module bits) and gets the same logits
    (tolerance 1e-3: two implementations of the same quantized matmuls) and the same greedy
    text."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm import stream_generate as mlx_lm_stream

    out, model = converted(name)
    theirs, tok = mlx_lm_load(str(out))
    ids = model.tokenizer.encode(PROMPT)
    assert tok.encode(PROMPT) == ids
    a = np.array(theirs(mx.array([ids]))[0].astype(mx.float32))
    b = np.array(model.logits(ids))
    assert np.abs(a - b).max() < 1e-3
    # the same greedy tokens, hence the same text (mlx-lm's streaming detokenizer trims the
    # first token's leading space, so the ids are compared and decoded by one tokenizer)
    their_ids = [r.token for r in mlx_lm_stream(theirs, tok, ids, max_tokens=8)]
    our_ids = [
        e.token
        for e in mlxlis.generate(model, ids, max_tokens=8, stop_ids=set())
        if e.token is not None
    ]
    n = min(len(their_ids), len(our_ids))
    assert n >= 1 and their_ids[:n] == our_ids[:n]
    assert model.tokenizer.decode(our_ids[:n]) == tok.decode(their_ids[:n])


def test_refuses_existing_destination(tiny, tmp_path):
    from mlxlis.commands.convert import convert

    folder, _ = tiny("llama")
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(MlxlisError, match="--force"):
        convert(folder, dest)
    assert list(dest.iterdir()) == []
    convert(folder, dest, force=True, dtype="float32")
    assert (dest / "config.json").is_file()


def test_failed_conversion_leaves_nothing(tiny, tmp_path, monkeypatch):
    """An error during writing (here: verification) leaves no destination and no temp folder."""
    from mlxlis.commands import convert as conv

    folder, _ = tiny("llama")

    def broken(model, folder):
        raise MlxlisError("simulated failure")

    monkeypatch.setattr(conv, "_verify", broken)
    with pytest.raises(MlxlisError, match="simulated"):
        conv.convert(folder, tmp_path / "out", dtype="float32")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_conversion_leaves_nothing(tiny, tmp_path):
    """Ctrl+C (SIGINT) in the middle of a conversion subprocess leaves nothing behind."""
    folder, _ = tiny("llama")
    code = (
        "import sys, mlxlis.commands.convert as c\n"
        "orig = c.write_tokenizer\n"
        "def slow(m, f):\n"
        "    orig(m, f); print('writing', flush=True); import time; time.sleep(60)\n"
        "c.write_tokenizer = slow\n"
        f"c.convert({str(folder)!r}, {str(tmp_path / 'out')!r}, dtype='float32')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_CHILD + code], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(2)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert list(tmp_path.iterdir()) == []
