"""THE generation core: per-request state and one step that every surface uses (the one-shot
command, ChatSession, the chat app, the server's batched engine; a lone prompt is a batch of
one).

`Core.step(seqs)` gives each running sequence one unit of work, in this order:
1. the decoding ones whose next token will be fed: one forward of all of them together (the
   weights read once), queued with their sampled tokens still lazy (`mx.async_eval`), so the
   device computes step t+1 while the host reads token t and turns it into text;
2. every decoding sequence's sampled token read (one wait), checked (stop ids, stop strings,
   max_tokens, cancellation) and emitted as an Event;
3. the next token of each sequence going on sampled from step 1's logits: its logits
   processors (the repetition penalty, masks) on its own row, then its own sampler;
   A speculating sequence (`Request.speculation`) instead reads its pending token, has its
   drafter propose the next k, and one forward verifies them (verify.py; the speculating
   sequences of a step together): it keeps the proposals its sampling agrees with and one
   token of the target's, its caches trimmed back to them (every cache kind rewinds that far:
   `Cache.expect_rewind`);
4. a sequence still reading its prompt gets one chunk (PREFILL_CHUNK tokens) — so a long
   prompt never stalls the streams already running; its last chunk yields the first token. A
   chunk ends early at each of the request's `snapshot_at` positions, where the caches keep a
   snapshot (else they keep one at the prompt's end): recurrent layers and sliding-window
   rings return there exactly when a later prompt shares the start.
A sequence that ends hands its caches to the Steps object (`release`: kept for a later prompt
sharing its start). Where the caches live and how a forward runs is the Steps object's
(steps.py): this process, or the ranks of a pipeline led from rank 0.

A failure inside a step ends the requests it concerned with an "error" event, not the others
(a PipelineError, when the ranks can no longer agree, propagates: nothing more can run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from mlxlis.cache import Cache
from mlxlis.cache.store import by_format, resolve
from mlxlis.errors import MlxlisError, PipelineError, UnsupportedError
from mlxlis.generation.events import Event
from mlxlis.generation.processors import check
from mlxlis.generation.samples import check_samples, fork, orphans
from mlxlis.generation.sequence import REQUEST_IDS, Request, Sequence
from mlxlis.generation.steps import PREFILL_CHUNK, StepKind, Steps, lanes
from mlxlis.generation.verify import propose, verify
from mlxlis.models.model import Model
from mlxlis.models.multimodal import cache_ids

import mlx.core as mx

Emit = Callable[["Sequence", Event], None]


class Core:
    """Runs the sequences of one model, a step at a time, through a Steps object."""

    def __init__(self, model: Model, steps: Steps, chunk: int = PREFILL_CHUNK):
        self.model = model
        self.steps = steps
        self.chunk = chunk
        self.prefilled = 0  # prompt ids its steps have read (not those a cache or fork gave)

    def start(
        self, req: Request, caches: list[Cache] | None = None, held: Seq[int] = ()
    ) -> Sequence:
        """A new sequence for `req`: its caches from the Steps object (a cached prefix taken when
        one helps), or `caches` given holding the ids `held` (then `req.prompt` is what follows
        them)."""
        if not req.prompt:
            raise MlxlisError("empty prompt: nothing to generate from", field="prompt")
        check(req.params.validate(), self.model.tokenizer.vocab_size, req.speculation is not None)
        task = getattr(self.model, "task", "generate")  # the tests' stand-in models have none
        if task != "generate":
            kind = "an embedding model" if task == "embed" else "a reranking model"
            raise UnsupportedError(
                f"{self.model.name} is {kind}: it does not generate (use model.{task} or "
                f"`mlxlis embed`)",
                path=self.model.path,
                field="model",
            )
        if not self.model.config.attention.causal:
            raise UnsupportedError(
                'an encoder (use_bidirectional_attention "all": every position sees every '
                "other) does not generate; read its logits whole (Model.logits)",
                path=self.model.path,
                field="use_bidirectional_attention",
            )
        part = self.model.part
        if req.speculation is not None and part is not None and not part.speculates:
            raise MlxlisError(
                "speculative decoding of a pipelined model is not supported", field="speculative"
            )
        kv = resolve(req.kv_format, self.model.kv_format)
        if req.kv_format != "model":
            if self.model.part is not None and kv != self.model.kv_format:
                raise MlxlisError(
                    "a pipelined model's caches take the format it was started with",
                    field="kv_format",
                )
            self.model.check_kv(kv)
        _, _, tag = self.model.lane(req.adapter, req.adapter_scale)  # checked before admission
        if req.images and (caches is not None or held):
            raise MlxlisError("images come with a fresh request, not given caches", field="images")
        if caches is not None:
            if self.model.part is not None:  # the other ranks' caches follow admitted ones only
                raise MlxlisError(
                    "a pipelined model's caches live in every rank: pass none", field="cache"
                )
            return Sequence(req, self.model, caches, held, req.prompt)
        rid = next(REQUEST_IDS)
        keyed = cache_ids(req.prompt, req.images)  # an image's run keyed by its content
        caches, reused, note = self.steps.admit(rid, keyed, kv, tag)
        seq = Sequence(req, self.model, caches, req.prompt[:reused], req.prompt[reused:], rid)
        seq.usage.reuse_note = note
        for c in caches:  # an entry's caches may come with another request's shift
            c.shift = 0
        seq.set_shift(self.model)
        return seq

    def start_samples(self, reqs: Seq[Request]) -> list[Sequence]:
        """Samples of one prompt (samples.py): the first reads it as `start` does, the others
        wait for a fork of its caches."""
        check_samples(self.model, reqs)
        first = self.start(reqs[0])
        first.twins = [Sequence(r, self.model, [], (), r.prompt) for r in reqs[1:]]
        for t in first.twins:
            t.lead = first
        return [first, *first.twins]

    def step(self, seqs: list[Sequence], emit: Emit | None = None) -> list[tuple[Sequence, Event]]:
        """One unit of work for each of `seqs` (see the module docstring); the events it made,
        each also given to `emit` as soon as it is made (before a prompt chunk runs). A
        sequence that has ended is `done` and its caches released."""
        out: list[tuple[Sequence, Event]] = []
        for s in seqs:
            if s.cancelled and not s.done:
                out.append((s, s.final("cancelled")))
        out += orphans(seqs)
        live = [s for s in seqs if not s.done]
        decoding = [s for s in live if s.pending is not None]
        going = [s for s in decoding if s.goes_on()]
        drafting = self._drafting(going)
        decoding = [s for s in decoding if id(s) not in drafting]
        going = [s for s in going if id(s) not in drafting]
        logits = None
        if going:
            try:
                groups = by_format(going, lambda s: s.kv)
                going = [s for g in groups for s in g]
                logits = mx.concatenate(
                    [
                        self.steps.run(
                            [s.id for s in g],
                            [s.caches for s in g],
                            mx.concatenate([s.pending for s in g]),
                            StepKind.DECODE,
                            lanes=lanes(g),
                        )
                        for g in groups
                    ]
                )
                mx.async_eval(logits)
            except PipelineError:
                raise
            except Exception as e:  # noqa: BLE001 — these requests fail, not the others
                out += self._fail(going, e)
                decoding = [s for s in decoding if not s.done]
                going = []
        if decoding:
            tokens = mx.concatenate([s.pending for s in decoding]).tolist()
            fed = {id(s) for s in going}
            for s, token in zip(decoding, tokens, strict=True):
                if id(s) in fed:
                    s.fed.append(token)
                try:
                    out += [(s, ev) for ev in s.accept(token)]
                except Exception as e:  # noqa: BLE001 — an unreadable token
                    out += self._fail([s], e)
        for i, s in enumerate(going):
            if not s.done:
                try:
                    s.sample(logits[i : i + 1])
                except Exception as e:  # noqa: BLE001 — a processor's failure ends its request
                    out += self._fail([s], e)
        now = time.perf_counter()
        for s in going:  # a lone plain step's time: what speculation must beat
            if s.spec is not None and len(going) == 1 and s.t_plain is not None:
                s.spec.governor.observe_plain(now - s.t_plain)
            s.t_plain = now
        if drafting:
            out += self._speculate([s for s in live if id(s) in drafting], drafting)
        self._deliver(out, 0, emit)
        sent = len(out)
        for s in live:
            if not s.done and s.pending is None and s.todo and s.lead is None:
                out += self._prefill(s)
        self._deliver(out, sent, emit)
        return out

    def _drafting(self, going: list[Sequence]) -> dict[int, int]:
        """The speculating sequences that draft this step: id(seq) -> how many tokens. With
        the draft length left to the Governor, a sequence decodes plainly while others decode
        beside it (each verification is a forward of its own: in a busy batch it costs more
        than the batch's one step gains)."""
        out = {}
        for s in going:
            if s.spec is None:
                continue
            g = s.spec.governor
            if g.fixed is None and len(going) > 1:
                g.note = "speculation rests: other requests decode in the same step"
                continue
            room = s.req.params.max_tokens - s.usage.completion_tokens - 1
            k = g.choose(s.usage.completion_tokens, room)
            s.usage.speculation_note = g.note or s.usage.speculation_note
            if k > 0:
                out[id(s)] = k
        return out

    def _speculate(
        self, seqs: list[Sequence], drafting: dict[int, int]
    ) -> list[tuple[Sequence, Event]]:
        """The speculating sequences' step (verify.py): proposals drafted, verified together,
        each row's verdict; a failure ends the sequences it concerned."""
        drafts, out = [], []
        for s in seqs:
            s.t_plain = None
            try:
                drafts.append(propose(s, drafting[id(s)]))
            except Exception as e:  # noqa: BLE001 — a drafter's failure ends its request
                out += self._fail([s], e)
        try:
            return out + verify(self.steps, self.model.net, drafts)
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001
            return out + self._fail([d.seq for d in drafts if not d.seq.done], e)

    def _deliver(self, out: list[tuple[Sequence, Event]], start: int, emit: Emit | None) -> None:
        """Release the caches of the sequences that ended, then hand on the events."""
        for s, ev in out[start:]:
            if ev.finish_reason is not None:
                self._release(s, ev.finish_reason)
        if emit is not None:
            for s, ev in out[start:]:
                emit(s, ev)

    def _prefill(self, s: Sequence) -> list[tuple[Sequence, Event]]:
        n, kind = s.next_chunk(self.chunk)
        chunk, rest = s.todo[:n], s.todo[n:]
        forked: list[tuple[Sequence, Event]] = []  # the samples that failed their fork
        hidden = s.spec is not None and s.spec.wants_hidden
        try:
            tokens = mx.array(chunk, mx.int32)
            inserts = s.inserts(self.model, n)
            out = self.steps.run(
                [s.id], [s.caches], tokens, kind, inserts, hidden=hidden, lanes=lanes([s])
            )
            self.prefilled += n
            logits = out
            if hidden:  # a drafter reading the target's hidden states gets the prompt's
                logits, states = out
                s.spec.drafter.feed_hidden(chunk, states)
            s.fed += chunk
            s.todo = rest
            s.set_shift(self.model)
            if logits is not None:
                forked = fork(self.model, s, logits)  # the samples waiting for its prompt
                s.sample(logits)
                if s.spec is not None:
                    s.spec.drafter.prepare(s.history)  # a draft model reads the prompt now
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001
            return forked + self._fail([s], e)
        return forked

    def _fail(self, seqs: list[Sequence], e: Exception) -> list[tuple[Sequence, Event]]:
        out = []
        for s in seqs:  # the detokenizer may hold what failed: its tail is not read
            ev = s.final("error", flush=False, error=f"{type(e).__name__}: {e}")
            s.fed = []  # left mid-step: the caches are not consistent
            ev.fed = []
            out.append((s, ev))
        return out

    def _release(self, s: Sequence, reason: str) -> None:
        if s.caches is None:
            return
        ok = reason != "error"  # whole steps only (a prompt's chunks too): consistent
        self.steps.release(s.id, s.cache_ids(s.fed) if ok else None, s.caches, s.tag)
        s.caches = None

    def cancel(self, s: Sequence) -> Event | None:
        """End `s` now (its consumer left): its final event, or None when it had ended."""
        if s.done:
            return None
        ev = s.final("cancelled")
        self._release(s, "cancelled")
        return ev
