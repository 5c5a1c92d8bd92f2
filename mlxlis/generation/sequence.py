"""A request (the prompt and how to continue it) and its state in the core (Sequence):
what core.py runs and samples.py forks."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from mlxlis.cache import Cache
from mlxlis.cache.store import KVChoice, resolve
from mlxlis.errors import MlxlisError
from mlxlis.generation.events import Event, Usage
from mlxlis.generation.processors import LogitsProcessor, VocabularyLimit, processors_for
from mlxlis.generation.sampling import SamplingParams, make_sampler
from mlxlis.generation.speculative import SpecState, Speculation
from mlxlis.generation.steps import StepKind
from mlxlis.generation.stops import StopMatcher
from mlxlis.models.model import Model
from mlxlis.models.multimodal import ImageSpan, Inserts, cache_ids
from mlxlis.runtime.device import peak_memory_bytes
from mlxlis.tokenizer import StreamDecoder

import mlx.core as mx

# request ids, unique in the process (a pipeline's ranks key by them)
REQUEST_IDS = itertools.count(1)


@dataclass
class Request:
    """One generation: the prompt's token ids and how to continue it."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()  # matched across token boundaries, never emitted
    top_logprobs: int | None = None  # None: no logprobs; 0..20: the chosen token's (+ top n)
    processors: tuple[LogitsProcessor, ...] = ()  # applied after the sampling parameters' own
    # positions in the sequence (the prompt, for a request the core admits) where the caches
    # keep a snapshot, such as a chat's end before its generation prompt: what the next turn
    # shares when its template re-renders this reply differently; () : the prompt's end
    snapshot_at: tuple[int, ...] = ()
    speculation: Speculation | None = None  # draft and verify (speculative.py); None: plainly
    kv_format: KVChoice = "model"  # its caches' keys and values: the model's format, or this
    # the images whose placeholder runs the prompt holds (Model.image_spans): each run is fed
    # in one chunk with its image's features in place of its embeddings
    images: tuple[ImageSpan, ...] = ()
    # the LoRA adapter it runs under (one of Model.selectable, by name; None: the base) and
    # a multiplier on its scale: rows on different adapters still share each forward
    adapter: str | None = None
    adapter_scale: float = 1.0


