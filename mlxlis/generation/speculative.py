"""Speculative decoding: a drafter proposes the next tokens, one forward of the target verifies
them all, and the sequence keeps the longest prefix the target's own sampling agrees with,
plus one token of the target's (where it disagreed, or the next after all of them).

Exactness. Greedy: a proposal is kept while it is the target's argmax, so the output is the
plain greedy output. Sampling: speculative rejection sampling (Leviathan et al. 2023, Chen et
al. 2023): proposal d, drawn from the drafter's distribution q, is kept with probability
min(1, p(d) / q(d)), p the target's distribution after its processors and sampling filters
(temperature, top-k, top-p, min-p, as plain sampling applies them); at the first rejection the
token is drawn from the residual max(p − q, 0), normalised; after every proposal was kept,
from p. A drafter with no distribution (prompt lookup) proposes with q a point mass on d. So
the tokens are distributed exactly as the target's, whatever the drafter proposes.

Drafters: `NgramDrafter` (prompt lookup: the continuation of the latest earlier occurrence of
the longest suffix of the sequence) and `ModelDrafter` (a smaller model of the same vocabulary
with caches of its own). `Governor` picks how many tokens to draft from the measured
acceptance and the measured cost of a verification and a draft step, and turns speculation off
for a while when it does not pay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxlis.cache import Cache
from mlxlis.cache.rewind import common_prefix, rewind
from mlxlis.generation.assistant import AssistantDrafter
from mlxlis.generation.events import Usage
from mlxlis.generation.processors import LogitsProcessor, forked, processors_for
from mlxlis.generation.proposal import Drafter, Picker, Proposal, SpeculativeError
from mlxlis.generation.sampling import SamplingParams, make_filter, make_key
from mlxlis.generation.steps import StepKind, forward, prefill
from mlxlis.models import family

import mlx.core as mx

if TYPE_CHECKING:
    from mlxlis.models.model import Model

KINDS = ("ngram", "draft", "mtp")  # --speculative (a draft model: --draft-model)
MAX_DRAFT = 16  # the most tokens one verification checks (a recurrent layer keeps as many states)


class NgramDrafter(Drafter):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the longest
    suffix of the sequence (MAX_N down to MIN_N tokens long) — the large win when a reply
    copies from its prompt (edits, summaries, retrieval answers). Each n-gram's latest
    position is indexed as the sequence grows, so a lookup costs O(MAX_N)."""

    MIN_N, MAX_N = 1, 4
    wants_hidden = False

    def __init__(self) -> None:
        self.seen = 0  # history positions indexed so far
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest

    def propose(self, history: Sequence[int], k: int) -> Proposal:
        h = history
        # index every n-gram ending before the last position (the suffix itself is not "earlier")
        for end in range(max(self.seen, 1), len(h)):
            for n in range(self.MIN_N, min(self.MAX_N, end) + 1):
                self.index[tuple(h[end - n : end])] = end
        self.seen = max(self.seen, len(h))
        for n in range(min(self.MAX_N, len(h) - 1), self.MIN_N - 1, -1):
            at = self.index.get(tuple(h[len(h) - n :]))
            if at is not None and at < len(h):
                return Proposal(list(h[at : at + k]))
        return Proposal([])


