"""What a drafter hands the generation core (speculative.py re-exports both names; drafters
in modules of their own import them from here)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxlis.errors import MlxlisError

import mlx.core as mx


class SpeculativeError(MlxlisError):
    """Speculative decoding cannot run as asked (a draft model of another vocabulary, …)."""


@dataclass
class Proposal:
    """What a drafter proposes after the sequence so far."""

    tokens: list[int]
    q: mx.array | None = None  # (len(tokens), vocab) the drafter's probabilities; None: point
