"""The serving engine never dies of one request (mlxlis/generation/engine.py, core.py).

What these prove: a token the tokenizer cannot read (an id of a head padded past the
tokenizer, forced here after the vocabulary limit) ends its own request with an error while
the request beside it in the same batch gets exactly the tokens it gets alone (the reference:
`mlxlis.generate` of that prompt by itself); a step that fails outside every per-request guard
(a fault injected into the core's step: no request can cause one today) ends the requests of
that step, is logged with its traceback, and the next request is served; a step failing
again and again stops the engine, which then says why to every caller; a stream whose asyncio
loop was closed is cancelled instead of ending the loop for everyone.
"""

from __future__ import annotations

import asyncio

import mlxlis
from mlxlis.errors import MlxlisError
from mlxlis.generation.core import Request
from mlxlis.generation.engine import MAX_FAILED_ROUNDS, Engine
from mlxlis.generation.processors import LogitsProcessor
from mlxlis.generation.sampling import SamplingParams

import mlx.core as mx
import pytest
from conftest import TINY, build_tiny, trajectory

PAD = 64  # rows of the head past the tokenizer (Qwen2.5: 151 936 rows, 151 665 tokens)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_padded")
    build_tiny(folder, TINY["qwen2"], pad_vocab=PAD)
    model = mlxlis.load(folder, "float32")
    assert model.config.vocab_size == model.tokenizer.vocab_size + PAD
    return model


class ForcePadded(LogitsProcessor):
    """From its third call on, every id but one past the tokenizer at -inf."""

    def __init__(self, token: int):
        self.token, self.calls = token, 0

    def __call__(self, logits: mx.array, history) -> mx.array:
        self.calls += 1
        if self.calls < 3:
            return logits
        hit = (mx.arange(logits.shape[-1]) == self.token)[None]
        return mx.where(hit, 0.0, -mx.inf).astype(logits.dtype)


def alone(model, ids, params) -> list[int]:
    return [e.token for e in mlxlis.generate(model, ids, params, stop_ids=set()) if e.token]


def test_an_unreadable_token_ends_its_request_alone(padded):
    model = padded
    n = model.tokenizer.vocab_size
    a, b = trajectory(7, seed=3, vocab=n), trajectory(9, seed=4, vocab=n)
    params = SamplingParams(max_tokens=10)
    engine = Engine(model, max_active=2, prefix_cache_bytes=0)
    try:
        bad = engine.submit(Request(a, params, processors=(ForcePadded(n + 5),)))
        good = engine.submit(Request(b, params))
        bad_events = list(bad)
        good_tokens = [e.token for e in good if e.token is not None]
        after = list(engine.submit(Request(b, params)))  # the loop still serves
    finally:
        engine.shutdown()
    assert bad_events[-1].finish_reason == "error"
    assert "outside the vocabulary" in bad_events[-1].error
    assert good_tokens == alone(model, b, params)
    assert after[-1].finish_reason == "length"


def test_a_failed_step_ends_its_requests_and_the_loop_goes_on(padded, monkeypatch):
    """Fault injected: the core's step raises (a bug of no one request)."""
    model = padded
    ids = trajectory(6, seed=5, vocab=model.tokenizer.vocab_size)
    params = SamplingParams(max_tokens=8)
    engine = Engine(model, max_active=2, prefix_cache_bytes=0)
    told: list[str] = []
    engine.on_error = told.append
    real_step, fails = engine.core.step, [1]

    def step(seqs, emit=None):
        if fails[0] > 0:
            fails[0] -= 1
            raise RuntimeError("injected")
        return real_step(seqs, emit)

    monkeypatch.setattr(engine.core, "step", step)
    try:
        first = list(engine.submit(Request(ids, params)))
        assert first[-1].finish_reason == "error" and "injected" in first[-1].error
        assert "Traceback" in told[0] and "RuntimeError: injected" in told[0]
        second = list(engine.submit(Request(ids, params)))  # the loop went on
        assert second[-1].finish_reason == "length"
        assert [e.token for e in second if e.token] == alone(model, ids, params)
        fails[0] = MAX_FAILED_ROUNDS + 10  # failing again and again: the engine stops
        stopped: list[str] = []
        engine.on_fatal = stopped.append
        for _ in range(MAX_FAILED_ROUNDS):
            list(engine.submit(Request(ids, params)))
        engine._done.result(10)  # the loop has ended
        assert engine.fatal and "injected" in engine.fatal and stopped == [engine.fatal]
        with pytest.raises(MlxlisError, match="the engine stopped: .*injected"):
            engine.submit(Request(ids, params))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("when", ["before admission", "while decoding"])
def test_a_stream_whose_event_loop_closed_is_cancelled(padded, when):
    """A library caller's asyncio loop closed with its request unread: the request is
    cancelled, and the request beside it (submitted in the same round) is served; before,
    the closed loop's error ended the engine's round and lost the request waiting after it."""
    import time

    model = padded
    ids = trajectory(6, seed=6, vocab=model.tokenizer.vocab_size)
    engine = Engine(model, max_active=2, prefix_cache_bytes=0)
    try:
        loop = asyncio.new_event_loop()
        if when == "before admission":
            loop.close()
        gone = engine.submit(Request(ids, SamplingParams(max_tokens=400)), loop)
        if when == "while decoding":
            deadline = time.monotonic() + 30
            while not gone.id and time.monotonic() < deadline:  # admitted: it decodes
                time.sleep(0.01)
            loop.close()  # its owner went away without reading it
        params = SamplingParams(max_tokens=8)
        served = list(engine.submit(Request(ids, params)))
        assert served[-1].finish_reason == "length"
        assert [e.token for e in served if e.token] == alone(model, ids, params)
        assert gone.cancelled.wait(30)
    finally:
        engine.shutdown()


def test_a_stream_nobody_reads_is_cancelled_at_its_bound(padded):
    """A client that stops reading held its whole reply as events in memory: past
    MAX_UNREAD unread events its request is cancelled, and what the stream holds stays
    within the bound (a stream read as it comes never comes near it: the first test's)."""
    from mlxlis.generation.engine import MAX_UNREAD

    model = padded
    ids = trajectory(6, seed=7, vocab=model.tokenizer.vocab_size)
    engine = Engine(model, max_active=2, prefix_cache_bytes=0)
    try:
        params = SamplingParams(max_tokens=MAX_UNREAD * 3)
        unread = engine.submit(Request(ids, params, stop_ids=frozenset()))
        assert unread.cancelled.wait(120)
        events = list(unread)
        assert events[-1].finish_reason == "cancelled"
        assert MAX_UNREAD < len(events) < MAX_UNREAD + 8  # a step or two past the bound
    finally:
        engine.shutdown()
