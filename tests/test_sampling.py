"""Samplers against direct numpy definitions of each filter (reference), and seeding."""

from __future__ import annotations

from mlxlis.sampling import (
    SamplingParams,
    _min_p,
    _top_k,
    _top_p,
    apply_repetition_penalty,
    make_sampler,
)

import mlx.core as mx
import numpy as np
import pytest

rng = np.random.default_rng(0)
LOGITS = rng.normal(0, 2, size=(1, 50)).astype(np.float32)


def kept(filtered: mx.array) -> set[int]:
    return set(np.flatnonzero(np.isfinite(np.array(filtered)[0])).tolist())


def test_top_k_matches_definition():
    expected = set(np.argsort(-LOGITS[0])[:7].tolist())
    assert kept(_top_k(mx.array(LOGITS), 7)) == expected


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_matches_definition(p):
    probs = np.exp(LOGITS[0] - LOGITS[0].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, p) + 1)  # smallest prefix whose mass reaches p
    expected = set(order[:n].tolist())
    assert kept(_top_p(mx.array(LOGITS), mx.array(p))) == expected


def test_min_p_matches_definition():
    probs = np.exp(LOGITS[0] - LOGITS[0].max())
    probs /= probs.sum()
    expected = set(np.flatnonzero(probs >= 0.2 * probs.max()).tolist())
    assert kept(_min_p(mx.array(LOGITS), mx.array(0.2))) == expected


def test_repetition_penalty_definition():
    logits = mx.array(LOGITS.copy())
    out = np.array(apply_repetition_penalty(logits, [3, 4, 3], 1.5))
    ref = LOGITS.copy()
    for i in (3, 4):
        ref[0, i] = ref[0, i] / 1.5 if ref[0, i] > 0 else ref[0, i] * 1.5
    np.testing.assert_allclose(out, ref)


def test_greedy_is_argmax_and_seed_reproduces():
    assert int(make_sampler(SamplingParams())(mx.array(LOGITS)).item()) == int(LOGITS.argmax())
    a = make_sampler(SamplingParams(temperature=1.0, seed=5))
    b = make_sampler(SamplingParams(temperature=1.0, seed=5))
    draws_a = [int(a(mx.array(LOGITS)).item()) for _ in range(20)]
    draws_b = [int(b(mx.array(LOGITS)).item()) for _ in range(20)]
    assert draws_a == draws_b and len(set(draws_a)) > 1


def test_sampling_frequencies_follow_softmax():
    """At temperature 1 with no filter, empirical frequencies track softmax(logits)."""
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    s = make_sampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount([int(s(mx.array(logits)).item()) for _ in range(4000)], minlength=4)
    probs = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert np.abs(counts / 4000 - probs).max() < 0.03


def test_bad_params_rejected():
    from mlxlis.errors import MlxlisError

    for bad in (dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(top_k=-2)):
        with pytest.raises(MlxlisError):
            SamplingParams(**bad).validate()
