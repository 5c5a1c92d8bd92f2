"""Speculative decoding, the longer proofs (`make test-all`): the real pair, and sampling's
distribution through the whole core.

- Greedy identity on the real pair: Qwen2.5-Coder-0.5B-Instruct drafting for
  Qwen2.5-Coder-1.5B-Instruct (both Q4_K_M GGUF, catalog), and prompt lookup on an edit of a
  file given in the prompt: 160 tokens each, token for token the plain greedy output (plain
  decoding is tied to llama.cpp and transformers by the parity tests).
- Sampling (temperature 1, top-p 0.9) with a draft model that disagrees: the distribution of
  the first token speculation decides (the second of the reply: the first comes from the
  prompt's forward) equals the target's own, Σ over the first token of p(t0) p(t1 | t0),
  computed exactly from the target's logits (numpy float64), within binomial bounds.
"""

from __future__ import annotations

import mlxlis
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.core import Core, Request
from mlxlis.generation.generate import run
from mlxlis.generation.sampling import SamplingParams, make_filter
from mlxlis.generation.speculative import Speculation
from mlxlis.generation.steps import prefill, steps_for

import mlx.core as mx
import numpy as np
import pytest
from conftest import need_pulled, trajectory
from test_sampling import binomial_bound, softmax64

pytestmark = pytest.mark.extended

FILE = "\n".join(
    f"def step_{i}(values, scale={i}):\n    return [v * scale + {i} for v in values]\n"
    for i in range(8)
)


def tokens(model, ids, spec=None, n=160, **params):
    core = Core(model, steps_for(model, PrefixCache(0)))
    req = Request(list(ids), SamplingParams(max_tokens=n, **params), frozenset(), speculation=spec)
    seq = core.start(req)
    return [e.token for e in run(core, seq) if e.token is not None], seq.usage


def chat_ids(model, text: str) -> list[int]:
    prompt = model.render_chat([{"role": "user", "content": text}])
    return model.tokenizer.encode(prompt, special=True)


def test_the_real_pair_and_prompt_lookup_give_the_plain_greedy_tokens():
    target = mlxlis.load(need_pulled("qwen2.5-coder-1.5b"))
    draft = mlxlis.load(need_pulled("qwen2.5-coder-0.5b"))
    code = chat_ids(target, "Write a Python function that merges two sorted lists.")
    plain, _ = tokens(target, code)
    got, usage = tokens(target, code, Speculation("draft", draft, tokens=4))
    assert got == plain
    assert usage.accepted_tokens > usage.draft_tokens // 4, usage  # the pair does agree
    edit = chat_ids(target, f"Rename `values` to `items` in this code:\n\n{FILE}")
    plain, _ = tokens(target, edit)
    got, usage = tokens(target, edit, Speculation("ngram", tokens=6))
    assert got == plain
    assert usage.accepted_tokens > usage.draft_tokens // 4, usage  # the reply copies the file


N = 3000
BINS = 16


def test_sampled_speculation_keeps_the_targets_distribution(tiny, tmp_path):
    """N seeded runs of 2 tokens with a draft model (another tiny network): the second
    token's frequencies, over 16 bins of equal target mass, within Z binomial standard errors
    of the target's own marginal; the draft's marginal is far outside them (the test tells
    the two apart: a verdict without the ratio test would give the draft's)."""
    target = mlxlis.load(tiny("llama")[0], "float32")
    draft = mlxlis.load(tiny("llama3_tied")[0], "float32")
    vocab = target.config.vocab_size
    prompt = trajectory(6, seed=21, vocab=vocab)
    params = dict(temperature=1.0, top_p=0.9)
    filtered = make_filter(SamplingParams(**params))

    def marginal(model) -> np.ndarray:
        """Σ_t0 p(t0) p(t1 | t0) of `model`'s filtered distributions (float64)."""
        cache = model.make_cache()
        first = np.array(mx.softmax(filtered(prefill(model.net, prompt, cache)))[0], np.float64)
        out = np.zeros(vocab)
        for t0 in np.flatnonzero(first > 0):
            c = model.make_cache()
            logits = filtered(prefill(model.net, [*prompt, int(t0)], c))
            out += first[t0] * softmax64(np.array(logits[0], np.float64))
        return out

    want, wrong = marginal(target), marginal(draft)
    seen = []
    for seed in range(N):
        spec = Speculation("draft", draft, tokens=2)
        got, _ = tokens(target, prompt, spec, n=2, seed=seed, **params)
        seen.append(got[1])
    # 16 bins of about equal target mass (tokens by decreasing probability): most tokens
    # are too rare (p·N < 1) for a per-token binomial bound; each bin's is sound
    order = np.argsort(-want)
    bins = np.zeros(vocab, int)
    bins[order] = np.minimum((np.cumsum(want[order]) - want[order]) * BINS, BINS - 1).astype(int)
    mass = lambda p: np.bincount(bins, weights=p, minlength=BINS)  # noqa: E731
    f = mass(np.bincount(seen, minlength=vocab) / N)
    w, q = mass(want), mass(wrong)
    assert np.all(np.abs(f - w) <= binomial_bound(w, N)), (f, w)
    assert np.any(np.abs(q - w) > binomial_bound(w, N) + binomial_bound(q, N)), (q, w)
