"""Samples of one prompt in the serving engine (generation/samples.py: the prompt read once,
its caches forked, the samples decoded as rows of one batch) on the cache kinds the server
test's models do not have: sliding-window rings (a tiny Gemma 3, its prompt and reply longer
than the window, so the forked rings rotate) and LFM2's short-convolution states.

What is proved, on each: three samples seeded s, s + 1, s + 2 (samples_of) give the tokens of
lone requests with those seeds (which differ from each other: a leak between the samples, or
one shared seed stream, shows), and the engine's prefill counter grows by the prompt's length
once for the three, a prompt of one prefill chunk or of two.
"""

from __future__ import annotations

import mlxlis
from mlxlis.generation.core import Request
from mlxlis.generation.engine import Engine
from mlxlis.generation.samples import samples_of
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.steps import PREFILL_CHUNK

import pytest
from conftest import build_tiny
from test_lfm2 import SPECS as LFM2_SPECS

WINDOW = 8
GEMMA3 = dict(
    kind="gemma3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=512,
)
SPECS = {"gemma3": GEMMA3, "lfm2": LFM2_SPECS["lfm2"]}
PROMPT = [5, 17, 33, 9, 17, 5, 60, 2, 41, 8, 30, 12, 7, 19]  # longer than the window
STEPS = 12
SEED = 77


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """name -> an Engine of SPECS[name], built once."""
    made: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            build_tiny(folder, SPECS[name])
            made[name] = Engine(mlxlis.load(folder, "float32"), max_active=4)
        return made[name]

    yield get
    for eng in made.values():
        eng.shutdown()


def tokens(stream) -> list[int]:
    out = []
    for ev in stream:
        assert ev.error is None, ev.error
        if ev.token is not None:
            out.append(ev.token)
    return out


def request(seed: int, prompt: list[int] = PROMPT) -> Request:
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=STEPS)
    return Request(list(prompt), params)


@pytest.mark.parametrize(("name", "long"), [("gemma3", False), ("gemma3", True), ("lfm2", False)])
def test_samples_equal_lone_runs_and_read_the_prompt_once(engines, name, long):
    """Sample i of three seeded SEED equals the lone run seeded SEED + i; the prompt is read
    once for the three (the engine's prefill counter), the lone runs differ. `long`: a prompt
    of two prefill chunks (the samples wait through both; the rings', whose prompt crosses
    their window many times)."""
    body = PROMPT * (PREFILL_CHUNK // len(PROMPT) + 1) if long else PROMPT
    fresh = [98 if long else 99, *body]  # no other request's prefix: nothing cached
    engine = engines(name)
    before = engine.prefilled
    streams = engine.submit_samples(samples_of(request(SEED, fresh), 3))
    got = [tokens(s) for s in streams]
    assert engine.prefilled - before == len(fresh)
    lone = [tokens(engine.submit(request(SEED + i, fresh))) for i in range(3)]
    assert len({tuple(t) for t in lone}) == 3
    assert got == lone


class Fails:
    """A logits processor that always fails (its forks are itself)."""

    def __call__(self, logits, history):
        raise RuntimeError("this processor fails")

    def fork(self):
        return self


def test_samples_that_fail_end_with_an_error_and_the_engine_goes_on(engines):
    """Samples whose processor fails (the first in its own sampling, the others in theirs at
    the fork) each end with that error, none is left waiting; a request after them runs."""
    engine = engines("lfm2")
    params = SamplingParams(temperature=0, max_tokens=4)
    req = Request([3, *PROMPT], params, processors=(Fails(),))
    finals = [list(s)[-1] for s in engine.submit_samples(samples_of(req, 3))]
    assert [ev.finish_reason for ev in finals] == ["error"] * 3
    assert all("this processor fails" in ev.error for ev in finals)
    assert len(tokens(engine.submit(request(SEED)))) == STEPS
