"""The MLX thread's turns (mlxlis/runtime/mlx_thread.py): several engines, one per model, share
the one thread a round each, and jobs (a load's last step, a warm-up) run between passes.

What these prove: the order of workers' rounds and jobs, exactly (recording workers); and
with two real engines on tiny models, that a long prompt read by one engine (four prefill
chunks) does not hold back the other engine's decoding stream (its tokens keep coming while
the prompt is read) and that each engine's tokens are those its model gives alone
(`mlxlis.generate`, the reference).
"""

from __future__ import annotations

import threading
import time

import mlxlis
from mlxlis.generation.core import Request
from mlxlis.generation.engine import Engine
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.steps import PREFILL_CHUNK
from mlxlis.runtime.mlx_thread import MlxThread

import pytest
from conftest import trajectory


class Recorder:
    """A worker with `rounds` rounds of work, each written to `log` as its name."""

    def __init__(self, name: str, rounds: int, log: list[str]):
        self.name, self.rounds, self.log = name, rounds, log

    def has_work(self) -> bool:
        return self.rounds > 0

    def run_round(self) -> bool:
        self.log.append(self.name)
        self.rounds -= 1
        return self.rounds > 0  # done: dropped


def test_workers_take_turns_and_jobs_run_between_passes():
    """Two workers with work take a round each in turn; a job waiting runs after a pass over
    every ready worker, not after one worker's every round; a worker that says it is done is
    dropped, and the thread is idle once no worker has work and no job waits."""
    thread = MlxThread("test-turns")
    log: list[str] = []
    gate, holding = threading.Event(), threading.Event()

    def hold() -> None:  # holds the thread while the work below is queued
        holding.set()
        gate.wait()

    thread.submit(hold)
    assert holding.wait(timeout=10)
    thread.add(Recorder("a", 3, log))
    thread.add(Recorder("b", 2, log))
    done = thread.submit(lambda: log.append("job"))
    gate.set()
    done.result(timeout=10)
    assert thread.wait_idle(timeout=10)
    assert log == ["a", "b", "job", "a", "b", "a"]
    assert thread._workers == []


@pytest.fixture(scope="module")
def two(tiny):
    folder = tiny("llama_long")[0]
    return mlxlis.load(folder, "float32"), mlxlis.load(folder, "float32")


def test_a_long_prompt_of_one_engine_does_not_hold_back_another_engines_stream(two):
    first, second = two
    vocab = first.tokenizer.vocab_size
    decoding = trajectory(5, seed=1, vocab=vocab)
    long_prompt = trajectory(4 * PREFILL_CHUNK, seed=2, vocab=vocab)
    params = SamplingParams(max_tokens=200)
    a = Engine(first, max_active=1, prefix_cache_bytes=0)
    b = Engine(second, max_active=1, prefix_cache_bytes=0)
    times: list[float] = []
    tokens: list[int] = []

    def read_a(stream) -> None:  # each of a's tokens, timed as it arrives
        for ev in stream:
            if ev.token is not None:
                tokens.append(ev.token)
                times.append(time.monotonic())

    try:
        reader = threading.Thread(target=read_a, args=(a.submit(Request(decoding, params)),))
        reader.start()
        while len(tokens) < 20:  # a decodes on its own first
            time.sleep(0.01)
        sent = time.monotonic()
        reading = b.submit(Request(long_prompt, SamplingParams(max_tokens=1)))
        first_b = next(ev for ev in reading if ev.token is not None)
        read = time.monotonic()
        rest = list(reading)
        reader.join(timeout=120)
    finally:
        a.shutdown()
        b.shutdown()
    # a's tokens went on while b read its four chunks: one round of a between two of b's
    during = [t for t in times if sent < t < read]
    assert len(during) >= 3, (len(during), read - sent)
    assert read < times[-1]  # and b read its prompt while a still decoded: neither waits
    assert tokens == [
        e.token for e in mlxlis.generate(first, decoding, params, stop_ids=set()) if e.token
    ]
    alone = [
        e.token
        for e in mlxlis.generate(second, long_prompt, SamplingParams(max_tokens=1), stop_ids=set())
    ]
    assert [first_b.token] == [t for t in alone if t] and rest[-1].finish_reason
