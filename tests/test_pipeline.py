"""Pipeline parallelism across ranks (mlxlis.distributed) with MLX's ring backend over
loopback, on the three catalog models and a tiny safetensors checkpoint.

Proves: with 2 and 3 ranks, each step's float32 logits (the last rank's, sent to rank 0,
whose generation core samples them) equal a lone process's (same chunks, same BLAS thread
count: the bound is 1e-4, the runs give 0) and the greedy tokens are identical, a Gemma 3
prompt longer than its 512-token window included; each rank builds only its own layers and
its memory grows by about its share of the weights, not the whole model; the CLI under
`mlx.launch` prints exactly the lone CLI's output, once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import mlxlis

import numpy as np
import pytest
from conftest import need_pulled
from launch import MLXLIS
from launch import run as launch

pytestmark = pytest.mark.real

HERE = Path(__file__).parent
LONG = " ".join(f"Item {i}: the river carried {i % 7} boats past the old mill." for i in range(33))
QWEN = {"name": "qwen", "model": "qwen2.5-coder-0.5b", "prompt": "def fibonacci(n):", "steps": 2}
SMOL = {"name": "smol", "model": "smollm2-135m", "prompt": "The capital of France is", "steps": 2}
GEMMA = {"name": "gemma", "model": "gemma3-270m", "prompt": LONG, "steps": 2}
# make test: 2 ranks run SmolLM2 (with the tiny folder and the chat); make test-all adds a
# launch of the three catalog models ("2-full": the largest first, its memory measured from a
# fresh process; Gemma 3's prompt longer than its window) and 3 ranks (a middle rank that
# receives and sends) on SmolLM2: another family split the same way adds only load time
JOBS = {2: [SMOL], "2-full": [QWEN, SMOL, GEMMA], 3: [SMOL]}
STEP_BOUND = 1e-4


@functools.cache
def lone(model: str):
    """The model in this (lone) process, loaded once."""
    return mlxlis.load(model, "float32")


@contextlib.contextmanager
def one_blas_thread():
    """As each of two ranks on this 2-core machine has: the thread count moves float32 sums in
    the last bits (Gemma 3's logits by up to 4.6e-4 over its long prompt)."""
    from mlxlis.distributed.group import set_blas_threads

    before = set_blas_threads(1)
    try:
        yield
    finally:
        if before is not None:
            set_blas_threads(before)


@functools.cache
def reference(model: str, prompt: str, steps: int) -> tuple[list[int], np.ndarray, int]:
    """(greedy tokens, per-step float32 logits, weight bytes) of a lone process, with one
    BLAS thread as each rank has."""
    from mlxlis.generation.steps import prefill

    import mlx.core as mx
    from mlx.utils import tree_flatten

    with one_blas_thread():
        m = lone(model)
        ids = m.tokenizer.encode(prompt)
        cache = m.make_cache()
        out = prefill(m.net, ids, cache)
        tokens, logits = [], []
        for i in range(steps + 1):
            logits.append(np.array(out[0]))
            tokens.append(int(mx.argmax(out, axis=-1).item()))
            if i < steps:
                step = mx.array([[tokens[-1]]], dtype=mx.int32)
                out = m.net(step, cache=cache, last_only=True)[:, -1, :].astype(mx.float32)
        weights = sum({id(a): a.nbytes for _, a in tree_flatten(m.net.parameters())}.values())
    return tokens, np.stack(logits), weights


CHAT = {
    "name": "chat",
    "kind": "chat",
    "model": "smollm2-135m",
    "turns": [
        ["Hi there", None, None],
        ["Name a colour.", 3, None],  # stopped after 3 tokens
        ["Name a fruit.", None, 2],  # the consumer leaves the stream after 2 tokens
        ["And a city?", None, None],  # the left stream's caches were kept whole: reused
        ["Thanks!", None, None],
    ],
}


@pytest.fixture(scope="module")
def tiny_job(tiny):
    """A safetensors folder with an untied head (tiny Llama, 3 layers)."""
    folder, _ = tiny("llama")
    return {"name": "tiny", "model": str(folder), "prompt": "Hello, world! 1234", "steps": 2}


@functools.cache
def _pipelined(n: int | str, tmp: Path, jobs_json: str) -> Path:
    out = tmp / f"ranks-{n}"
    out.mkdir()
    jobs = tmp / f"jobs-{n}.json"
    jobs.write_text(jobs_json)
    ranks = 2 if n == "2-full" else n
    code, _, err = launch(
        ranks, sys.executable, str(HERE / "pipeline_rank.py"), str(jobs), str(out), timeout=150
    )
    assert code == 0 and "Traceback" not in err, err[-3000:]
    return out


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, tiny_job):
    """n (2, 3 or "2-full") -> the folder where the ranks of one launch wrote their results
    (2 ranks also run the tiny safetensors model and the chat)."""
    tmp = tmp_path_factory.mktemp("pipeline")

    def get(n: int | str) -> Path:
        for job in JOBS[n]:
            need_pulled(job["model"])
        return _pipelined(n, tmp, json.dumps(jobs(n, tiny_job) + ([CHAT] if n == 2 else [])))

    return get


def jobs(n: int | str, tiny_job: dict) -> list[dict]:
    return JOBS[n] + ([tiny_job] if n == 2 else [])


