"""What a drafter is to the generation core (Drafter), what it hands the core and how it
picks each proposal (speculative.py re-exports the names; drafters in modules of their own
import them from here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mlxlis.errors import MlxlisError
from mlxlis.generation.processors import LogitsProcessor
from mlxlis.generation.sampling import SamplingParams, make_filter, make_key

import mlx.core as mx


class SpeculativeError(MlxlisError):
    """Speculative decoding cannot run as asked (a draft model of another vocabulary, …)."""


@dataclass
class Proposal:
    """What a drafter proposes after the sequence so far."""

    tokens: list[int]
    q: mx.array | None = None  # (len(tokens), vocab) the drafter's probabilities; None: point


class Drafter(Protocol):
    """Proposes the tokens a speculating sequence's verification checks. A drafter class
    subclasses it, stating `wants_hidden`; `prepare` and `feed_hidden` do nothing unless it
    has something to read there."""

    wants_hidden: bool  # whether the core hands it the target's hidden states (feed_hidden)

    def propose(self, history: Sequence[int], k: int) -> Proposal:
        """Up to `k` tokens to follow `history` (the prompt and every token so far)."""
        ...

    def prepare(self, prompt: Sequence[int]) -> None:
        """Read the prompt while the target's first token is on its way (the request's time
        to first token, not its decoding, pays for it)."""

    def feed_hidden(self, ids: Sequence[int], hidden: mx.array) -> None:
        """The target's last-layer outputs (len(ids), hidden), before its final norm, for the
        positions of `ids` (in order, every position of the sequence exactly once: the prompt's
        chunks, then each verification's kept positions); handed only where `wants_hidden`."""


class Picker:
    """How a drafter picks each proposal: its processors on the logits, then the argmax for a
    greedy request, else a draw from the same filtered distribution plain sampling uses, its
    probabilities kept (the q of the ratio test), from a PRNG stream of its own."""

    def __init__(self, params: SamplingParams):
        self.filtered = None if params.temperature == 0 else make_filter(params)
        self.key = make_key(params, stream=1)  # independent of the target's sampler
        self.qs: list[mx.array] = []

    def __call__(
        self, logits: mx.array, history: Sequence[int], processors: Sequence[LogitsProcessor]
    ) -> int:
        """The next proposal after `history` from (1, vocab) float32 `logits`."""
        for process in processors:
            logits = process(logits, history)
        if self.filtered is None:
            return int(mx.argmax(logits, axis=-1).item())
        f = self.filtered(logits)
        self.key, sub = mx.random.split(self.key)
        self.qs.append(mx.softmax(f, axis=-1, precise=True))
        return int(mx.random.categorical(f, axis=-1, key=sub).item())

    def proposal(self, tokens: list[int]) -> Proposal:
        """The proposal of `tokens` picked since the last one (their q, when sampled)."""
        q = mx.concatenate(self.qs) if self.qs else None
        self.qs = []
        return Proposal(tokens, q)