class ModelDrafter(Drafter):
    """A smaller model of the target's vocabulary, run ahead on caches of its own: it catches
    up with the sequence (rewinding to what it shares with its caches), then drafts `k` tokens
    one step each, greedy for a greedy target, else sampled from its own distribution under
    the same processors and filters (the q of the ratio test). The request's processors apply
    to it through copies made for each proposal (`forked`): a grammar's mask moves on with the
    drafted tokens there, and with the kept ones only in the request's own; its logits are
    read over the target's vocabulary (`vocab`: ids it lacks at -inf, ids past it cut)."""

    wants_hidden = False

    def __init__(
        self,
        model: Model,
        params: SamplingParams,
        processors: Sequence[LogitsProcessor] | None = None,
        vocab: int | None = None,
    ):
        self.model = model
        self.params = params
        self.caches: list[Cache] = model.make_cache()
        self.fed: list[int] = []  # ids the caches hold
        own = processors_for(params, model.tokenizer) if processors is None else processors
        self.processors = list(own)
        self.pick = Picker(params)
        self.vocab = vocab or model.config.vocab_size

    def prepare(self, prompt: Sequence[int]) -> None:
        """Read the prompt: the draft's caches catch up with it."""
        self._catch_up(prompt)
        mx.eval([c.state for c in self.caches])

    def _catch_up(self, history: Sequence[int]) -> mx.array:
        """Feed the draft what it lacks of `history` (at least its last token): the (1, vocab)
        logits after it."""
        shared = min(common_prefix(self.fed, history), len(history) - 1)
        if shared < len(self.fed):
            back = rewind(self.caches, len(self.fed), shared) if shared > 0 else 0
            if back == 0:
                self.caches, back = self.model.make_cache(), 0
            self.fed = self.fed[:back]
        todo = list(history[len(self.fed) :])
        self.fed += todo
        # ids past the draft's embedding (a Gemma 3 4B's image placeholders, 262 144, to a 1B
        # of 262 144 rows) read as 0: the draft sees no images, it only has to guess well
        rows = self.model.config.vocab_size
        todo = [t if t < rows else 0 for t in todo]
        if len(todo) == 1:
            return forward(self.model.net, [self.caches], mx.array(todo, mx.int32), StepKind.LAST)
        return prefill(self.model.net, todo, self.caches)

    def _over_target(self, logits: mx.array) -> mx.array:
        """(1, draft vocab) -> (1, target vocab): ids the draft lacks at -inf, extra ids cut."""
        n = logits.shape[-1]
        if n > self.vocab:
            return logits[:, : self.vocab]
        if n < self.vocab:
            return mx.pad(logits, [(0, 0), (0, self.vocab - n)], constant_values=-mx.inf)
        return logits

    def propose(self, history: Sequence[int], k: int) -> Proposal:
        logits = self._catch_up(history)
        seq = list(history)
        tokens = []
        processors = forked(self.processors)  # state of their own for the drafted tokens
        for i in range(k):
            logits = self._over_target(logits.astype(mx.float32))
            t = self.pick(logits, seq, processors)
            tokens.append(t)
            seq.append(t)
            if i < k - 1:
                self.fed.append(t)
                token = mx.array([t], mx.int32)
                logits = forward(self.model.net, [self.caches], token, StepKind.LAST)
        return self.pick.proposal(tokens)


def check_vocabulary(target: Model, draft: Model) -> None:
    """A draft model must emit exactly the target's tokens: the same bytes for every id it can
    produce (its tokenizer's), else a SpeculativeError naming the first that differs."""
    t, d = target.tokenizer, draft.tokenizer
    n = min(d.vocab_size, draft.config.vocab_size)
    if n > min(t.vocab_size, target.config.vocab_size):
        raise SpeculativeError(
            f"the draft model has {n} tokens, the target {t.vocab_size}: not one vocabulary",
            field="draft_model",
        )
    for i in range(n):
        if t.token_bytes(i) != d.token_bytes(i):
            raise SpeculativeError(
                f"token {i} is {d.token_bytes(i)!r} in the draft model and {t.token_bytes(i)!r} "
                "in the target: not one vocabulary",
                field="draft_model",
            )


