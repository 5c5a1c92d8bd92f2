"""The serving engine (mlxlis/generation/engine.py) without HTTP.

Self-consistency against mlxlis.generate, the reference for one prompt: greedy requests
interleaved step by step (8 at once, different prompt lengths, one longer than Gemma 3's
sliding window, on Llama, Qwen2, Gemma 3, the hybrid Qwen3.5 and Gemma 4 with KV-shared
layers and per-layer inputs) produce exactly the tokens
each produces alone through `generate`; a prompt sharing a prefix with a finished request
reuses its caches (cached_tokens > 0) and still produces exactly a fresh run's tokens;
stop strings are cut across token boundaries and never emitted; cancellation, a full queue and
shutdown end streams as documented; memory held by the prefix cache stays within its bound.
"""

from __future__ import annotations

import random

import mlxlis
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.core import Request
from mlxlis.generation.engine import Engine, QueueFullError
from mlxlis.generation.processors import LogitsProcessor
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.stops import StopMatcher

import mlx.core as mx
import pytest
from conftest import trajectory
from test_gemma4 import SPECS as GEMMA4_SPECS
from test_gemma4 import build as build_gemma4
from test_qwen3_5 import SPECS as QWEN35_SPECS
from test_qwen3_5 import build as build_qwen35

GEMMA3 = dict(
    kind="gemma3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    from conftest import build_tiny

    out = {"llama": tiny("llama")[0], "qwen2": tiny("qwen2")[0]}
    folder = tmp_path_factory.mktemp("gemma3")
    build_tiny(folder, GEMMA3)
    out["gemma3"] = folder
    folder = tmp_path_factory.mktemp("qwen3_5")
    build_qwen35(folder, QWEN35_SPECS["qwen3_5"])
    out["qwen3_5"] = folder
    folder = tmp_path_factory.mktemp("gemma4")  # its own network: per-layer inputs, KV sharing
    build_gemma4(folder, GEMMA4_SPECS["all"])
    out["gemma4"] = folder
    return {k: mlxlis.load(v, "float32") for k, v in out.items()}


def alone(model, ids: list[int], n: int) -> list[int]:
    events = mlxlis.generate(model, ids, max_tokens=n, stop_ids=set())
    return [e.token for e in events if e.token is not None]


def tokens(stream) -> list[int]:
    return [e.token for e in stream if e.token is not None]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "qwen3_5", "gemma4"])
def test_interleaved_requests_equal_each_alone(models, name):
    """8 greedy requests at once (prompts of 3 to 40 tokens: past the Gemma 3 window of 8,
    past its 256-slot growth only with generation) give each request generate's tokens."""
    model = models[name]
    rng = random.Random(0)
    prompts = [
        trajectory(rng.randint(3, 40), seed=i, vocab=model.config.vocab_size) for i in range(8)
    ]
    engine = Engine(model, max_active=8, prefix_cache_bytes=0)
    try:
        streams = [engine.submit(Request(p, SamplingParams(max_tokens=16))) for p in prompts]
        got = [tokens(s) for s in streams]
    finally:
        engine.shutdown()
    assert got == [alone(model, p, 16) for p in prompts]


def test_batched_rows_keep_their_own_processors_and_samplers(models):
    """Requests with and without a repetition penalty, greedy and seeded sampling, decoding in
    one batch: each gives what the same request gives alone through `generate` (self-
    consistency of the batched step against the lone one: each row's processors and sampler
    see its own logits and history)."""
    model = models["llama"]
    vocab = model.config.vocab_size
    prompts = [trajectory(n, seed=30 + n, vocab=vocab) for n in (6, 11, 17, 9)]
    params = [
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=12, repetition_penalty=1.8, repetition_context=8),
        SamplingParams(max_tokens=12, temperature=1.0, seed=5),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=9, repetition_penalty=1.3),
    ]
    engine = Engine(model, max_active=4, prefix_cache_bytes=0)
    try:
        streams = [engine.submit(Request(p, q)) for p, q in zip(prompts, params, strict=True)]
        got = [tokens(s) for s in streams]
    finally:
        engine.shutdown()
    want = [
        [e.token for e in mlxlis.generate(model, p, q, stop_ids=set()) if e.token is not None]
        for p, q in zip(prompts, params, strict=True)
    ]
    assert got == want
    assert want[0] != want[1]  # the penalty changed the second request's tokens


