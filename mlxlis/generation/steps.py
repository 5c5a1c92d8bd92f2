"""Where each request's caches live and how a step runs: the seam between the generation core
and whatever runs the network.

The core decides what runs (core.py); a Steps object runs it. `LocalSteps` keeps every cache in
this process. A model pipelined across ranks (`Model.part` set) runs through the pipeline's
Steps, which tell the other ranks each step before running this rank's share: the distributed
layer, above this one, registers them here (`pipeline_steps`); the core never knows which it
has.

A step's `kind` (StepKind): CHUNK (part of a prompt with more to come: nothing comes back),
MARK (a chunk at whose end the caches keep a snapshot: a position later prompts will share),
PROMPT (the prompt's last chunk: the first token's logits; the caches snapshot its end), LAST
(the same without the snapshot: the request asked for its snapshots elsewhere), DECODE (one
token per sequence), VERIFY (a speculative step: a few tokens of one sequence, or (B, T) of
several, whose caches must be able to forget any of them but the first; logits of every
position, (T, vocab) or (B, T, vocab)). A step of one sequence may also ask for its `hidden`
states: the (T, hidden) states before the final norm come back beside the logits (a drafter
reading the target's, as an MTP head does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Literal, Protocol, overload

from mlxlis.cache import Cache, snapshot
from mlxlis.cache.prefix import PrefixCache
from mlxlis.cache.store import KVFormat
from mlxlis.errors import PipelineError
from mlxlis.models import lora
from mlxlis.models.model import Model
from mlxlis.models.multimodal import Inserts
from mlxlis.models.network import Network

import mlx.core as mx

PREFILL_CHUNK = 512  # prompt tokens per step (a pipeline's ranks overlap on these chunks)
# each row's LoRA adapter lane (an index into Model.selectable; -1: none) and scale multiplier
Lanes = Sequence[tuple[int, float]]


class Laned(Protocol):
    lane: int
    lane_scale: float


def lanes(seqs: Sequence[Laned]) -> Lanes | None:
    """Each sequence's adapter lane and scale for `Steps.run`; None when none has one."""
    if all(s.lane < 0 for s in seqs):
        return None
    return [(s.lane, s.lane_scale) for s in seqs]


class StepKind(str, Enum):
    """What a step feeds and what comes back (the module's docstring). A str: a pipeline's
    leader sends its value to the other ranks, which read it back with StepKind(value)."""

    CHUNK = "chunk"
    MARK = "mark"
    PROMPT = "prompt"
    LAST = "last"
    DECODE = "decode"
    VERIFY = "verify"


# with hidden=True: the logits (None for a CHUNK or a MARK) and the (T, hidden) states
WithHidden = tuple[mx.array | None, mx.array]


class Steps(Protocol):
    def admit(
        self, rid: int, ids: list[int], kv: KVFormat | None, tag: str = ""
    ) -> tuple[list[Cache], int, str]:
        """Caches in KV format `kv` for request `rid` whose prompt is `ids`: a prefix-cache
        entry of that format and adapter `tag` (Model.lane) rewound to the longest prefix it
        shares with `ids`, else fresh ones; how many ids they hold; and why that many
        (PrefixCache.note)."""
        ...

    @overload
    def run(
        self,
        rids: Sequence[int],
        caches: Sequence[list[Cache]],
        tokens: mx.array,
        kind: StepKind,
        inserts: Inserts | None = None,
        *,
        hidden: Literal[False] = False,
        lanes: Lanes | None = None,
    ) -> mx.array | None: ...

    @overload
    def run(
        self,
        rids: Sequence[int],
        caches: Sequence[list[Cache]],
        tokens: mx.array,
        kind: StepKind,
        inserts: Inserts | None = None,
        *,
        hidden: Literal[True],
        lanes: Lanes | None = None,
    ) -> WithHidden: ...

    def run(
        self,
        rids: Sequence[int],
        caches: Sequence[list[Cache]],
        tokens: mx.array,
        kind: StepKind,
        inserts: Inserts | None = None,
        *,
        hidden: bool = False,
        lanes: Lanes | None = None,
    ) -> mx.array | WithHidden | None:
        """Feed `tokens` to the requests `rids`: a (1, T) prompt chunk for one request, or one
        token each, (B,), to decode. (B, vocab) float32 logits of each one's newest position
        (lazy), None for a CHUNK or a MARK. `inserts`: the images whose placeholder runs a
        prompt chunk holds (models/multimodal.py). `hidden` (one request's step): (those
        logits or None, its (T, hidden) states before the final norm). `lanes`: each row's
        LoRA adapter (None: the base for every row)."""
        ...

    def release(self, rid: int, ids: list[int] | None, caches: list[Cache], tag: str = "") -> None:
        """Request `rid` is over: keep its caches, which hold `ids` under adapter `tag`, for a
        later prefix (None: they are not consistent, drop them)."""
        ...

    def close(self) -> None:
        """Nothing more will run."""
        ...


