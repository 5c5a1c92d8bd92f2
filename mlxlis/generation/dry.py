"""DRY ("don't repeat yourself", koboldcpp's, as llama.cpp's llama-sampler.cpp defines it): a
token that would extend a sequence already seen in the last `last_n` tokens of the history
(prompt and reply) by more than `allowed` tokens is penalised by multiplier × base^(length −
allowed), length the longest such repeat it extends. A sequence breaker (text such as "\\n")
stops a repeat there: repeats are measured only after the last breaker, and a token that is a
breaker on its own is never penalised."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Protocol

import mlx.core as mx
import numpy as np

MAX_BREAKER_CHARS = 40  # llama.cpp's bounds: a breaker's characters, its tokenized tail
MAX_TAIL_TOKENS = 20
FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: base^exponent stays finite

# head token -> the tails (token ids after it) that complete a breaker; () a whole breaker
Breakers = Mapping[int, tuple[tuple[int, ...], ...]]


class Vocabulary(Protocol):
    """What DRY reads of a tokenizer to find its breakers' tokens."""

    vocab_size: int

    def token_bytes(self, i: int) -> bytes: ...

    def encode(
        self,
        text: str,
        special: bool = False,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
    ) -> list[int]: ...


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dry_breakers(tokenizer: Vocabulary, texts: Sequence[str]) -> Breakers:
    """The breakers `texts` as tokens: a token whose text holds a breaker is one on its own;
    a token whose text ends with a breaker's beginning is one when the tokens of the rest
    follow it (llama.cpp's reading). Kept per tokenizer."""
    per_tokenizer = _TABLES.setdefault(tokenizer, {})
    key = tuple(texts)
    if key in per_tokenizer:
        return per_tokenizer[key]
    words = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    table: dict[int, list[tuple[int, ...]]] = {}
    for text in texts:
        s = text[:MAX_BREAKER_CHARS].encode()
        for token, word in enumerate(words):
            if s in word:
                table.setdefault(token, []).append(())
                continue
            for pos in range(len(word)):  # the word's tail is the breaker's head
                n = len(word) - pos
                if n < len(s) and word[pos:] == s[:n]:
                    rest = s[n:].decode("utf-8", "ignore")
                    tail = tuple(tokenizer.encode(rest, add_bos=False, add_eos=False))
                    tails = table.setdefault(token, [])
                    if tail[:MAX_TAIL_TOKENS] not in tails:
                        tails.append(tail[:MAX_TAIL_TOKENS])
    out = {k: tuple(v) for k, v in table.items()}
    per_tokenizer[key] = out
    return out


def repeat_lengths(window: Sequence[int], limit: int) -> np.ndarray:
    """For each position i but the last: how many tokens ending at i equal the tokens ending
    the window (the longest common suffix of window[: i + 1] and window), at most `limit`."""
    w = np.asarray(window)
    n = len(w)
    ends = np.arange(n - 1)  # candidate positions
    length = np.zeros(n - 1, np.int64)
    live = np.ones(n - 1, bool)
    for m in range(min(limit, n - 1)):  # compare the m-th token back from each end
        at = ends - m
        ok = live & (at >= 0)
        ok[ok] = w[at[ok]] == w[n - 1 - m]
        length[ok] += 1
        live = ok
        if not live.any():
            break
    return length


class Dry:
    """The DRY penalty (module docstring) as a logits processor."""

    def __init__(
        self, multiplier: float, base: float, allowed: int, last_n: int, breakers: Breakers
    ):
        self.multiplier, self.base, self.allowed = multiplier, base, allowed
        self.last_n, self.breakers = last_n, breakers
        self.max_exponent = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
        self._heads = np.array(sorted(breakers), np.int64)

    def fork(self) -> Dry:
        return self  # holds no state

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        window = list(history if self.last_n < 0 else history[-self.last_n :])
        if len(window) <= self.allowed:
            return logits
        limit = self._limit(window)
        if limit < self.allowed:
            return logits
        lengths = repeat_lengths(window, limit)
        longest: dict[int, int] = {}
        for i in np.flatnonzero(lengths >= self.allowed).tolist():
            token = window[i + 1]  # what followed the earlier occurrence extends the repeat
            longest[token] = max(longest.get(token, 0), int(lengths[i]))
        for token in [t for t in longest if () in self.breakers.get(t, ())]:
            del longest[token]  # a breaker on its own is never penalised
        if not longest:
            return logits
        exponents = [n - self.allowed for n in longest.values()]
        if self.max_exponent > 0:
            exponents = [min(e, self.max_exponent) for e in exponents]
        idx = mx.array(list(longest), mx.int32)
        penalty = mx.array([self.multiplier * self.base**e for e in exponents], mx.float32)
        logits[:, idx] = logits[:, idx] - penalty
        return logits

    def _limit(self, window: list[int]) -> int:
        """How long a repeat may be: the tokens after the last breaker in the window (its
        length when there is none)."""
        n = len(window)
        heads = np.flatnonzero(np.isin(np.asarray(window), self._heads))
        for at in heads[::-1].tolist():  # the breakers' heads, the last first
            back = n - 1 - at  # how far from the end the head is
            longest = -1
            for tail in self.breakers[window[at]]:
                k = len(tail)
                if longest < k <= back and tuple(window[at + 1 : at + 1 + k]) == tail:
                    longest = k
            if longest >= 0:
                return back - longest
        return n