class Broken(LogitsProcessor):
    """A logits processor that turns on its third call and gives a row of the wrong shape."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits, history):
        self.calls += 1
        return logits[0] if self.calls >= 3 else logits


def test_a_failing_processor_ends_its_request_alone(models):
    """A request whose logits processor fails mid-reply ends with an "error" event naming
    it; the request decoding in the same batch goes on to the tokens it gives alone."""
    model = models["llama"]
    vocab = model.config.vocab_size
    a, b = trajectory(7, seed=41, vocab=vocab), trajectory(9, seed=42, vocab=vocab)
    params = SamplingParams(max_tokens=10)
    engine = Engine(model, max_active=2, prefix_cache_bytes=0)
    try:
        bad = engine.submit(Request(a, params, processors=(Broken(),)))
        good = engine.submit(Request(b, params))
        bad_events, good_tokens = list(bad), tokens(good)
    finally:
        engine.shutdown()
    assert bad_events[-1].finish_reason == "error" and "Broken" in bad_events[-1].error
    want = [
        e.token for e in mlxlis.generate(model, b, params, stop_ids=set()) if e.token is not None
    ]
    assert good_tokens == want


ENGINE_LEFT_RUNNING = """
import sys
import mlxlis
from mlxlis.generation.core import Request
from mlxlis.generation.engine import Engine
model = mlxlis.load(sys.argv[1], "float32")
engine = Engine(model)
stream = engine.submit(Request([1, 2, 3], mlxlis.SamplingParams(max_tokens=400)))
next(iter(stream))  # decoding now; the process exits without engine.shutdown()
print("leaving", flush=True)
"""


def test_an_engine_left_running_at_exit_ends_the_process_cleanly(tiny):
    """A real process that exits while an Engine is still decoding (a failed test, a library
    user without `shutdown()`) exits 0: the engine is shut down before the interpreter
    finalizes, instead of MLX's thread being torn down mid-step ("terminate called without an
    active exception", status 134)."""
    import subprocess
    import sys

    folder, _ = tiny("llama")
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_LEFT_RUNNING, str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "leaving" in out.stdout and "terminate called" not in out.stderr


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_prefix_cache_reuse_equals_a_fresh_run(models, name):
    """A second prompt extending the first request's prompt and reply takes that request's
    caches (rewound: KV trimmed, recurrent states from their snapshot) and reports the reused
    tokens; its tokens equal generate's on the whole prompt."""
    model = models[name]
    engine = Engine(model, prefix_cache_bytes=1 << 30)
    try:
        first = trajectory(30, seed=3, vocab=model.config.vocab_size)
        reply = tokens(engine.submit(Request(first, SamplingParams(max_tokens=8))))
        second = first + reply + trajectory(10, seed=4, vocab=model.config.vocab_size)
        events = list(engine.submit(Request(second, SamplingParams(max_tokens=12))))
    finally:
        engine.shutdown()
    assert events[-1].usage.cached_tokens >= len(first)
    assert [e.token for e in events if e.token is not None] == alone(model, second, 12)


def test_stop_strings_across_token_boundaries_never_emitted():
    """A stop string split over pieces is found; text that only begins like one is held back,
    then released when it turns out not to be one."""
    m = StopMatcher(("STOP", "\n\n"))
    out = [m.feed(t) for t in ("Hello S", "T", "ill here", " and ST", "OP now")]
    assert out == [
        ("Hello ", False),
        ("", False),
        ("STill here", False),
        (" and ", False),
        ("", True),
    ]
    m = StopMatcher(("\n\n",))
    assert m.feed("a\n") == ("a", False) and m.feed("b") == ("\nb", False)


