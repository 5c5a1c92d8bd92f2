"""The samplers issue 56 adds (presence / frequency penalties, logit bias, DRY, XTC,
top-n-sigma, typical-p, mirostat v2) against two independent references: the numbers
llama.cpp's own tests (tests/test-sampling.cpp, 0.3.36's vendored llama.cpp) assert for its
implementation, and numpy float64 definitions of each sampler as published, checked on the
processed logits and, for the random ones, on many seeded draws with binomial bounds (as
tests/test_sampling.py does)."""

from __future__ import annotations

import math

from mlxlis.generation.dry import Dry, dry_breakers, repeat_lengths
from mlxlis.generation.processors import (
    LogitBias,
    Penalties,
    RepetitionPenalty,
    check_vocabulary,
    processors_for,
)
from mlxlis.generation.sampling import (
    SamplingError,
    SamplingParams,
    make_filter,
    make_sampler,
)
from mlxlis.generation.truncation import Mirostat, _top_n_sigma, _typical, _xtc

import mlx.core as mx
import numpy as np
import pytest

N_DRAWS = 3000
Z = 4.5  # per-entry bound: a correct sampler breaks it with probability ~7e-6


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def bound(p: np.ndarray, n: int = N_DRAWS) -> np.ndarray:
    return Z * np.sqrt(p * (1 - p) / n)


def row(values) -> mx.array:
    return mx.array(np.asarray(values, np.float32)[None])


def probs_after(process, logits) -> np.ndarray:
    return softmax64(np.array(process(row(logits)))[0])


# ------------------------------------------------ llama.cpp's test-sampling.cpp numbers


@pytest.mark.parametrize(
    ("probs", "threshold", "kept"),
    [
        ([0.4, 0.3, 0.2, 0.1], 0.09, [0.1]),
        ([0.4, 0.3, 0.2, 0.1], 0.19, [0.2, 0.1]),
        ([0.4, 0.3, 0.2, 0.1], 0.29, [0.3, 0.2, 0.1]),
        ([0.4, 0.3, 0.2, 0.1], 0.39, [0.4, 0.3, 0.2, 0.1]),
    ],
)
def test_xtc_matches_llama_cpp(probs, threshold, kept):
    """XTC when it fires keeps exactly the tokens llama.cpp's test keeps: of those at or above
    the threshold only the least probable stays (0.39: one token reaches it, nothing goes)."""
    out = np.array(_xtc(row(np.log(probs)), threshold, mx.array(True)))[0]
    left = sorted((p for p, x in zip(probs, out, strict=True) if np.isfinite(x)), reverse=True)
    np.testing.assert_allclose(left, kept)
    same = np.array(_xtc(row(np.log(probs)), threshold, mx.array(False)))[0]
    assert np.isfinite(same).all()  # the coin said no: nothing goes


