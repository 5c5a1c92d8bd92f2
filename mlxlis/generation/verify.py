"""The generation core's speculative step (core.py): each speculating sequence's pending token
read and its drafter's proposals made, every row verified — in one batched forward when
several speculate and the network has one (`verifies_in_batch`), else one forward each — then each
row's verdict taken position by position (speculative.Judge), its caches trimmed back to what
it kept and the target's own next token left pending.

Rows of a batched verification are padded to the longest with their last token; a padded
position is never judged, only trimmed with the rejected ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxlis.cache.store import by_format
from mlxlis.errors import MlxlisError
from mlxlis.generation.events import Event
from mlxlis.generation.steps import StepKind, lanes

import mlx.core as mx

if TYPE_CHECKING:
    from mlxlis.generation.speculative import Proposal
    from mlxlis.generation.steps import Steps
    from mlxlis.models.network import Network

Sequence = Any  # core.Sequence, a running request (not imported: core imports this module)


@dataclass
class Draft:
    """One row of a verification: the pending token, then the proposals."""

    seq: Sequence
    tokens: list[int]  # [pending, *proposals]
    proposal: Proposal
    seconds: float  # the drafter's

    @property
    def n(self) -> int:
        return len(self.tokens) - 1  # proposals


def propose(s: Sequence, k: int) -> Draft:
    """`s`'s pending token read and up to `k` tokens drafted after it."""
    t0 = time.perf_counter()
    first = int(s.pending.item())
    prop = s.spec.drafter.propose([*s.history, first], k)
    tokens = [first, *prop.tokens[:k]]
    return Draft(s, tokens, prop, time.perf_counter() - t0)


def verify(steps: Steps, net: Network, drafts: list[Draft]) -> list[tuple[Sequence, Event]]:
    """Verify every row of `drafts`, then take each one's verdict: the events they made."""
    if len(groups := by_format(drafts, lambda d: d.seq.kv)) > 1:
        return [ev for group in groups for ev in verify(steps, net, group)]
    t0 = time.perf_counter()
    batch = len(drafts) > 1 and net.verifies_in_batch
    if batch and not any(d.seq.spec.wants_hidden for d in drafts):
        width = max(len(d.tokens) for d in drafts)
        rows = [d.tokens + d.tokens[-1:] * (width - len(d.tokens)) for d in drafts]
        seqs = [d.seq for d in drafts]
        logits = steps.run(
            [s.id for s in seqs],
            [s.caches for s in seqs],
            mx.array(rows, mx.int32),
            StepKind.VERIFY,
            lanes=lanes(seqs),
        )
        mx.eval(logits)  # (B, T, vocab)
        each = (time.perf_counter() - t0) / len(drafts)
        out = []
        for i, d in enumerate(drafts):
            out += judge(d, logits[i], None, width, each)
        return out
    out = []
    for d in drafts:
        t = time.perf_counter()
        s, hidden = d.seq, d.seq.spec.wants_hidden
        tokens = mx.array(d.tokens, mx.int32)
        res = steps.run(
            [s.id], [s.caches], tokens, StepKind.VERIFY, hidden=hidden, lanes=lanes([s])
        )
        logits, states = res if hidden else (res, None)
        mx.eval(logits)  # (T, vocab)
        out += judge(d, logits, states, len(d.tokens), time.perf_counter() - t)
    return out


def judge(
    d: Draft, logits: mx.array, states: mx.array | None, width: int, seconds: float
) -> list[tuple[Sequence, Event]]:
    """The verdict on one row: `logits` (width, vocab) of its verified positions (the first
    len(d.tokens) its own), `states` the target's hidden states there for a drafter that
    reads them. Its caches hold `width` new positions; they keep 1 + the kept proposals."""
    s, drafts, prop = d.seq, d.tokens[1:], d.proposal
    s.fed.append(d.tokens[0])
    events = [(s, ev) for ev in s.accept(d.tokens[0])]
    kept, nxt = 0, None
    for i in range(len(d.tokens)):
        if s.done:
            break
        row = s.process(logits[i : i + 1])
        if i == len(drafts):  # every proposal kept: the target's own next token
            nxt = s.sampler(row)
            break
        q = None if prop.q is None else prop.q[i]
        other = s.spec.judge.check(row, drafts[i], q)
        if other is not None:
            nxt = mx.array([other], mx.int32)
            break
        kept += 1
        s.fed.append(drafts[i])
        events += [(s, ev) for ev in s.accept(drafts[i])]
    drop = width - 1 - kept  # the rejected and the padded positions
    if drop and not all(c.trim(drop) == drop for c in s.caches):
        raise MlxlisError(f"a cache could not return {drop} positions after a verification")
    if states is not None:  # the target's hidden states of the positions it keeps
        s.spec.drafter.feed_hidden(d.tokens[: 1 + kept], states[: 1 + kept])
    if not s.done:
        s.pending = nxt
        mx.async_eval(nxt)
    s.spec.governor.observe(len(drafts), kept, seconds, d.seconds)
    s.usage.draft_tokens += len(drafts)
    s.usage.accepted_tokens += kept
    return events
