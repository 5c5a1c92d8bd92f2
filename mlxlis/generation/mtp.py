"""`--speculative mtp`: the target's own multi-token-prediction block as the drafter (its
family's `mtp`: models/qwen3_5_mtp.py), chained for more than one token as vLLM, SGLang and
llama.cpp chain it: the block's output state for one drafted token is the state it reads with
the next.

Bookkeeping. The block's KV cache holds one entry per pair (x_{t+1}, g_t) of the sequence,
g_t the target's state at t (`feed_hidden`, every position once, in order). A proposal after
`history` (its last token x_{L-1} not yet run by the target) pairs x_{L-1} with g_{L-2} —
the first draft — then each drafted token with the block's own state; those chained entries
are trimmed at once, as the target's kept positions arrive with the target's states next.
Tokens the target decoded plainly (no states handed over: the Governor's probe and rest
steps) are paired with the block's own state instead, so the cache keeps one entry a
position; a prefix the target's caches already held starts the block's cache later (RoPE is
relative: the shift changes nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxlis.generation.processors import LogitsProcessor, processors_for
from mlxlis.generation.proposal import Drafter, Picker, Proposal, SpeculativeError
from mlxlis.generation.sampling import SamplingParams
from mlxlis.models import family
from mlxlis.models.model import Model
from mlxlis.models.network import DraftHead, NoDraftHead

import mlx.core as mx


def mtp_head_of(target: Model) -> DraftHead:
    """The target's MTP block (its family's `mtp`, loaded on first use), else a
    SpeculativeError naming it."""
    spec = family(target.config.family)
    try:
        if spec.mtp is None:
            raise NoDraftHead(
                f"{target.name} (a {spec.name} model) has no multi-token-prediction block to "
                "draft with"
            )
        return spec.mtp(target, spec)
    except NoDraftHead as e:
        raise SpeculativeError(str(e), field="speculative") from None


class MTPDrafter(Drafter):
    """Drafts with the target's MTP block (loaded on first use; a SpeculativeError when it has
    none), greedy for a greedy target, else sampled from the block's distribution under the
    request's processors and filters (the q of the ratio test)."""

    wants_hidden = True

    def __init__(self, target: Model, params: SamplingParams):
        self.head = mtp_head_of(target)
        self.cache = self.head.make_cache()
        self.processors: list[LogitsProcessor] = processors_for(params, target.tokenizer)
        self.pick = Picker(params)
        self.pending: mx.array | None = None  # (1, hidden) g of the last position, unpaired
        self.known = 0  # positions of the sequence the block has a state for
        self.seen: list[int] | None = []  # ids fed before the first proposal (to place them)

    def _pairs(self, ids: Sequence[int], states: mx.array) -> mx.array:
        out = self.head.step(list(ids), states, self.cache)  # (T, hidden)
        mx.async_eval(out, [c.state for c in self.cache])
        return out

    def feed_hidden(self, ids: Sequence[int], hidden: mx.array) -> None:
        g = self.head.target_states(hidden)  # (T, hidden), after the target's final norm
        if self.pending is None:  # ids[0]: the sequence's first, or paired by a proposal
            pairs, states = ids[1:], g[:-1]
        else:
            pairs, states = ids, mx.concatenate([self.pending, g[:-1]])
        if len(pairs):
            self._pairs(pairs, states)
        self.pending = g[-1:]
        self.known += len(ids)
        if self.seen is not None:
            self.seen += list(ids)

    def _place(self, history: Sequence[int]) -> None:
        """Where the ids fed so far sit in `history`: after a prefix the target's caches held
        (never fed), before tokens decoded plainly since."""
        seen, n = self.seen, len(self.seen)
        top = len(history) - 1 - n
        h = list(history)
        base = next((b for b in range(max(top, 0) + 1) if h[b : b + n] == seen), max(top, 0))
        self.known, self.seen = base + n, None

    def propose(self, history: Sequence[int], k: int) -> Proposal:
        if self.seen is not None:
            self._place(history)
        if self.pending is None or k < 1 or len(history) - 1 < self.known:
            return Proposal([])
        for x in history[self.known : len(history) - 1]:  # decoded plainly: chained states
            self.pending = self._pairs([x], self.pending)
            self.known += 1
        out = self._pairs([history[-1]], self.pending)  # (1, hidden): the first draft's
        self.pending = None
        seq = list(history)
        tokens = []
        for i in range(k):
            t = self.pick(self.head.logits(out), seq, self.processors)  # from (1, vocab)
            tokens.append(t)
            seq.append(t)
            if i < k - 1:
                out = self._pairs([t], out)
        if k > 1:  # the chained entries: the target's states replace them
            for c in self.cache:
                c.trim(k - 1)
        return self.pick.proposal(tokens)


__all__ = ["MTPDrafter", "mtp_head_of"]