@pytest.mark.parametrize(
    ("probs", "p", "kept"),
    [([0.97, 0.01, 0.01, 0.01], 0.5, [0.97]), ([0.4, 0.2, 0.2, 0.2], 0.5, [0.2, 0.2, 0.2])],
)
def test_typical_matches_llama_cpp(probs, p, kept):
    """Typical-p keeps llama.cpp's test's tokens (for [.4 .2 .2 .2] the three of probability
    .2, closest to the entropy, not the most probable one)."""
    out = np.array(_typical(row(np.log(probs)), p))[0]
    left = sorted((q for q, x in zip(probs, out, strict=True) if np.isfinite(x)), reverse=True)
    np.testing.assert_allclose(left, kept)


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1.0, [0.0, 0.0, 0.428571, 0.571429]), (3.0, [0.1, 0.2, 0.3, 0.4])],
)
def test_top_n_sigma_matches_llama_cpp(n, expected):
    """Top-n-sigma on log([.1 .2 .3 .4]) gives llama.cpp's test's distribution."""
    got = probs_after(lambda x: _top_n_sigma(x, n), np.log([0.1, 0.2, 0.3, 0.4]))
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize(
    ("last", "expected", "repeat", "freq", "presence"),
    [
        ([0], [0, 0.25, 0.25, 0.25, 0.25], 50.0, 0.0, 0.0),
        ([0, 1, 2], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
        ([0], [0.000011, 0.249997, 0.249997, 0.249997, 0.249997], 1.0, 5.0, 5.0),
        ([0, 1, 2], [0.000023, 0.000023, 0.000023, 0.499966, 0.499966], 1.0, 5.0, 5.0),
        ([0, 1, 2, 0, 0], [0.0, 0.000023, 0.000023, 0.499977, 0.499977], 1.0, 5.0, 5.0),
    ],
)
def test_penalties_match_llama_cpp(last, expected, repeat, freq, presence):
    """Repetition, frequency and presence penalties over llama.cpp's test's last tokens give
    its distributions (all of them counted: the reply starts at 0)."""
    logits = np.log(np.full(5, 0.2))

    def both(x: mx.array) -> mx.array:
        x = RepetitionPenalty(repeat, len(last))(x, last) if repeat != 1.0 else x
        return Penalties(presence, freq, start=0)(x, last)

    np.testing.assert_allclose(probs_after(both, logits), expected, atol=1e-5)


@pytest.mark.parametrize(
    ("probs", "last", "expected", "mult", "allowed", "last_n", "breakers"),
    [
        ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 2, 4, {}),
        ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 2, 5, {}),
        ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 2, 6, {3: ((),)}),
        (
            [0.2] * 5,
            [0, 1, 2, 0, 1],
            [0.241818, 0.241818, 0.032727, 0.241818, 0.241818],
            2.0,
            2,
            5,
            {},
        ),
        ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 4, 7, {}),
    ],
)
def test_dry_matches_llama_cpp(probs, last, expected, mult, allowed, last_n, breakers):
    """DRY (base 1.1) gives llama.cpp's test's distributions: "0 1" seen before "2" pushes
    "2" down; a breaker token (3) between them, or an allowed length of 4, does not."""
    dry = Dry(mult, 1.1, allowed, last_n, breakers)
    got = probs_after(lambda x: dry(x, last), np.log(probs))
    np.testing.assert_allclose(got, expected, atol=1e-5)


# ------------------------------------------------ numpy definitions


def test_dry_repeat_lengths_match_the_definition():
    """Each position's repeat length is the longest common suffix of the window up to it and
    the whole window (brute force in numpy), capped at the limit, on a random window with
    repeats."""
    rng = np.random.default_rng(3)
    w = rng.integers(0, 3, 60).tolist()
    for limit in (2, 5, 60):
        ref = []
        for i in range(len(w) - 1):
            n = 0
            while n <= i and w[i - n] == w[-1 - n]:
                n += 1
            ref.append(min(n, limit))
        assert repeat_lengths(w, limit).tolist() == ref


def test_dry_penalty_matches_the_definition():
    """On a random history: every token that follows an earlier occurrence of a suffix of
    length L >= allowed gets −multiplier × base^(L − allowed) for its longest L, others
    nothing (numpy brute force)."""
    rng = np.random.default_rng(4)
    hist = rng.integers(0, 4, 40).tolist()
    logits = rng.normal(size=8).astype(np.float32)
    mult, base, allowed = 0.8, 1.75, 2
    ref = logits.astype(np.float64).copy()
    longest: dict[int, int] = {}
    for i in range(len(hist) - 1):
        n = 0
        while n <= i and hist[i - n] == hist[-1 - n]:
            n += 1
        if n >= allowed:
            longest[hist[i + 1]] = max(longest.get(hist[i + 1], 0), n)
    for t, n in longest.items():
        ref[t] -= mult * base ** (n - allowed)
    assert longest  # the history has repeats to penalise
    got = np.array(Dry(mult, base, allowed, -1, {})(row(logits), hist))[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5)


