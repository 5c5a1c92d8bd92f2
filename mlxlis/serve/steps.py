"""The serving engine's model work: where each request's caches live and how a step runs.

The engine decides what runs (engine.py); a Steps object runs it. `LocalSteps` keeps every
cache in this process. Under mlx.launch rank 0's engine uses `distributed.serving.LeaderSteps`
instead, which tells the other ranks each step before running its own share of it.

A step's `kind`: "chunk" (part of a prompt with more to come: nothing comes back), "prompt"
(the prompt's last chunk: the first token's logits), "decode" (one token per sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..cache import snapshot
from .prefix import PrefixCache


class LocalSteps:
    """Every request's caches in this process; finished ones go to the prefix cache."""

    def __init__(self, model, prefix: PrefixCache):
        self.model = model
        self.prefix = prefix

    @property
    def batches(self) -> bool:
        """Whether the network decodes several sequences in one pass."""
        return hasattr(self.model.net, "decode_batch")

    def admit(self, rid: int, ids: list[int]) -> tuple[list, int]:
        """Caches for request `rid` whose prompt is `ids`: the prefix cache's longest match
        rewound to the shared prefix, else fresh ones; and how many ids they hold."""
        caches, reused = self.prefix.take(ids)
        return (caches, reused) if caches is not None else (self.model.make_cache(), 0)

    def run(self, rids: Sequence[int], caches: Sequence[list], tokens: Sequence[Sequence[int]],
            kind: str) -> mx.array | None:  # fmt: skip
        """Feed `tokens[i]` to request `rids[i]` (one sequence unless decoding a batch):
        (B, vocab) float32 logits of each one's newest position, None for a "chunk"."""
        return forward(self.model.net, caches, tokens, kind)

    def release(self, rid: int, ids: list[int] | None, caches: list) -> None:
        """Request `rid` is over: keep its caches, which hold `ids`, for a later prefix (None:
        they are not consistent, drop them)."""
        if ids:
            self.prefix.put(ids, caches)

    def close(self) -> None:
        """The engine has stopped."""


def forward(net, caches: Sequence[list], tokens: Sequence[Sequence[int]], kind: str):
    """One step on this process's network (a lone Decoder, or one rank's PipelineNet stage).
    A network that heads gives logits as `LocalSteps.run` says; a stage that does not gives
    the send of its hidden states (evaluated here for a "chunk", which returns None)."""
    logits = heads(net)
    if kind == "decode" and len(caches) > 1:
        out = net.decode_batch([t[0] for t in tokens], list(caches))  # (B, vocab) or a send
        return out.astype(mx.float32) if logits else out
    out = net(mx.array([list(tokens[0])], dtype=mx.int32), cache=caches[0], last_only=True)
    if kind == "chunk":  # only the caches matter (and a stage's send)
        mx.eval([c.state for c in caches[0]], [] if logits else out)
        return None
    if kind == "prompt":
        snapshot(caches[0])  # as generate's prefill does: a point to rewind to
    return out[:, -1, :].astype(mx.float32) if logits else out


def heads(net) -> bool:
    """Whether `net` computes logits (a lone network, or the last stage of a pipeline)."""
    return not getattr(net, "is_pipeline", False) or net.is_last
