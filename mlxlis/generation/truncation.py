"""The chain's truncation samplers (sampling.py states their order) and mirostat v2's draw:
each a function of float32 logits (…, vocab), the tokens it drops at -inf, as each sampler's
published definition (and llama.cpp's llama-sampler.cpp) has it."""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx

NEG_INF = float("-inf")


@partial(mx.compile, shapeless=True)
def _top_p(logits: mx.array, top_p: mx.array) -> mx.array:
    # keep the smallest set of tokens whose probability mass reaches top_p
    probs = mx.softmax(logits, axis=-1, precise=True)
    order = mx.argsort(-logits, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, NEG_INF)


@partial(mx.compile, shapeless=True)
def _min_p(logits: mx.array, min_p: mx.array) -> mx.array:
    # drop tokens whose probability is below min_p × the top probability
    threshold = mx.max(logits, axis=-1, keepdims=True) + mx.log(min_p)
    return mx.where(logits >= threshold, logits, NEG_INF)


def _top_k(logits: mx.array, k: int) -> mx.array:
    if k >= logits.shape[-1]:
        return logits
    kth = mx.sort(logits, axis=-1)[..., -k][..., None]
    return mx.where(logits >= kth, logits, NEG_INF)


def _top_n_sigma(logits: mx.array, n: float) -> mx.array:
    # keep tokens within n standard deviations of the top logit (mean and deviation over the
    # finite logits: tokens already dropped do not count)
    finite = logits > NEG_INF
    count = mx.maximum(finite.sum(axis=-1, keepdims=True), 1)
    mean = mx.where(finite, logits, 0.0).sum(axis=-1, keepdims=True) / count
    var = mx.where(finite, (logits - mean) ** 2, 0.0).sum(axis=-1, keepdims=True) / count
    top = mx.max(logits, axis=-1, keepdims=True)
    return mx.where(logits >= top - n * mx.sqrt(var), logits, NEG_INF)


def _typical(logits: mx.array, p: float) -> mx.array:
    # locally typical sampling: tokens by |−log p − entropy|, the closest first, kept until
    # their mass passes p (the one that passes it kept too)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = mx.exp(logp)
    entropy = -mx.where(probs > 0, probs * logp, 0.0).sum(axis=-1, keepdims=True)
    order = mx.argsort(mx.abs(-logp - entropy), axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) <= p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, NEG_INF)


def _xtc(logits: mx.array, threshold: float, fire: mx.array) -> mx.array:
    # exclude top choices: when `fire`, every token at or above `threshold` probability but
    # the least probable of them goes (nothing goes when fewer than two reach it)
    probs = mx.softmax(logits, axis=-1, precise=True)
    above = probs >= threshold
    least = mx.min(mx.where(above, logits, mx.inf), axis=-1, keepdims=True)
    drop = above & (logits > least) & fire
    return mx.where(drop, NEG_INF, logits)


LN2 = math.log(2.0)


class Mirostat:
    """Mirostat v2 (Basu et al. 2021, as llama.cpp's): tokens whose surprise −log2 p exceeds
    mu dropped (the top one always kept), a draw from the rest, then mu moved by eta towards
    the target surprise tau: mu −= eta (surprise of the drawn token − tau); mu starts at 2 tau.
    mu stays an array: no step waits on it."""

    def __init__(self, tau: float, eta: float):
        self.tau, self.eta = tau, eta
        self.mu = mx.array([2.0 * tau], mx.float32)

    def __call__(self, logits: mx.array, key: mx.array) -> mx.array:
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.argmax(logits, axis=-1, keepdims=True)
        first = mx.arange(logits.shape[-1]) == top
        kept = mx.where((-logp / LN2 <= self.mu[:, None]) | first, logits, NEG_INF)
        token = mx.random.categorical(kept, axis=-1, key=key)
        logq = kept - mx.logsumexp(kept, axis=-1, keepdims=True)
        surprise = -mx.take_along_axis(logq, token[:, None], axis=-1)[:, 0] / LN2
        self.mu = self.mu - self.eta * (surprise - self.tau)
        return token
