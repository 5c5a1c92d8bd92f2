"""Samplers against direct numpy definitions of each filter (reference), and seeding."""

from __future__ import annotations

import math

from mlxlis.errors import MlxlisError
from mlxlis.generation.processors import apply_repetition_penalty
from mlxlis.generation.sampling import (
    SamplingError,
    SamplingParams,
    _min_p,
    _top_k,
    _top_p,
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


# ---------------------------------------------------------------- through make_sampler
#
# The statistical tests below draw N tokens through make_sampler (the engine's path) and compare
# each token's empirical frequency f with its reference probability p from a direct numpy float64
# definition. f is a binomial proportion with standard error sqrt(p(1-p)/N); the per-token bound
# is Z standard errors. At Z = 4.5 a correct sampler breaks one entry's bound with probability
# about 7e-6 (exact binomial tail; at most 5e-5 for the rarest token here, p = 0.002), under 2e-4
# summed over every entry tested here; the draws are seeded, so the outcome is fixed per platform
# anyway and the bound only keeps the chosen seed from being special.

N_DRAWS = 4000
Z = 4.5


def softmax64(logits: np.ndarray) -> np.ndarray:
    """The reference softmax, in float64."""
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def binomial_bound(p: np.ndarray, n: int = N_DRAWS) -> np.ndarray:
    """Z standard errors of the empirical frequency of each token of probability p over n draws."""
    return Z * np.sqrt(p * (1 - p) / n)


def draw(params: SamplingParams, logits: np.ndarray, n: int = N_DRAWS) -> np.ndarray:
    """n tokens drawn one at a time, as the engine does, from (vocab,) logits."""
    sample = make_sampler(params)
    x = mx.array(logits[None].astype(np.float32))
    return np.array([int(sample(x).item()) for _ in range(n)])


def frequencies(tokens: np.ndarray, vocab: int) -> np.ndarray:
    assert tokens.min() >= 0 and tokens.max() < vocab
    return np.bincount(tokens, minlength=vocab) / len(tokens)


TEMP_LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0])


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_frequencies_follow_softmax_of_logits_over_t(temperature: float):
    """At T = 0.5 and 2.0 each token's empirical frequency over N_DRAWS seeded draws lies within
    Z binomial standard errors of softmax(logits / T) (numpy float64). The test discriminates:
    for a sampler computing softmax(logits * T) some token's probability differs from the
    reference by more than both bands together (asserted), so it would fail."""
    p = softmax64(TEMP_LOGITS / temperature)
    wrong = softmax64(TEMP_LOGITS * temperature)
    assert np.any(np.abs(wrong - p) > binomial_bound(p) + binomial_bound(wrong))

    tokens = draw(SamplingParams(temperature=temperature, seed=1), TEMP_LOGITS)
    f = frequencies(tokens, len(TEMP_LOGITS))
    assert np.all(np.abs(f - p) <= binomial_bound(p)), (f, p)


# Six tokens, probabilities 0.394 0.264 0.177 0.080 0.053 0.032 (max-ratios 1 .67 .45 .20 .13
# .08, cumulative mass .39 .66 .83 .91 .97 1): every setting below sits well away from a boundary.
FILTER_LOGITS = np.array([2.0, 1.6, 1.2, 0.4, 0.0, -0.5])


def top_k_set(probs: np.ndarray, k: int) -> set[int]:
    """The k most probable tokens."""
    return set(np.argsort(-probs)[:k].tolist())


def top_p_set(probs: np.ndarray, p: float) -> set[int]:
    """The smallest prefix of tokens by descending probability whose mass reaches p."""
    order = np.argsort(-probs)
    n = int(np.searchsorted(np.cumsum(probs[order]), p) + 1)
    return set(order[:n].tolist())


def min_p_set(probs: np.ndarray, min_p: float) -> set[int]:
    """Tokens whose probability is at least min_p times the top probability."""
    return set(np.flatnonzero(probs >= min_p * probs.max()).tolist())


@pytest.mark.parametrize(
    ("setting", "reference", "size"),
    [
        (dict(top_k=2), lambda probs: top_k_set(probs, 2), 2),
        (dict(top_p=0.75), lambda probs: top_p_set(probs, 0.75), 3),
        (dict(min_p=0.18), lambda probs: min_p_set(probs, 0.18), 4),
    ],
    ids=["top_k", "top_p", "min_p"],
)
def test_filters_through_make_sampler(setting: dict, reference, size: int):
    """Through make_sampler at temperature 1, every drawn token lies in the set the numpy
    definition of the filter keeps, and the frequencies inside it lie within Z binomial standard
    errors of the probabilities renormalised over that set. The set is strictly smaller than the
    vocabulary and the mass outside it is such that an unfiltered sampler would draw outside it
    in N_DRAWS draws with probability > 1 - 1e-12 (asserted), so a skipped filter fails."""
    probs = softmax64(FILTER_LOGITS)
    keep = reference(probs)
    assert len(keep) == size < len(probs)
    inside = np.zeros(len(probs), bool)
    inside[sorted(keep)] = True
    outside_mass = probs[~inside].sum()
    assert (1 - outside_mass) ** N_DRAWS < 1e-12  # P(an unfiltered sampler never leaves the set)

    tokens = draw(SamplingParams(temperature=1.0, seed=2, **setting), FILTER_LOGITS)
    assert set(tokens.tolist()) <= keep
    f = frequencies(tokens, len(probs))
    renormalised = np.where(inside, probs, 0.0) / probs[inside].sum()
    assert np.all(np.abs(f - renormalised) <= binomial_bound(renormalised)), (f, renormalised)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(repetition_context=0), "repetition_context"),  # history[-0:] is all of it
        (dict(seed=2**64), "seed"),  # past MLX's 64-bit key
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_params_rejected(bad: dict, field: str):
    """An out-of-range or wrongly typed parameter raises SamplingError (an MlxlisError) whose
    `.field` names that parameter, both from validate() and from make_sampler (the engine's
    path), never a sampler that silently uses the bad value."""
    assert issubclass(SamplingError, MlxlisError)
    with pytest.raises(SamplingError) as e:
        SamplingParams(**bad).validate()
    assert e.value.field == field
    with pytest.raises(SamplingError) as e:
        make_sampler(SamplingParams(**bad))
    assert e.value.field == field


def test_generate_takes_sampling_params_or_keywords(tiny):
    """generate(model, ids, 64) (the older positional max_tokens) is refused with a TypeError
    that says what to pass; keywords and a SamplingParams both work and agree."""
    import mlxlis

    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    with pytest.raises(TypeError, match="SamplingParams"):
        next(mlxlis.generate(model, [1, 2, 3], 64))
    a = [e.token for e in mlxlis.generate(model, [1, 2, 3], max_tokens=5, stop_ids=set())]
    b = [
        e.token
        for e in mlxlis.generate(model, [1, 2, 3], SamplingParams(max_tokens=5), stop_ids=set())
    ]
    assert a == b and len(a) == 6  # five tokens and the final event
