"""Logits processors: per-row changes to a step's logits before sampling (logit bias, the
penalties and DRY here, the chain's head as sampling.py states it; grammar masks and others
plug in the same way). Outside the model, as sampling is: each request keeps a list, applied
in order to its own row."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

from mlxlis.generation.dry import Dry, Vocabulary, dry_breakers
from mlxlis.generation.sampling import SamplingError, SamplingParams, draws_of_its_own

import mlx.core as mx


class LogitsProcessor(Protocol):
    """A processor class subclasses it (or states `fork` itself)."""

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        """(1, vocab) float32 logits -> the changed logits; `history`: the prompt and the
        tokens generated so far, oldest first."""
        ...

    def fork(self) -> LogitsProcessor:
        """A copy that goes on on its own (a drafter's proposals): one with state of its own
        (a grammar mask, a reasoning budget) copies it; one that holds none, by default, is
        itself (shared)."""
        return self


def forked(processors: Sequence[LogitsProcessor]) -> list[LogitsProcessor]:
    """Copies of `processors` for a drafter's proposals (each one's `fork`)."""
    return [p.fork() for p in processors]


def apply_repetition_penalty(logits: mx.array, history: list[int], penalty: float) -> mx.array:
    """CTRL-style penalty: divide positive logits of seen tokens by `penalty`, multiply negative."""
    if penalty == 1.0 or not history:
        return logits
    idx = mx.array(sorted(set(history)), dtype=mx.int32)
    seen = logits[:, idx]
    logits[:, idx] = mx.where(seen > 0, seen / penalty, seen * penalty)
    return logits


class RepetitionPenalty(LogitsProcessor):
    """The penalty over the last `context` tokens of the history."""

    def __init__(self, penalty: float, context: int):
        self.penalty, self.context = penalty, context

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        return apply_repetition_penalty(logits, list(history[-self.context :]), self.penalty)


class VocabularyLimit(LogitsProcessor):
    """Ids at or past the tokenizer's size masked out of every distribution: a checkpoint's
    head is often padded past its tokenizer (Qwen2.5: 151 936 rows for 151 665 tokens), and a
    padded id has no text (sampled at temperature 100 it ended the engine's loop)."""

    def __init__(self, size: int):
        self.size = size
        self._mask: mx.array | None = None  # (1, width): 0 for real ids, -inf past them

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        width = logits.shape[-1]
        if width <= self.size:
            return logits
        if self._mask is None or self._mask.shape[-1] != width:
            real = mx.arange(width) < self.size
            self._mask = mx.where(real, 0.0, -mx.inf).astype(mx.float32)[None]
        return logits + self._mask


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: each listed token's logit plus its bias (-100 bans it in practice,
    100 all but forces it)."""

    def __init__(self, bias: Sequence[tuple[int, float]]):
        self.ids = mx.array([i for i, _ in bias], mx.int32)
        self.bias = mx.array([b for _, b in bias], mx.float32)

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        logits[:, self.ids] = logits[:, self.ids] + self.bias
        return logits


class Penalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (the prompt's do
    not count, as OpenAI defines them): logit[j] −= c[j] × frequency + (c[j] > 0) × presence,
    c[j] the times token j was generated. `start`: where the reply begins in the history (None:
    the history's length at the first call, made on the prompt)."""

    def __init__(self, presence: float, frequency: float, start: int | None = None):
        self.presence, self.frequency, self.start = presence, frequency, start

    def fork(self) -> Penalties:
        """A copy that knows where the reply starts (a drafter's proposals)."""
        return copy.copy(self)

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        if self.start is None:
            self.start = len(history)
        counts: dict[int, int] = {}
        for t in history[self.start :]:
            counts[t] = counts.get(t, 0) + 1
        if not counts:
            return logits
        idx = mx.array(list(counts), mx.int32)
        c = mx.array(list(counts.values()), mx.float32)
        logits[:, idx] = logits[:, idx] - (c * self.frequency + self.presence)
        return logits