# 2 ranks (~30 s), the three catalog models on 2 ranks (~40 s) and 3 ranks (one in the
# middle): `make test-all` (make test launches real ranks in test_pipeline_failures.py)
@pytest.mark.parametrize(
    "ranks",
    [
        pytest.param(2, marks=pytest.mark.extended),
        pytest.param("2-full", marks=pytest.mark.extended),
        pytest.param(3, marks=pytest.mark.extended),
    ],
)
def test_pipelined_steps_equal_the_lone_process(pipelined, tiny_job, ranks):
    """Each step's logits (prefill, then 2 greedy decode steps) from the last rank agree with a
    lone process within 1e-4 in float32 (they come out equal) and rank 0's generation gave the
    same greedy tokens; the parts cover the layers in order. In the full launch Gemma 3's
    prompt (>512 tokens, two prefill chunks) is longer than its sliding window."""
    out = pipelined(ranks)
    n = 2 if ranks == "2-full" else ranks
    for job in jobs(ranks, tiny_job):
        tokens, logits, _ = reference(job["model"], job["prompt"], job["steps"])
        reports = [json.loads((out / f"{job['name']}-rank-{r}.json").read_text()) for r in range(n)]
        if job is GEMMA:  # longer than the sliding window
            assert len(reports[0]["ids"]) > 512
        got = np.load(out / f"{job['name']}-logits.npy")
        assert got.shape == logits.shape
        diff = float(np.abs(got - logits).max())
        assert diff <= STEP_BOUND, f"{job['name']}: logits differ by {diff}"
        assert reports[0]["tokens"] == tokens, job["name"]
        assert [rep["start"] for rep in reports] == [0] + [rep["stop"] for rep in reports][:-1]
        assert all(rep["stop"] > rep["start"] for rep in reports)
        for rep in reports:
            assert rep["layers"] == list(range(rep["start"], rep["stop"])), job["name"]


@pytest.mark.extended  # `make test-all`: the full launch
def test_each_rank_holds_only_its_share(pipelined):
    """Memory on 2 ranks, Qwen2.5-Coder 0.5B in float32 (its blocks kept quantized where
    mlxlis's CPU kernels are built: 0.66 GiB of arrays in one process; 1.95 GiB made dense).
    Each rank holds the arrays of its own layers only (the parts test checks which), plus the
    embedding on rank 0 and the tied head on rank 1; its resident set peaks at about those
    arrays plus a fixed part (the file pages it read, the load's buffers, activations). Measured
    here: rank 0 (layers 0-13) 0.38 GiB of arrays, peak RSS growth 0.56 GiB, rank 1 0.29 GiB,
    growth 0.48 GiB; made dense, rank 0 0.89 GiB of arrays, growth 1.03 GiB, and rank 1 1.06
    GiB, growth 1.20 GiB."""
    out = pipelined("2-full")
    job = QWEN
    _, _, whole = reference(job["model"], job["prompt"], job["steps"])
    for r in range(2):
        rep = json.loads((out / f"qwen-rank-{r}.json").read_text())
        grew = rep["peak_rss"] - rep["rss_before"]
        held = rep["weight_bytes"]
        print(
            f"rank {r}: layers {rep['start']}-{rep['stop'] - 1}, arrays {held / 2**30:.2f} "
            f"GiB of {whole / 2**30:.2f}, peak RSS growth {grew / 2**30:.2f} GiB"
        )
        assert held < 0.6 * whole  # half the layers and one end, not the whole model
        # its resident set is about its arrays: the load's buffers and activations on top
        assert grew < 1.25 * held + (256 << 20)


@pytest.mark.extended  # `make test-all` (8 s): the ranks' steps are proved in make test
def test_cli_under_the_launcher_prints_the_lone_output_once(tmp_path):
    """`mlx.launch -n 2 mlxlis -m M --no-chat --temp 0 PROMPT` writes exactly what the lone
    command writes, once (rank 1 prints nothing), and nothing on stderr."""
    need_pulled("smollm2-135m")
    args = [
        "-m",
        "smollm2-135m",
        "--no-chat",
        "--temp",
        "0",
        "--max-tokens",
        "12",
        "Three primary colours are",
    ]
    lone = subprocess.run(
        [MLXLIS, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    assert lone.returncode == 0, lone.stderr
    code, out, err = launch(2, MLXLIS, *args)
    assert code == 0 and err == "", err
    assert out == lone.stdout and out.strip()


@pytest.mark.extended  # `make test-all`: on the 2-rank launch above
def test_chat_on_rank_0_drives_the_other_ranks(pipelined):
    """A ChatSession on rank 0 while rank 1 follows it (what `mlxlis chat` does under the
    launcher): five turns reusing the cache between them, one stopped by the user after 3
    tokens, one left mid-stream by its consumer (its caches kept: the core ends a sequence
    between steps, never inside one), give the replies, stops and reused prefixes of a lone
    process's session."""

    from pipeline_rank import chat_turns

    got = json.loads((pipelined(2) / "chat-rank-0.json").read_text())
    with one_blas_thread():
        want = chat_turns(lone(CHAT["model"]), CHAT["turns"])
    assert [t[:3] for t in got] == [t[:3] for t in json.loads(json.dumps(want))]
    assert [t[1] for t in got] == [False, True, True, False, False]  # stopped
    assert all(t[2] > 0 for t in got[1:])  # prompt tokens reused on every later turn