class Sequence:
    """A request's state in the core: its caches, what they hold, what is left to feed, the
    sampled token not yet read, its sampler, processors, detokenizer and usage."""

    def __init__(
        self,
        req: Request,
        model: Model,
        caches: list[Cache],
        held: Seq[int],
        todo: Seq[int],
        rid: int | None = None,
    ):
        self.id = next(REQUEST_IDS) if rid is None else rid
        self.req = req
        self.caches = caches
        self.kv = resolve(req.kv_format, model.kv_format)  # its caches' format (None: dense)
        # its adapter's lane (-1: none), scale, and the tag its caches are kept under
        self.lane, self.lane_scale, self.tag = model.lane(req.adapter, req.adapter_scale)
        self.fed = list(held)  # ids the caches hold
        self.todo = list(todo)  # prompt ids not prefilled yet
        self.history = self.fed + self.todo  # the prompt, then each generated token
        self.usage = Usage(prompt_tokens=len(self.history), cached_tokens=len(self.fed))
        n, asked = len(self.history), req.snapshot_at
        if model.config.rewinds_anywhere:  # a chunk ended early would only cost a forward
            asked = ()
        self.spans = req.images
        inside = {p for s in self.spans for p in range(s.start + 1, s.end)}
        self.marks = sorted({p for p in asked if len(self.fed) < p < n and p not in inside})
        self.snapshot_end = not asked or n in asked
        self.sampler = make_sampler(req.params)
        limit = [VocabularyLimit(model.tokenizer.vocab_size)]  # before any processor reads it
        own = processors_for(req.params, model.tokenizer)  # DRY reads its breakers' tokens
        self.processors = [*limit, *own, *req.processors]
        self.decoder = StreamDecoder(model.tokenizer)
        self.stops = StopMatcher(req.stop_strings)
        self.pending: mx.array | None = None  # (1,) the sampled token, not read yet
        self.logprobs: mx.array | None = None  # (1, vocab) its step's log-probabilities
        self.cancelled = False
        self.done = False
        self.t0 = time.perf_counter()
        spec = req.speculation
        self.spec = None
        if spec is not None:  # its drafter proposes under copies of the processors
            self.spec = SpecState(spec, req.params, model, caches, self.processors)
        self.t_plain: float | None = None  # when its last plain decode step ended
        # samples of one prompt (samples.py): the one reading it and those waiting for a fork
        self.lead: Sequence | None = None  # the sample whose caches this one waits for
        self.twins: list[Sequence] = []  # the samples waiting for this one's caches

    def next_chunk(self, size: int) -> tuple[int, StepKind]:
        """How many prompt ids the next prefill step feeds (at most `size`, ending at the next
        snapshot position) and its kind for `Steps.run`."""
        at = len(self.fed)
        mark = next((p for p in self.marks if p > at), None)
        n = size if mark is None else min(size, mark - at)
        for s in self.spans:  # an image's run is one chunk's: before it, else all of it
            if s.start < at + n < s.end:
                n = s.start - at if s.start > at else s.end - at
        if n < len(self.todo):
            return n, StepKind.MARK if at + n == mark else StepKind.CHUNK
        return len(self.todo), StepKind.PROMPT if self.snapshot_end else StepKind.LAST

    def inserts(self, model: Model, n: int) -> Inserts | None:
        """The images whose runs the next `n` prompt ids hold, their features computed."""
        at = len(self.fed)
        parts = [
            (s.start - at, model.image_features(s.image))
            for s in self.spans
            if at <= s.start < at + n
        ]
        return model.inserts(parts, self.spans, at, n) if parts else None

    def set_shift(self, model: Model) -> None:
        """The caches' RoPE shift where they stand now (multimodal.Vision.shift)."""
        if self.spans:
            shift = model.vision.shift(self.spans, len(self.fed))
            for c in self.caches:
                c.shift = shift

    def cache_ids(self, ids: Seq[int]) -> list[int]:
        """`ids` (a prefix of the history) as the caches key them (images by content)."""
        return cache_ids(ids, self.spans)

    def process(self, logits: mx.array) -> mx.array:
        """This sequence's row of logits (1, vocab) after its processors (given the history so
        far); their log-probabilities kept when the request asked for them."""
        shape = logits.shape
        for process in self.processors:
            logits = process(logits, self.history)
            if logits.shape != shape:  # a processor's bug would otherwise end the whole batch
                raise MlxlisError(f"{type(process).__name__} gave logits of shape {logits.shape}")
        if self.req.top_logprobs is not None:
            self.logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return logits

    def sample(self, logits: mx.array) -> None:
        """The next token from this sequence's row of logits (1, vocab), lazily."""
        self.pending = self.sampler(self.process(logits))
        mx.async_eval(self.pending)

    def goes_on(self) -> bool:
        """Whether the pending token, once read, will be fed for another step."""
        return not self.cancelled and self.usage.completion_tokens + 1 < self.req.params.max_tokens

    def accept(self, token: int) -> list[Event]:
        """The pending token read: its event, and the final one when it ends the request."""
        self.pending = None
        u = self.usage
        now = time.perf_counter()
        if u.completion_tokens == 0:
            u.time_to_first_token = now - self.t0
        u.completion_tokens += 1
        u.decode_seconds = now - self.t0 - u.time_to_first_token
        if token in self.req.stop_ids:
            return [self.final("stop")]
        self.history.append(token)
        text, stopped = self.stops.feed(self.decoder.add(token))
        logprob, top = self._logprobs(token)
        events = [] if stopped and not text else [self._event(token, text, logprob, top)]
        if stopped:
            return [*events, self.final("stop", flush=False)]
        if u.completion_tokens >= self.req.params.max_tokens:
            return [*events, self.final("length")]
        return events

    def _logprobs(self, token: int) -> tuple[float | None, list[tuple[int, float]] | None]:
        if self.logprobs is None:
            return None, None
        logp = self.logprobs[0]
        top = None
        if self.req.top_logprobs:
            idx = mx.argsort(-logp)[: self.req.top_logprobs]
            top = list(zip(idx.tolist(), logp[idx].tolist(), strict=True))
        return float(logp[token].item()), top

    def _event(
        self,
        token: int | None,
        text: str,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
    ) -> Event:
        return Event(token, text, self.usage, logprob=logprob, top_logprobs=top)

    def final(self, reason: str, flush: bool = True, error: str | None = None) -> Event:
        """The last event: what the detokenizer and the stop matcher still hold (unless a stop
        string ended it: what follows one is never shown)."""
        self.done = True
        self.pending = None
        tail = self.stops.feed(self.decoder.flush())[0] + self.stops.flush() if flush else ""
        self.usage.peak_memory = peak_memory_bytes()
        if self.usage.completion_tokens == 0:
            self.usage.time_to_first_token = time.perf_counter() - self.t0
        ev = self._event(None, tail)
        ev.finish_reason, ev.error, ev.fed = reason, error, list(self.fed)
        ev.stop_sequence = self.stops.matched
        return ev