def processors_for(
    params: SamplingParams, tokenizer: Vocabulary | None = None
) -> list[LogitsProcessor]:
    """The processors a request's sampling parameters ask for, in the chain's order (logit
    bias, penalties, DRY); DRY reads its sequence breakers through `tokenizer`."""
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        out.append(LogitBias(params.logit_bias))
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(params.repetition_penalty, params.repetition_context))
    if params.presence_penalty or params.frequency_penalty:
        out.append(Penalties(params.presence_penalty, params.frequency_penalty))
    if params.dry_multiplier > 0 and params.dry_penalty_last_n != 0:
        if tokenizer is None:
            raise SamplingError(
                "needs the model's tokenizer (its sequence breakers)", field="dry_multiplier"
            )
        breakers = dry_breakers(tokenizer, params.dry_sequence_breakers)
        out.append(
            Dry(
                params.dry_multiplier,
                params.dry_base,
                params.dry_allowed_length,
                params.dry_penalty_last_n,
                breakers,
            )
        )
    return out


def check(params: SamplingParams, size: int, speculating: bool) -> None:
    """What only a model and its request can tell: logit_bias's ids in the vocabulary
    (check_vocabulary), and no sampler that makes draws of its own (XTC, mirostat) with
    speculative decoding; a SamplingError naming the field otherwise."""
    check_vocabulary(params, size)
    if speculating and (name := draws_of_its_own(params)) is not None:
        why = "not with speculative decoding (it makes draws of its own)"
        raise SamplingError(why, field=name)


def check_vocabulary(params: SamplingParams, size: int) -> None:
    """A SamplingError naming logit_bias when one of its ids is not a token of a vocabulary
    of `size`."""
    for i, _ in params.logit_bias:
        if not 0 <= i < size:
            raise SamplingError(
                f"token id {i} is outside the vocabulary ({size} tokens)", field="logit_bias"
            )


class ReasoningBudget(LogitsProcessor):
    """Ends the reasoning once `budget` tokens were spent in it (Anthropic's
    `thinking.budget_tokens`): from then on the closing tag's tokens are forced, one a step,
    all of them, and the model answers after it. The reasoning opens with the prompt
    (`in_reasoning`) or with the reply's first tokens being `open_ids`; it ends on its own
    where the reply writes `close_ids`, or one of `end_ids` when given (harmony's analysis
    message ends at <|end|>, whatever message follows); tags are matched as token ids."""

    def __init__(
        self,
        budget: int,
        prompt_len: int,
        open_ids: Sequence[int],
        close_ids: Sequence[int],
        in_reasoning: bool,
        end_ids: Sequence[Sequence[int]] = (),
    ):
        self.budget, self.open, self.close = budget, list(open_ids), list(close_ids)
        self.ends = [list(e) for e in end_ids if e] or [self.close]
        self.state = "reasoning" if in_reasoning else "start"
        self.start = self.seen = prompt_len  # history positions: the reply's first, next unread
        self.spent = 0

    def fork(self) -> ReasoningBudget:
        """A copy that counts on its own (a drafter's proposals)."""
        return copy.copy(self)

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        for i in range(self.seen, len(history)):
            self._see(history, i)
        self.seen = len(history)
        if self.state == "reasoning" and self.spent >= self.budget:
            self.state = "closing"  # the closing tag, every token of it
        if self.state != "closing":
            return logits
        tail = list(history[-len(self.close) :]) if self.close else []
        k = max(n for n in range(len(self.close)) if n == 0 or tail[-n:] == self.close[:n])
        forced = (mx.arange(logits.shape[-1]) == self.close[k])[None]  # (1, vocab)
        return mx.where(forced, mx.array(0.0, logits.dtype), mx.array(-mx.inf, logits.dtype))

    def _see(self, history: Sequence[int], i: int) -> None:
        reply = history[self.start : i + 1]
        if self.state == "start":
            if list(reply[-len(self.open) :]) == self.open:
                self.state = "reasoning"
            elif len(reply) >= len(self.open):  # the reply did not open with the tag
                self.state = "answer"
        elif self.state in ("reasoning", "closing"):
            ends = [self.close] if self.state == "closing" else self.ends
            if any(e and list(history[max(self.start, i + 1 - len(e)) : i + 1]) == e for e in ends):
                self.state = "answer"
            elif self.state == "reasoning":
                self.spent += 1