class WordVocabulary:
    """A vocabulary of whole words, encoded greedily longest first (DRY's Vocabulary)."""

    WORDS = [b"a", b"b", b"\n", b"x\ny", b"ca", b"ab", b"q", b"cab", b"bb"]
    vocab_size = len(WORDS)

    def token_bytes(self, i: int) -> bytes:
        return self.WORDS[i]

    def encode(self, text: str, special: bool = False, add_bos=None, add_eos=None) -> list[int]:
        data, out = text.encode(), []
        while data:
            i = max(
                (i for i, w in enumerate(self.WORDS) if data.startswith(w)),
                key=lambda i: len(self.WORDS[i]),
            )
            out.append(i)
            data = data[len(self.WORDS[i]) :]
        return out


def test_dry_breakers_read_from_the_tokenizer():
    """The breakers as tokens, as llama.cpp reads them: every token whose text holds a breaker
    is one on its own; one whose text ends with a breaker's beginning is one when the tokens
    of the breaker's rest follow it."""
    vocab = WordVocabulary()
    table = dry_breakers(vocab, ("\n", "abb"))
    heads = {}
    for i, word in enumerate(vocab.WORDS):
        if b"\n" in word or b"abb" in word:
            heads[i] = ((),)
        else:
            tails = tuple(
                tuple(vocab.encode("abb"[n:])) for n in range(1, 3) if word.endswith(b"abb"[:n])
            )
            if tails:
                heads[i] = tails
    assert table == heads
    assert table[0] == table[4] == ((8,),) and table[5] == ((1,),)  # a·bb, ca·bb, ab·b


def test_presence_frequency_count_the_reply_only():
    """OpenAI's definition: logit[j] −= c[j]·frequency + (c[j] > 0)·presence, c counting the
    generated tokens only; the prompt's tokens (before `start`, learnt at the first call) are
    not counted."""
    logits = np.random.default_rng(5).normal(size=6).astype(np.float32)
    prompt, reply = [1, 1, 2], [2, 3, 3, 3]
    pen = Penalties(0.5, 0.3)
    pen(row(logits), prompt)  # the first call: the history is the prompt
    got = np.array(pen(row(logits), prompt + reply))[0]
    ref = logits.astype(np.float64).copy()
    for j in set(reply):
        c = reply.count(j)
        ref[j] -= c * 0.3 + 0.5
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_logit_bias_adds_to_its_ids_and_checks_the_vocabulary():
    """Each listed id's logit plus its bias, every other unchanged; an id past the vocabulary
    is a SamplingError naming logit_bias."""
    logits = np.random.default_rng(6).normal(size=6).astype(np.float32)
    params = SamplingParams(logit_bias={"4": -100, 1: 2.5})
    assert params.logit_bias == ((1, 2.5), (4, -100))
    (bias,) = processors_for(params)
    assert isinstance(bias, LogitBias)
    ref = logits.copy()
    ref[1] += 2.5
    ref[4] -= 100
    np.testing.assert_allclose(np.array(bias(row(logits), []))[0], ref, rtol=1e-6)
    with pytest.raises(SamplingError) as e:
        check_vocabulary(SamplingParams(logit_bias=((6, 1.0),)), 6)
    assert e.value.field == "logit_bias"


LOGITS = np.array([2.0, 1.6, 1.2, 0.4, 0.0, -0.5, -1.5, -3.0])