def test_engine_cuts_stop_strings(models):
    """The engine ends the request where the stop text (made of this model's own output)
    begins and emits none of it."""
    model = models["llama"]
    ids = trajectory(12, seed=5, vocab=model.config.vocab_size)
    text = model.tokenizer.decode(alone(model, ids, 10))
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    engine = Engine(model)
    try:
        events = list(
            engine.submit(Request(ids, SamplingParams(max_tokens=10), stop_strings=(stop,)))
        )
    finally:
        engine.shutdown()
    out = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop" and stop not in out and text.startswith(out)
    assert out == text[: text.find(stop)]


def test_cancel_full_queue_and_shutdown(models):
    """A cancelled request ends with "cancelled" while the others run on; beyond max_queued
    waiting requests submit raises QueueFullError; shutdown ends the rest with "error"."""
    model = models["llama"]
    engine = Engine(model, max_active=1, max_queued=2)
    ids = trajectory(8, vocab=model.config.vocab_size)
    long = Request(ids, SamplingParams(max_tokens=400))
    a = engine.submit(long)
    a.cancel()
    assert [e.finish_reason for e in a][-1] == "cancelled"
    running = iter(engine.submit(long))
    assert next(running).token is not None  # admitted: it runs, the queue is empty
    waiting = [engine.submit(long), engine.submit(long)]
    with pytest.raises(QueueFullError):
        engine.submit(long)
    engine.shutdown()
    assert list(running)[-1].finish_reason == "error"
    assert all([e for e in w][-1].finish_reason == "error" for w in waiting)


def test_prefix_cache_stays_within_its_bound(models):
    """The prefix cache never holds more bytes than its bound, however many requests end."""
    model = models["llama"]
    one = model.make_cache()
    model.net(mx.array([trajectory(20)]), cache=one)
    size = sum(a.nbytes for c in one for a in c.state)
    cache = PrefixCache(max_bytes=3 * size)
    for i in range(10):
        c = model.make_cache()
        model.net(mx.array([trajectory(20, seed=i)]), cache=c)
        cache.put(trajectory(20, seed=i), c)
        assert cache.bytes <= 3 * size
    assert 0 < cache.bytes


@pytest.mark.extended  # `make test-all` (6 s): a soak; cancellation is proved in make test
def test_soak_with_random_cancellations_loses_nothing_and_leaks_nothing(models):
    """1 000 requests (random prompts and lengths, 4 to 8 running at once), a random third of
    them cancelled while waiting or running: every stream ends exactly once with its reason,
    the completed greedy ones that were checked (every 50th) carry exactly their lone tokens
    (no request's tokens mixed into another's), the prefix cache stays within its bound, and
    after shutdown MLX's active memory is back at its level before the soak."""
    model = models["llama"]
    rng = random.Random(7)
    mx.eval(model.net.parameters())
    baseline = mx.get_active_memory()
    bound = 4 << 20
    engine = Engine(model, max_active=8, max_queued=2000, prefix_cache_bytes=bound)
    jobs = []
    for i in range(1000):
        prompt = trajectory(rng.randint(2, 24), seed=i, vocab=model.config.vocab_size)
        n = rng.randint(1, 6)
        stream = engine.submit(Request(prompt, SamplingParams(max_tokens=n)))
        jobs.append((prompt, n, stream, rng.random() < 1 / 3))
        if jobs[-1][3]:
            stream.cancel()
    ends = {"length": 0, "stop": 0, "cancelled": 0}
    for i, (prompt, n, stream, cancelled) in enumerate(jobs):
        events = list(stream)
        assert [e.finish_reason is not None for e in events].count(True) == 1
        ends[events[-1].finish_reason] += 1
        got = [e.token for e in events if e.token is not None]
        if cancelled:
            assert events[-1].finish_reason == "cancelled" or len(got) == n
        else:
            assert events[-1].finish_reason in ("length", "stop")
            if i % 50 == 0:
                assert got == alone(model, prompt, n)[: len(got)], i
        assert engine.prefix.bytes <= bound
    engine.shutdown()
    assert ends["cancelled"] > 200 and ends["length"] > 500
    del engine, jobs
    import gc

    gc.collect()
    mx.clear_cache()
    assert mx.get_active_memory() <= baseline + (1 << 20)
