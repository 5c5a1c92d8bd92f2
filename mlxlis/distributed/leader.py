"""Rank 0 leads, the other ranks follow: under mlx.launch rank 0 runs the surface (the one-shot
command, the chat app, the server) and its generation core, whose Steps object is LeaderSteps;
the other ranks hold their share of every request's caches and run each step rank 0
announces (`follow`).

Every step of rank 0's core (generation/steps.py) is first broadcast to all ranks as one small
JSON message, then run by every rank on its own layers, hidden states passing rank to rank
as in a lone generation (stage.py). The message carries the request ids, the tokens to feed,
the step's kind (its StepKind's value) and whether it wants the hidden states, and the cache
changes since the last one ("fresh" caches for a request, "keep" a finished request's caches
as prefix-cache entry K, "drop" them, "evict" entry K, "trim" the positions a speculative
verdict rejected: the core trims rank 0's caches after a VERIFY step, which every rank ran), so
each rank's caches are those of rank 0's engine, request by request. Taking a prefix-cache
entry is a step of its own: the ranks agree on the furthest position every one of their
layers can return to exactly (their layers differ: a recurrent state returns only to a
snapshot, a sliding window within its ring or to a snapshot) before trimming. Snapshots are
taken on every rank at the same steps (a MARK chunk, a prompt's end), so the ranks' layers
return to the same positions.

A prompt chunk holding images (tensor ranks only: Share.sees) carries their placement in the
message and their features in one collective after it (images.py).

The last rank sends the step's float32 logits (B, vocab) to rank 0 (its neighbour in the
ring), which samples, stops and streams exactly as a lone core does: per step that is
B × vocab × 4 bytes on top of the hidden states (B × hidden × the residual dtype's size per
hop). The next step is announced only after rank 0 has sampled (the announcement carries the
token ids), so the ranks work one after another, not overlapped, and the core's overlap of a
step with the reading of its token does not apply. The prefix cache's bound counts rank 0's
share of the caches; the other ranks keep and evict the same entries, so theirs are about their
share of the layers. A failure in
the middle of a step (rank 0's memory, a lost rank) ends the server, not just one request:
the ranks can no longer be sure they hold the same caches.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Protocol

from mlxlis.cache import Cache, KVFormat, reachable, rewind
from mlxlis.cache.prefix import PrefixCache
from mlxlis.distributed import images
from mlxlis.distributed.group import Ranks
from mlxlis.errors import PipelineError, UnsupportedError
from mlxlis.generation.steps import Lanes, LocalSteps, StepKind, WithHidden, forward
from mlxlis.models.model import Model
from mlxlis.models.network import Network

import mlx.core as mx


class RankedNet(Network, Protocol):
    """A network split across ranks: a pipeline stage (stage.py) or a tensor-parallel slice
    of every layer (tensor.py)."""

    ranks: Ranks

    @property
    def logits_at_leader(self) -> bool:
        """Rank 0's own forward returns the logits (tensor); else the last rank sends them."""
        ...

    @property
    def sends_logits(self) -> bool:
        """This rank sends its step's logits to rank 0 (a pipeline's last stage)."""
        ...


def _stage(model: Model) -> RankedNet:
    if model.part is None:
        raise PipelineError("the model does not run across ranks", field="model")
    return model.net


class LeaderSteps(LocalSteps):
    """Rank 0's steps: each is announced to the other ranks, then run as a pipeline stage."""

    def __init__(self, model: Model, prefix: PrefixCache):
        super().__init__(model, prefix)
        self.net = _stage(model)
        self.ranks: Ranks = self.net.ranks
        self.vocab = self.net.config.vocab_size
        self.pending: list[list] = []  # cache changes the other ranks hear of with the next step
        # request id -> (its caches, their length after its latest verification)
        self.verified: dict[int, tuple[list[Cache], int]] = {}
        prefix.on_drop = lambda key: self.pending.append(["evict", key])

    def _trims(self) -> None:
        """The positions each verdict dropped from rank 0's caches since the verification
        (the core trims them, not a step): the other ranks drop as many from theirs."""
        for rid, (caches, fed) in self.verified.items():
            if (drop := fed - caches[0].offset) > 0:
                self.pending.append(["trim", rid, drop])
        self.verified.clear()

    def _tell(self, **step) -> None:
        self._trims()
        step["ops"], self.pending = self.pending, []
        with self.ranks.waiting():
            self.ranks.broadcast(json.dumps(step).encode())

    def admit(
        self, rid: int, ids: list[int], kv: KVFormat | None, tag: str = ""
    ) -> tuple[list[Cache], int, str]:
        """(Every rank's caches are in the model's format: the core refuses another `kv`; a
        pipelined model has no selectable adapters: Model.select_adapter refuses them.)"""
        if tag:
            raise UnsupportedError("adapters on a pipelined model", field="adapter")

        def agreed(key: int, caches: list, held: int, position: int) -> int:
            with collective():
                self._tell(take=[key, rid, held, position])
                with self.ranks.waiting():
                    return take(self.ranks, caches, held, position)

        caches, reused = self.prefix.take(ids, kv, agreed)
        if caches is not None:
            return caches, reused, self.prefix.note
        caches = self.model.make_cache()
        self.pending.append(["fresh", rid])
        return caches, 0, self.prefix.note

    def run(
        self,
        rids: Sequence[int],
        caches: Sequence[list[Cache]],
        tokens: mx.array,
        kind: StepKind,
        inserts: object = None,
        *,
        hidden: bool = False,
        lanes: Lanes | None = None,
    ) -> mx.array | WithHidden | None:
        if lanes is not None:
            raise UnsupportedError("adapters on a pipelined model", field="adapter")
        if inserts and not self.model.part.sees:  # Model.image_spans refuses them before
            raise UnsupportedError("images with a pipelined model", field="images")
        with collective():
            # waits for the sampled ids
            told = images.describe(inserts) if inserts else None
            self._tell(run=[list(rids), tokens.tolist(), kind.value, hidden, told])
            with self.ranks.waiting():
                if inserts:
                    images.send(self.ranks, inserts)
                sent = forward(self.net, caches, tokens, kind, inserts, hidden=hidden)
                if kind == StepKind.VERIFY:  # the verdict trims rank 0's caches later
                    for rid, cs in zip(rids, caches, strict=True):
                        self.verified[rid] = (cs, cs[0].offset)
                if sent is None:  # a chunk or a mark: evaluated, nothing comes back
                    return None
                mx.eval(sent, [c.state for cs in caches for c in cs])
                if self.net.logits_at_leader:  # every rank computed them (tensor.py)
                    return sent
                logits = mx.distributed.recv(
                    (len(rids), self.vocab), mx.float32, self.ranks.size - 1, group=self.ranks.group
                )
                mx.eval(logits)
                return logits

    def release(self, rid: int, ids: list[int] | None, caches: list[Cache], tag: str = "") -> None:
        self._trims()  # before its caches are kept: the other ranks' must hold what these do
        key = self.prefix.put(ids, caches) if ids else None
        self.pending.append(["keep", rid, key] if key is not None else ["drop", rid])

    def close(self) -> None:
        """The server has stopped: the other ranks leave `follow` (the one-shot command and
        the chat app call `finish` themselves: their cores end before the process does)."""
        finish(self.ranks)