def typical_set(probs: np.ndarray, p: float) -> set[int]:
    """Locally typical: by |−log p − H| ascending, until the mass passes p (inclusive)."""
    h = -(probs * np.log(probs)).sum()
    order = np.argsort(np.abs(-np.log(probs) - h), kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    return set(order[before <= p].tolist())


def sigma_set(logits: np.ndarray, n: float) -> set[int]:
    return set(np.flatnonzero(logits >= logits.max() - n * logits.std()).tolist())


def top_p_set(probs: np.ndarray, p: float) -> set[int]:
    order = np.argsort(-probs)
    return set(order[: int(np.searchsorted(np.cumsum(probs[order]), p) + 1)].tolist())


T = 2.0  # a temperature at which typical-p's and top-p's sets differ from those at 1


@pytest.mark.parametrize(
    ("setting", "keep", "at_t"),
    [
        (
            dict(typical_p=0.6),
            typical_set(softmax64(LOGITS), 0.6),
            typical_set(softmax64(LOGITS / T), 0.6),
        ),
        (dict(top_p=0.8), top_p_set(softmax64(LOGITS), 0.8), top_p_set(softmax64(LOGITS / T), 0.8)),
        (dict(top_n_sigma=1.0), sigma_set(LOGITS, 1.0), None),  # scale-free: the same at T
    ],
    ids=["typical_p", "top_p", "top_n_sigma"],
)
def test_filter_draws_follow_the_definition(setting, keep, at_t):
    """N seeded draws from make_filter's logits at temperature 2 fall in the numpy set and
    follow softmax(logits / T) renormalised over it within Z binomial errors. Temperature
    comes last, as in llama.cpp's chain: the set is taken at T = 1 (for typical-p and top-p
    the set at T = 2 is larger, asserted, so a filter applied after temperature fails)."""
    assert 1 < len(keep) < len(LOGITS)
    assert at_t is None or at_t > keep
    filtered = make_filter(SamplingParams(temperature=T, **setting))(row(LOGITS))
    draws = np.array(mx.random.categorical(filtered, num_samples=N_DRAWS, key=mx.random.key(0)))
    inside = np.isin(np.arange(len(LOGITS)), sorted(keep))
    ref = np.where(inside, softmax64(LOGITS / T), 0)
    ref /= ref.sum()
    f = np.bincount(draws[0], minlength=len(LOGITS)) / N_DRAWS
    assert set(draws[0].tolist()) <= keep
    assert np.all(np.abs(f - ref) <= bound(ref)), (f, ref)


def test_xtc_draws_are_the_mixture():
    """Through make_sampler, XTC (probability .5, threshold .15) at temperature 1 draws from
    .5 × softmax + .5 × softmax without the tokens at or above .15 but the least of them,
    within Z binomial errors."""
    p = softmax64(LOGITS)
    above = np.flatnonzero(p >= 0.15)
    assert len(above) >= 2
    cut = p.copy()
    cut[above[p[above] > p[above].min()]] = 0
    ref = 0.5 * p + 0.5 * cut / cut.sum()
    params = SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.15, seed=3)
    sample = make_sampler(params)
    x = row(LOGITS)
    draws = np.array([int(sample(x).item()) for _ in range(N_DRAWS)])
    f = np.bincount(draws, minlength=len(LOGITS)) / N_DRAWS
    assert np.all(np.abs(f - ref) <= bound(ref)), (f, ref)


def test_xtc_moves_greedy():
    """At temperature 0 XTC that always fires (probability 1) picks the least probable token
    at or above the threshold, as llama.cpp's chain (XTC, then temperature 0) does."""
    p = softmax64(LOGITS)
    params = SamplingParams(temperature=0.0, xtc_probability=1.0, xtc_threshold=0.15, seed=0)
    token = int(make_sampler(params)(row(LOGITS)).item())
    assert token == int(np.flatnonzero(p >= 0.15)[-1])


