"""Logits processors: per-row changes to a step's logits before sampling (the repetition
penalty here; grammar masks and others plug in the same way). Outside the model, as sampling
is: each request keeps a list, applied in order to its own row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mlxlis.generation.sampling import SamplingParams

import mlx.core as mx


class LogitsProcessor(Protocol):
    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        """(1, vocab) float32 logits -> the changed logits; `history`: the prompt and the
        tokens generated so far, oldest first."""
        ...


def apply_repetition_penalty(logits: mx.array, history: list[int], penalty: float) -> mx.array:
    """CTRL-style penalty: divide positive logits of seen tokens by `penalty`, multiply negative."""
    if penalty == 1.0 or not history:
        return logits
    idx = mx.array(sorted(set(history)), dtype=mx.int32)
    seen = logits[:, idx]
    logits[:, idx] = mx.where(seen > 0, seen / penalty, seen * penalty)
    return logits


class RepetitionPenalty:
    """The penalty over the last `context` tokens of the history."""

    def __init__(self, penalty: float, context: int):
        self.penalty, self.context = penalty, context

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        return apply_repetition_penalty(logits, list(history[-self.context :]), self.penalty)


def processors_for(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors a request's sampling parameters ask for, in the order they apply."""
    if params.repetition_penalty == 1.0:
        return []
    return [RepetitionPenalty(params.repetition_penalty, params.repetition_context)]
