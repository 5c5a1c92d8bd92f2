"""Sampling outside the model: logits in, one token id out.

Greedy for temperature 0; otherwise temperature, top-k, top-p and min-p filters, then a
categorical draw from an explicit PRNG key so a seed reproduces a run. Filters run on float32
logits and are compiled once per setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    seed: int | None = None

    def validate(self) -> SamplingParams:
        from .errors import MlxlisError

        checks = [
            (self.temperature >= 0, "temperature must be ≥ 0"),
            (self.top_k >= 0, "top_k must be ≥ 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.repetition_context >= 0, "repetition_context must be ≥ 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise MlxlisError(msg, field="sampling")
        return self


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


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """A function (1, vocab) float32 logits -> (1,) int32 token."""
    params.validate()
    if params.temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    key = [mx.random.key(params.seed if params.seed is not None else _fresh_seed())]
    inv_t = 1.0 / params.temperature
    top_p = mx.array(params.top_p, mx.float32)
    min_p = mx.array(params.min_p, mx.float32)

    def sample(logits: mx.array) -> mx.array:
        logits = logits * inv_t
        if params.top_k:
            logits = _top_k(logits, params.top_k)
        if params.top_p < 1.0:
            logits = _top_p(logits, top_p)
        if params.min_p > 0.0:
            logits = _min_p(logits, min_p)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logits, axis=-1, key=sub)

    return sample


def _fresh_seed() -> int:
    import secrets

    return secrets.randbits(31)


def apply_repetition_penalty(logits: mx.array, history: list[int], penalty: float) -> mx.array:
    """CTRL-style penalty: divide positive logits of seen tokens by `penalty`, multiply negative."""
    if penalty == 1.0 or not history:
        return logits
    idx = mx.array(sorted(set(history)), dtype=mx.int32)
    seen = logits[:, idx]
    logits[:, idx] = mx.where(seen > 0, seen / penalty, seen * penalty)
    return logits
