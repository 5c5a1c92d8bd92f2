"""Rank 0 leads, the other ranks follow: each pipelined generation starts with rank 0's call
(prompt ids, sampling, stop ids, repetition history, where its caches stand) broadcast to every
rank, so an app that runs on rank 0 alone (`mlxlis chat` under mlx.launch) drives them all.

The other ranks either call `generate` with the same arguments (the one-shot command: every
rank runs it, rank 0's call wins) or sit in `follow`, running each call rank 0 announces until
it announces the end. Their caches follow rank 0's: a fresh one when rank 0 starts from
nothing, else trimmed back to the position rank 0's caches hold (the chat's reuse of a shared
prompt prefix, cache.rewind).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..cache import rewind
from ..errors import PipelineError
from ..sampling import SamplingParams
from .group import Ranks


@dataclass
class Call:
    """One generation as rank 0 asked for it."""

    ids: list[int]
    params: SamplingParams
    stops: Sequence[int]
    history: list[int]  # the tokens before `ids` the repetition penalty sees
    before: int  # positions rank 0's caches hold when it starts (0: fresh caches)

    def encode(self) -> bytes:
        return json.dumps({"ids": self.ids, "params": self.params.as_dict(),
                           "stops": list(self.stops), "history": self.history,
                           "before": self.before}).encode()  # fmt: skip

    @classmethod
    def decode(cls, raw: bytes) -> Call:
        d = json.loads(raw)
        return cls(d["ids"], SamplingParams(**d["params"]), d["stops"], d["history"],
                   d["before"])  # fmt: skip


def announce(ranks: Ranks, call: Call | None) -> Call | None:
    """Rank 0's `call` on every rank (None: the end of `follow`). Collective and untimed: a
    follower waits as long as rank 0's user takes to ask."""
    raw = ranks.broadcast(call.encode() if call is not None and ranks.rank == 0 else b"")
    return Call.decode(raw) if raw else None


def align(model, cache: list | None, before: int) -> list:
    """This rank's caches holding the `before` positions rank 0's hold: fresh ones for 0, else
    `cache` trimmed back (a PipelineError when its layers cannot return there exactly)."""
    if before == 0 or cache is None:
        if before:
            raise PipelineError(f"rank 0 continues from position {before} but this rank has "
                                "no caches", field="cache")  # fmt: skip
        return model.make_cache()
    held = cache[0].offset if cache else 0
    if held == before:
        return cache
    if held < before or rewind(cache, held, before) != before:
        raise PipelineError(
            f"rank 0 continues from position {before}, which this rank's caches (at {held}) "
            "cannot return to exactly", field="cache"
        )
    return cache


def follow(model) -> None:
    """A rank other than 0 while rank 0 runs the app: run each generation it announces, on
    caches kept between them, until it announces the end (`finish`)."""
    from ..generate import pipelined

    ranks = model.net.ranks
    cache = None
    while (call := announce(ranks, None)) is not None:
        cache = align(model, cache, call.before)
        for _ in pipelined(model, call, cache):
            pass


def finish(ranks: Ranks | None) -> None:
    """Rank 0: tell the followers there is nothing more to generate."""
    if ranks is not None and ranks.rank == 0:
        announce(ranks, None)