class Judge:
    """The target's verdict on each proposal (see the module docstring), drawing from its own
    PRNG key (seeded from the request's seed)."""

    def __init__(self, params: SamplingParams):
        self.greedy = params.temperature == 0
        self.filtered = None if self.greedy else make_filter(params)
        self.key = make_key(params, stream=2)  # independent of the sampler's and the drafter's

    def _draw(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def check(self, logits: mx.array, d: int, q: mx.array | None) -> int | None:
        """`logits` (1, vocab): the target's, processed, at the proposal's position; `q`
        (vocab,) the drafter's probabilities there (None: a point mass on d). None when d is
        kept, else the token that replaces it."""
        if self.greedy:
            best = int(mx.argmax(logits, axis=-1).item())
            return None if best == d else best
        p = mx.softmax(self.filtered(logits)[0], axis=-1, precise=True)  # (vocab,)
        if q is not None and q.shape[0] < p.shape[0]:  # a draft vocabulary padded shorter
            q = mx.pad(q, [(0, p.shape[0] - q.shape[0])])
        qd = mx.array(1.0) if q is None else q[d]
        u = mx.random.uniform(key=self._draw())
        if (u * qd < p[d]).item():  # u < p(d) / q(d), without dividing by a zero q(d)
            return None
        if q is None:
            residual = mx.where(mx.arange(p.shape[0]) == d, 0.0, p)
        else:
            residual = mx.maximum(p - q[: p.shape[0]], 0.0)
        if not (residual.sum() > 0).item():  # p == q exactly: a rejection cannot happen
            residual = p
        logits = mx.where(residual > 0, mx.log(residual), -mx.inf)
        return int(mx.random.categorical(logits, key=self._draw()).item())


@dataclass
class Governor:
    """How many tokens to draft, from what this machine measures: the acceptance rate α (each
    proposal kept with probability α: α̂ = kept / (kept + rejected)), the seconds of a
    verification of T tokens, of a draft step, of a plain decode step, and how often the
    drafter has nothing to propose (prompt lookup finding no earlier occurrence: that step is
    one forward, waited for). A verification of k proposals gives (1 − α^(k+1)) / (1 − α)
    tokens; the k with the most tokens per second is chosen when it beats plain decoding, else
    speculation rests and probes again: for REST tokens at first, twice as long each time it
    rests again in a row (up to MAX_REST), never before TRIALS verifications were measured
    (early figures are few: one slow step must not end it). A fixed `k` (--draft-tokens) is
    always used."""

    fixed: int | None = None
    max_k: int = 8
    kept: float = 1.0  # prior: α = 0.5 over 2 trials until measured
    rejected: float = 1.0
    verify: dict[int, float] = field(default_factory=dict)  # T -> seconds (moving average)
    draft: float = 0.0  # seconds per drafted token (moving average)
    empty: float = 0.0  # the share of steps the drafter proposed nothing (moving average)
    plain: list[float] = field(default_factory=list)  # seconds of the first plain steps
    rest_until: int = 0  # completion tokens until which speculation rests
    rest: int = 16  # how long the next rest lasts (doubles while resting pays)
    trials: int = 0  # verifications measured since the last rest
    last: int = 2  # the draft length chosen last
    chosen: dict[int, int] = field(default_factory=dict)  # draft length -> times chosen
    note: str = ""  # why it rests, for --verbose

    PROBE = 3  # plain steps measured before the first speculation
    REST, MAX_REST = 16, 256
    TRIALS = 4
    DECAY = 0.9  # the moving averages' weight on the past

    @property
    def alpha(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def observe(self, proposed: int, kept: int, verify_s: float, draft_s: float) -> None:
        d = self.DECAY
        self.trials += 1
        self.empty = d * self.empty + (1 - d) * (proposed == 0)
        if proposed:
            self.kept = d * self.kept + kept
            self.rejected = d * self.rejected + (1 if kept < proposed else 0)
        t = proposed + 1
        self.verify[t] = (
            verify_s if t not in self.verify else d * self.verify[t] + (1 - d) * (verify_s)
        )
        if proposed:
            per = draft_s / proposed
            self.draft = per if not self.draft else d * self.draft + (1 - d) * per

    def observe_plain(self, seconds: float) -> None:
        self.plain.append(seconds)
        del self.plain[: -self.PROBE]

    def plain_cost(self) -> float | None:
        return sorted(self.plain)[len(self.plain) // 2] if len(self.plain) >= self.PROBE else None

    def cost(self, t: int) -> float:
        """Seconds of a verification of t tokens: measured, else interpolated linearly from
        the measured ones and the plain step (t = 1)."""
        pts = dict(self.verify)
        if 1 not in pts and self.plain_cost() is not None:
            pts[1] = self.plain_cost()
        if t in pts:
            return pts[t]
        xs = sorted(pts)
        if len(xs) == 1:  # one point: a token more costs 5 % of a step (memory-bound decode)
            return pts[xs[0]] * (1 + 0.05 * (t - xs[0]))
        lo = max([x for x in xs if x < t], default=xs[0])
        hi = min([x for x in xs if x > t], default=xs[-1])
        if lo == hi:
            lo, hi = xs[-2], xs[-1]
        return pts[lo] + (pts[hi] - pts[lo]) * (t - lo) / (hi - lo)

    def choose(self, done: int, room: int) -> int:
        """How many tokens to draft now (0: decode plainly), `done` tokens generated and
        `room` more allowed after the next."""
        if self.fixed is not None:
            k = min(self.fixed, room)
            self.chosen[k] = self.chosen.get(k, 0) + 1
            return k
        plain = self.plain_cost()
        if plain is None or done < self.rest_until:
            return 0
        a, e = min(self.alpha, 0.999), self.empty
        best, best_rate = 0, 1.0 / plain
        for k in range(1, min(self.max_k, room) + 1):
            tokens = (1 - e) * expected_tokens(a, k) + e
            seconds = (1 - e) * (self.cost(k + 1) + k * self.draft) + e * self.cost(1)
            if tokens / seconds > best_rate * 1.02:
                best, best_rate = k, tokens / seconds
        if best == 0 and self.trials < self.TRIALS:  # still measuring: the last length again
            best = min(self.last, room)
        elif best == 0:
            self.rest_until, self.trials = done + self.rest, 0
            self.note = (
                f"speculation rests {self.rest} tokens: acceptance {self.alpha:.2f}, "
                f"nothing to propose {e:.0%} of steps, verify {self.cost(2) * 1e3:.1f} ms vs "
                f"plain {plain * 1e3:.1f} ms"
            )
            self.rest = min(2 * self.rest, self.MAX_REST)
            return 0
        elif self.trials >= self.TRIALS:  # it pays: a later rest starts short again
            self.rest = self.REST
        self.note = ""
        self.last = best or self.last
        self.chosen[best] = self.chosen.get(best, 0) + 1
        return best


@dataclass
class Speculation:
    """How a request speculates: with which drafter (`kind` "ngram", "draft", the draft
    model for "draft", or "mtp", the target's own multi-token-prediction block: generation/
    mtp.py; or a Drafter of one's own, `make(params)` giving one per request), and
    `tokens` per verification (None: chosen by the Governor)."""

    kind: str
    draft_model: Model | None = None
    tokens: int | None = None
    make: Callable[[SamplingParams], Drafter] | None = None

    def __post_init__(self) -> None:
        if self.make is not None:
            self.kind = "custom"
        elif self.kind not in KINDS:
            raise SpeculativeError(
                f"unknown kind {self.kind!r} (known: {', '.join(KINDS)})", field="speculative"
            )
        if self.kind == "draft" and self.draft_model is None:
            raise SpeculativeError("a draft model is needed (--draft-model)", field="draft_model")
        if self.tokens is not None and not (
            isinstance(self.tokens, int) and 1 <= self.tokens <= MAX_DRAFT
        ):
            raise SpeculativeError(
                f"must be an integer in [1, {MAX_DRAFT}], not {self.tokens!r}", field="draft_tokens"
            )

    def drafter(
        self,
        params: SamplingParams,
        target: Model,
        caches: list[Cache] | None = None,
        processors: Sequence[LogitsProcessor] = (),
    ) -> Drafter:
        """A drafter for one request of `target` sampled with `params`; `caches`: the target
        sequence's (a Gemma 4 assistant reads their keys and values); `processors`: the
        request's (a draft model proposes under copies of them: a grammar's mask included)."""
        if self.make is not None:
            return self.make(params)
        if self.kind == "ngram":
            return NgramDrafter()
        if self.kind == "mtp":  # the target's own multi-token-prediction block
            from mlxlis.generation.mtp import MTPDrafter

            return MTPDrafter(target, params)
        if family(self.draft_model.config.family).assists:
            return AssistantDrafter(self.draft_model, target, params, caches)
        vocab = target.config.vocab_size
        return ModelDrafter(self.draft_model, params, processors or None, vocab)


class SpecState:
    """A running sequence's speculation: its drafter, verdicts and governor (the counts are in
    its Usage: draft_tokens, accepted_tokens)."""

    def __init__(
        self,
        spec: Speculation,
        params: SamplingParams,
        target: Model,
        caches: list[Cache] | None = None,
        processors: Sequence[LogitsProcessor] = (),
    ):
        self.spec = spec
        self.drafter = spec.drafter(params, target, caches, processors)
        self.wants_hidden = self.drafter.wants_hidden
        self.judge = Judge(params)
        self.governor = Governor(fixed=spec.tokens)


def speculation_line(usage: Usage, spec: Speculation) -> str:
    """ "draft: 120/169 drafted tokens kept (71 %), k auto, 31.2 tok/s" (--verbose, the
    server's log line, the chat app's status)."""
    n, kept = usage.draft_tokens, usage.accepted_tokens
    rate = f" ({kept / n:.0%})" if n else ""
    line = (
        f"{spec.kind}: {kept}/{n} drafted tokens kept{rate}, k {spec.tokens or 'auto'}, "
        f"{usage.decode_tps:.1f} tok/s"
    )
    return line + (f"; {usage.speculation_note}" if usage.speculation_note else "")


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification of k proposals gives when each is kept with probability α."""
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


__all__ = [
    "Drafter",
    "Governor",
    "Judge",
    "ModelDrafter",
    "NgramDrafter",
    "Proposal",
    "SpecState",
    "Speculation",
    "SpeculativeError",
    "check_vocabulary",
    "expected_tokens",
    "speculation_line",
]
