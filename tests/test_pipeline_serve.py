"""`mlxlis serve` under `mlx.launch` (2 ranks, ring over loopback): rank 0 serves, both ranks
run every step of its engine (mlxlis.distributed.serving).

Proves, on SmolLM2 in float32 with the official `openai` client: concurrent greedy
completions (a prompt over one prefill chunk included, decoded in one batch) give exactly the
text of the same requests run one by one on a lone in-process Engine, and each token's
logprob agrees with the lone run within 1e-4 (the ranks use one BLAS thread each, as the
reference does); a second turn reuses the prefix cache (cached_tokens > 0) with the same
answer as a fresh lone run; killing rank 1 ends rank 0 within 10 s with a message naming
the lost rank.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import mlxlis

import pytest
from conftest import need_pulled
from launch import alive, kill_all, ranks
from serve_process import ServeProcess
from test_pipeline import one_blas_thread

# `make test-all`: the pipeline's steps are proved in test_pipeline.py, the server's in test_serve*
pytestmark = [pytest.mark.real, pytest.mark.extended]

MODEL = "smollm2-135m"
BOUND = 1e-4
TOKENS = 8


def prompts(model) -> list[list[int]]:
    """Token-id prompts of different lengths, one longer than a prefill chunk (256)."""
    texts = [
        "The capital of France is",
        "def add(a, b):\n    return",
        "Once upon a time, in a small village,",
        " ".join(f"Line {i}: the mill turned {i % 5} times." for i in range(40)),
    ]
    return [model.tokenizer.encode(t) for t in texts]


def lone(model, ids: list[int]) -> tuple[str, list[float]]:
    """(text, each token's logprob) of a greedy request alone on an in-process Engine."""
    from mlxlis.generation.core import Request
    from mlxlis.generation.engine import Engine
    from mlxlis.generation.sampling import SamplingParams

    engine = Engine(model, max_active=1)
    try:
        req = Request(ids, SamplingParams(max_tokens=TOKENS, temperature=0.0), top_logprobs=0)
        events = list(engine.submit(req))
    finally:
        engine.shutdown()
    return "".join(e.text for e in events), [e.logprob for e in events if e.token is not None]


def complete(client, ids: list[int]):
    return client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )


def test_server_under_the_launcher_answers_as_a_lone_engine(tmp_path):
    need_pulled(MODEL)
    # a hang guard far above a step's time: a rank's watchdog counts its own computing too, and
    # a busy 2-core machine running two ranks and a spinning launcher is slow (the kill below
    # closes sockets, which ends the ranks at once, not through the watchdog)
    server = ServeProcess(
        tmp_path, "-m", MODEL, "--max-batch", "4", ranks=2, env={"MLXLIS_RANK_TIMEOUT": "120"}
    )
    try:
        client = server.client()
        model = mlxlis.load(MODEL, "float32")
        batch = prompts(model)
        with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
            served = list(pool.map(lambda ids: complete(client, ids), batch))
        with one_blas_thread():
            expected = [lone(model, ids) for ids in batch]
        for ids, got, (text, logprobs) in zip(batch, served, expected, strict=True):
            choice = got.choices[0]
            assert choice.text == text, (len(ids), choice.text, text)
            diff = max(
                abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, logprobs, strict=True)
            )
            assert diff <= BOUND, (len(ids), diff)

        # the second turn of the first prompt: its start comes from the prefix cache
        turn = batch[0] + model.tokenizer.encode(served[0].choices[0].text) + batch[1]
        second = complete(client, turn)
        assert second.usage.prompt_tokens_details.cached_tokens > len(batch[0]) // 2
        with one_blas_thread():
            text, logprobs = lone(model, turn)
        assert second.choices[0].text == text
        assert (
            max(
                abs(a - b)
                for a, b in zip(second.choices[0].logprobs.token_logprobs, logprobs, strict=True)
            )
            <= BOUND
        )
        assert server.wait_idle()["running"] == 0

        # a rank lost while serving ends the job, with rank 0 saying why
        pids = ranks(server.proc, 2)
        stream = client.completions.create(
            model=MODEL,
            prompt=batch[2],
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        t0 = time.monotonic()
        import os

        os.kill(pids[1], signal.SIGKILL)
        server.proc.wait(30)
        took = time.monotonic() - t0
        assert took < 10, took
        assert not alive(pids[0])
        assert "rank 0 of 2" in server.log() and "lost the connection" in server.log(), (
            server.log()[-2000:]
        )
    finally:
        kill_all(server.proc)