def test_mirostat_v2_follows_its_definition():
    """Mirostat v2 against a numpy run of its definition on the tokens it drew: each drawn
    token lies in {−log2 p ≤ mu} ∪ {top}; mu starts at 2τ and moves by −η(surprise − τ), the
    surprise under the renormalised kept distribution; and the first step's draws (fresh
    states) follow that truncated distribution within Z binomial errors."""
    tau, eta = 1.5, 0.3
    m = Mirostat(tau, eta)
    key = mx.random.key(7)
    mu = 2 * tau
    p = softmax64(LOGITS)
    for _ in range(40):
        key, sub = mx.random.split(key)
        token = int(m(row(LOGITS), sub).item())
        kept = (-np.log2(p) <= mu) | (np.arange(len(p)) == p.argmax())
        assert kept[token]
        q = np.where(kept, p, 0) / p[kept].sum()
        mu -= eta * (-math.log2(q[token]) - tau)
        assert abs(float(m.mu.item()) - mu) <= 1e-4 * max(1, abs(mu))
    kept = -np.log2(p) <= 2 * tau
    ref = np.where(kept, p, 0) / p[kept].sum()
    assert 1 < kept.sum() < len(p)
    keys = mx.random.split(mx.random.key(8), N_DRAWS)
    draws = np.array([int(Mirostat(tau, eta)(row(LOGITS), k).item()) for k in keys])
    f = np.bincount(draws, minlength=len(p)) / N_DRAWS
    assert np.all(np.abs(f - ref) <= bound(ref)), (f, ref)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logit_bias=((1, 101.0),)), "logit_bias"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias"),
        (dict(mirostat=1), "mirostat"),
        (dict(xtc_threshold=0.6), "xtc_threshold"),
        (dict(typical_p=0), "typical_p"),
        (dict(top_n_sigma=-1), "top_n_sigma"),
        (dict(dry_base=0.5), "dry_base"),
        (dict(dry_sequence_breakers=("",)), "dry_sequence_breakers"),
    ],
)
def test_bad_new_params_are_refused_by_name(bad, field):
    """Out of range (mirostat 1: not implemented) is a SamplingError naming the field."""
    with pytest.raises(SamplingError) as e:
        SamplingParams(**bad).validate()
    assert e.value.field == field


def test_params_text_and_aliases():
    """The chat app's /params text sets the new fields, llama.cpp's and Ollama's names too."""
    text = "repeat_last_n=32 typ_p=0.9 logit_bias=5:-100,2:1.5 mirostat=2"
    p = SamplingParams().with_text(text + ' dry_sequence_breakers=["\\n"]')
    assert (p.repetition_context, p.typical_p, p.mirostat) == (32, 0.9, 2)
    assert p.logit_bias == ((2, 1.5), (5, -100.0)) and p.dry_sequence_breakers == ("\n",)


@pytest.mark.parametrize(
    ("setting", "field"),
    [(dict(xtc_probability=0.5), "xtc_probability"), (dict(mirostat=2), "mirostat")],
)
def test_samplers_with_draws_of_their_own_have_no_fixed_filter(setting, field):
    """XTC's coin and mirostat's state are no fixed filter of the logits: the filter a
    speculative ratio test reads (make_filter) is refused naming the field, never built
    without them (the core refuses such a request with speculation the same way)."""
    with pytest.raises(SamplingError) as e:
        make_filter(SamplingParams(temperature=1.0, **setting))
    assert e.value.field == field


def test_core_refuses_xtc_with_speculation_and_checks_the_bias(tiny):
    """Through the library's generate on the tiny Llama: XTC with speculative decoding is a
    SamplingError naming xtc_probability, a logit_bias id past the vocabulary one naming
    logit_bias, and DRY runs with the model's tokenizer's breakers."""
    import mlxlis
    from mlxlis.generation.speculative import Speculation

    model = mlxlis.load(tiny("llama")[0], "float32")
    ids = [1, 2, 3, 4]
    with pytest.raises(SamplingError) as e:
        list(
            mlxlis.generate(
                model, ids, temperature=1.0, xtc_probability=0.5, speculation=Speculation("ngram")
            )
        )
    assert e.value.field == "xtc_probability"
    with pytest.raises(SamplingError) as e:
        list(mlxlis.generate(model, ids, logit_bias={model.tokenizer.vocab_size: 1.0}))
    assert e.value.field == "logit_bias"
    out = list(mlxlis.generate(model, ids, max_tokens=4, dry_multiplier=1.0, stop_ids=set()))
    assert len(out) == 5