def ranks_of(model: Model) -> Ranks | None:
    """The ranks a pipelined model runs on, None in one process."""
    return _stage(model).ranks if model.part is not None else None


def finish(ranks: Ranks | None) -> None:
    """Rank 0: tell the other ranks nothing more will run (they leave `follow`). Not after a
    lost rank: the others are ending already, and the collective would wait for the dead."""
    if ranks is not None and ranks.rank == 0 and not ranks.lost:
        with ranks.waiting():
            ranks.broadcast(b"")


@contextlib.contextmanager
def collective() -> Iterator[None]:
    """Rank 0 failing within a step the others were told of leaves them waiting for it in
    vain: any error there is a PipelineError, which ends the server (not one request)."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as e:
        raise PipelineError(
            f"rank 0 failed in a pipelined step: {type(e).__name__}: {e}", field="serve"
        ) from e


def take(ranks: Ranks, caches: list[Cache], held: int, position: int) -> int:
    """Every rank: trim its share of a prefix-cache entry holding `held` ids back to the
    latest position ≤ `position` that every layer of every rank returns to exactly (0: none;
    the entry is then dropped). Collective: the ranks trade their candidates until they agree."""
    target = position
    while True:
        low = min(row[0] for row in ranks.gather([reachable(caches, target)]))
        if low == target:
            break
        target = low
    if target <= 0:
        return 0
    if rewind(caches, held, target) != target:
        raise PipelineError(
            f"rank {ranks.rank} could not return its caches to position "
            f"{target}, which every rank agreed on",
            field="cache",
        )
    return target


def follow(model: Model) -> None:
    """A rank other than 0 while rank 0 leads: run each step it announces, on caches kept per
    request and per prefix-cache entry, until rank 0 says it has finished."""
    net = _stage(model)
    ranks = net.ranks
    live: dict[int, list] = {}  # request id -> caches
    kept: dict[int, list] = {}  # prefix-cache key -> caches
    while raw := ranks.broadcast(b""):  # untimed: a server may wait long for a request
        step = json.loads(raw)
        for op, *args in step["ops"]:
            if op == "fresh":
                live[args[0]] = model.make_cache()
            elif op == "keep":
                kept[args[1]] = live.pop(args[0])
            elif op == "drop":
                live.pop(args[0], None)
            elif op == "evict":
                kept.pop(args[0], None)
            elif op == "trim":  # a verdict kept fewer positions than were verified
                rid, drop = args
                if not all(c.trim(drop) == drop for c in live[rid]):
                    raise PipelineError(
                        f"rank {ranks.rank} could not drop {drop} verified positions",
                        field="cache",
                    )
        if "take" in step:
            key, rid, held, position = step["take"]
            caches = kept.pop(key)
            with ranks.waiting():
                if take(ranks, caches, held, position):
                    live[rid] = caches
        if "run" in step:
            rids, tokens, kind, hidden, told = step["run"]
            with ranks.waiting():
                seen = images.receive(ranks, told) if told else None
                ids = mx.array(tokens, mx.int32)
                caches = [live[r] for r in rids]
                out = forward(net, caches, ids, StepKind(kind), seen, hidden=hidden)
                if out is None:
                    continue
                if net.sends_logits:  # the logits go back to rank 0, which samples
                    out = mx.distributed.send(out, 0, group=ranks.group)
                mx.eval(out, [c.state for r in rids for c in live[r]])