class LocalSteps:
    """Every request's caches in this process; finished ones go to the prefix cache."""

    def __init__(self, model: Model, prefix: PrefixCache):
        self.model = model
        self.prefix = prefix

    def admit(
        self, rid: int, ids: list[int], kv: KVFormat | None, tag: str = ""
    ) -> tuple[list[Cache], int, str]:
        caches, reused = self.prefix.take(ids, kv, tag=tag)
        if caches is None:
            return self.model.make_cache(kv), 0, self.prefix.note
        return caches, reused, self.prefix.note

    def run(
        self,
        rids: Sequence[int],
        caches: Sequence[list[Cache]],
        tokens: mx.array,
        kind: StepKind,
        inserts: Inserts | None = None,
        *,
        hidden: bool = False,
        lanes: Lanes | None = None,
    ) -> mx.array | WithHidden | None:
        chosen = None if lanes is None else [lane for lane, _ in lanes]
        with lora.rows(chosen, None if lanes is None else [scale for _, scale in lanes]):
            out = forward(self.model.net, caches, tokens, kind, inserts, hidden=hidden)
        if kind == StepKind.PROMPT:  # the snapshots' copies made now, not held lazily by the cache
            mx.async_eval([c.state for c in caches[0]])
        return out

    def release(self, rid: int, ids: list[int] | None, caches: list[Cache], tag: str = "") -> None:
        if ids:
            self.prefix.put(ids, caches, tag)

    def close(self) -> None:
        pass


StepsFactory = Callable[[Model, PrefixCache], Steps]
_pipelined: list[StepsFactory] = []  # the distributed layer's, once it is imported


def pipeline_steps(factory: StepsFactory) -> None:
    """The Steps of a model pipelined across ranks from now on (the distributed layer's
    LeaderSteps, registered when it is imported; a later registration replaces it)."""
    _pipelined[:] = [factory]


def steps_for(model: Model, prefix: PrefixCache) -> Steps:
    """The pipeline's Steps for a model pipelined across ranks (`model.part`), else
    LocalSteps."""
    if model.part is None:
        return LocalSteps(model, prefix)
    if not _pipelined:
        raise PipelineError("no pipeline steps: mlxlis.distributed is not loaded", field="model")
    return _pipelined[0](model, prefix)


def forward(
    net: Network,
    caches: Sequence[list[Cache]],
    tokens: mx.array,
    kind: StepKind,
    inserts: Inserts | None = None,
    *,
    hidden: bool = False,
) -> mx.array | WithHidden | None:
    """One step on this process's network (a lone one, or one rank's pipeline stage). A network
    that heads gives logits as `Steps.run` says; a stage that does not gives the send of its
    hidden states (evaluated here for a CHUNK or a MARK, which return None). `inserts` (a
    prompt chunk's images) reach a network that sees as its `inserts=` argument. `hidden`
    (one sequence's step): also the (T, hidden) states before the final norm (a drafter
    reading the target's, as an MTP head does): (logits or None, hidden)."""
    if kind == StepKind.DECODE and len(caches) > 1 and not hidden:
        out = net.decode_batch(tokens, list(caches))  # (B, vocab) or a send
        return out.astype(mx.float32) if net.heads else out
    if (
        kind == StepKind.VERIFY and len(caches) > 1 and not hidden
    ):  # several sequences' (B, T) tokens
        for row in caches:
            for c in row:
                c.expect_rewind(tokens.shape[1] - 1)
        return net.verify_batch(tokens, list(caches)).astype(mx.float32)  # (B, T, vocab)
    inputs = tokens.reshape(1, -1).astype(mx.int32)  # (1, T)
    if kind == StepKind.VERIFY:  # logits of every position; the caches ready to forget all but one
        for c in caches[0]:
            c.expect_rewind(inputs.shape[1] - 1)
    last = kind != StepKind.VERIFY
    seen = {"inserts": inserts} if inserts else {}
    if hidden:
        h = net.hidden_states(inputs, caches[0], **seen)  # (1, T, hidden)
        out = net.head(h, last_only=last)
    else:
        out = net(inputs, cache=caches[0], last_only=last, **seen)
    if kind in (StepKind.MARK, StepKind.PROMPT):
        snapshot(caches[0])  # a point recurrent layers and rings rewind to (a later prefix)
    if kind in (StepKind.CHUNK, StepKind.MARK):  # only the caches matter (and a stage's send)
        mx.eval([c.state for c in caches[0]], [] if net.heads else out)
        out = None
    elif net.heads:
        out = (
            out[0].astype(mx.float32)
            if kind == StepKind.VERIFY
            else out[:, -1, :].astype(mx.float32)
        )
    return (out, h[0]) if hidden else out


def prefill(
    net: Network, ids: Sequence[int], cache: list[Cache], step: int = PREFILL_CHUNK
) -> mx.array:
    """`ids` into `cache` through `forward` in chunks of `step`, as the core feeds a prompt
    (for tools and tests that drive a network directly): (1, vocab) float32 logits of the
    last position."""
    for start in range(0, len(ids), step):
        chunk = mx.array(list(ids[start : start + step]), mx.int32)
        last = start + step >= len(ids)
        out = forward(net, [cache], chunk, StepKind.PROMPT if last else StepKind.CHUNK)
    return out
