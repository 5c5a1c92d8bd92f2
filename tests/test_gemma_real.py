"""The real Gemma 3 270M (GGUF Q4_K_M) in float16, and its CLI.

Its residual stream reaches 1.04e5 at the first position (asserted from the float32 run),
beyond float16's 65 504: a float16 run must stay finite and pick float32's greedy token
wherever float32's choice is clear. Self-consistency between dtypes of our own model (reference
parity of this file against transformers is in test_gguf_models.py; the sliding window against
transformers in the Gemma parity tests).
"""

from __future__ import annotations

import subprocess
import sys

import mlxlis
from mlxlis.generation.steps import prefill
from mlxlis.loading import catalog

import mlx.core as mx
import numpy as np
import pytest

pytestmark = [pytest.mark.real, pytest.mark.slow]
TEXT = (
    "The history of the Roman Empire spans many centuries, from the founding of the city to "
    "the fall of Constantinople. Its roads, laws and language shaped Europe for ever after. "
) * 2


def tail_logits(model, ids: list[int], tail: int) -> np.ndarray:
    """Logits of the last `tail` positions after prefilling the rest into the cache (the head
    runs on `tail` rows only: CPU float16 matmuls are emulated and slow)."""
    cache = model.make_cache()
    mx.eval(prefill(model.net, ids[:-tail], cache))
    out = model.net(mx.array([ids[-tail:]]), cache=cache)[0]
    return np.array(out.astype(mx.float32))


@pytest.fixture(scope="module")
def ids():
    if not catalog.is_pulled("gemma3-270m"):
        pytest.skip("gemma3-270m not pulled (make models)")
    tok = mlxlis.load("gemma3-270m", "float32", dequantize=True).tokenizer
    out = tok.encode(TEXT)[:32]
    assert len(out) == 32
    return out


@pytest.mark.extended  # `make test-all`: two float16 runs of the real model (12 s)
def test_float16_finite_and_close_past_float16_range(ids):
    f32_model = mlxlis.load("gemma3-270m", "float32", dequantize=True)
    net = f32_model.net
    residual = net.run_layers(net.embed(mx.array([ids])))  # (1, 32, hidden), before the norm
    assert float(mx.abs(residual).max()) > 65504  # the case this test is about
    f32 = tail_logits(f32_model, ids, 16)
    f16 = tail_logits(mlxlis.load("gemma3-270m", "float16", dequantize=True), ids, 16)
    assert np.isfinite(f16).all()
    top2 = np.sort(f32, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05
    assert clear.sum() > 8
    assert (f32.argmax(-1)[clear] == f16.argmax(-1)[clear]).all()


@pytest.mark.extended  # `make test-all` (9 s): the CLI's path is the tiny models' in test_cli.py
def test_cli_raw_completion_end_to_end():
    """`mlxlis -m gemma3-270m --no-chat PROMPT` runs the base model and prints its greedy
    continuation (the CLI's plumbing against the API: self-consistency)."""
    if not catalog.is_pulled("gemma3-270m"):
        pytest.skip("gemma3-270m not pulled")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxlis",
            "-m",
            "gemma3-270m",
            "--no-chat",
            "--max-tokens",
            "12",
            "The capital of France is",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    model = mlxlis.load("gemma3-270m")
    ids = model.tokenizer.encode("The capital of France is")
    api = "".join(e.text for e in mlxlis.generate(model, ids, max_tokens=12))
    assert api.strip() and res.stdout == api + "\n"  # the CLI streams exactly the API's text


@pytest.mark.extended  # `make test-all` (10 s): the chat app refuses it in test_tui_real
def test_cli_chat_mode_without_template_is_refused():
    """Chat mode on the base model stops with exit 2 and the diagnosis (never a guessed
    template, never raw prompting behind the user's back)."""
    if not catalog.is_pulled("gemma3-270m"):
        pytest.skip("gemma3-270m not pulled")
    res = subprocess.run(
        [sys.executable, "-m", "mlxlis", "-m", "gemma3-270m", "Hello"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 2 and res.stdout == ""
    assert "base" in res.stderr and "--no-chat" in res.stderr and "Traceback" not in res.stderr
