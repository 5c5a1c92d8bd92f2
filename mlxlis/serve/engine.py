"""The serving engine: many generation requests over one model, scheduled step by step.

`Engine.submit(GenRequest)` returns a `Stream` of `GenEvent`s (iterate it, or `async for` it
when submitted with an event loop). One scheduler loop runs on the process's MLX thread: each
round gives every active request one unit of work — the requests that are decoding get one
token each from a single batched forward pass (the weights read once for all of them), a
request still reading its prompt gets one chunk (PREFILL_CHUNK tokens) — so a long prompt
never stalls the streams already running, and a request that is cancelled (client gone)
leaves at the next round. At most `max_active` requests run;
`max_queued` more may wait (beyond that `submit` raises QueueFullError: HTTP 429).

Each request keeps its own per-layer caches, built and advanced as `mlxlis.generate` does
for a single prompt. In the batched step the projections and MLPs run on the batch; the KV
caches of the requests decoding together are stacked (cache.KVBatch, copied once when the
batch's members change) so each layer attends once over all of them, masked to each row's own
keys; recurrent states are stacked per step. A request's greedy tokens are those it gets
alone (up to the last bits of a batched vs a single-row product). The prefix cache
(prefix.py) keeps the caches of recent requests: a new prompt takes over the one sharing its
longest prefix and prefills only the rest. Where the caches live and how a step runs is the
Steps object's (steps.py): this process, or a pipeline of ranks under mlx.launch led from
rank 0 (distributed/serving.py).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from .. import mlx_thread
from ..errors import MlxlisError, PipelineError
from ..sampling import SamplingParams, apply_repetition_penalty, make_sampler
from ..vocab import StreamDecoder
from .prefix import PrefixCache
from .steps import LocalSteps

__all__ = ["Engine", "GenEvent", "GenRequest", "PrefixCache", "QueueFullError", "Stream",
           "StopMatcher", "Usage"]  # fmt: skip

PREFILL_CHUNK = 256  # prompt tokens per round (the others decode one token meanwhile)


class QueueFullError(MlxlisError):
    """Too many requests waiting: try again later (HTTP 429)."""


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()  # matched across token boundaries, never emitted
    top_logprobs: int | None = None  # None: no logprobs; 0..20: the chosen token's (+ top n)


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    completion_tokens: int = 0
    time_to_first_token: float = 0.0
    decode_seconds: float = 0.0


@dataclass
class GenEvent:
    text: str  # newly completed text (stop strings held back, never emitted)
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" (last event)
    usage: Usage | None = None  # on the last event
    error: str | None = None


class Stream:
    """The events of one request, in order; the last has a finish_reason."""

    def __init__(self, rid: int, loop: asyncio.AbstractEventLoop | None):
        self.id = rid
        self._loop = loop
        self._sync: queue.Queue[GenEvent] = queue.Queue()
        self._async: asyncio.Queue[GenEvent] | None = asyncio.Queue() if loop else None
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop generating (the client left); the stream ends with finish_reason "cancelled"."""
        self.cancelled.set()

    def _put(self, ev: GenEvent) -> None:
        if self._async is not None:
            self._loop.call_soon_threadsafe(self._async.put_nowait, ev)
        else:
            self._sync.put(ev)

    def __iter__(self) -> Iterator[GenEvent]:
        while True:
            ev = self._sync.get()
            yield ev
            if ev.finish_reason is not None:
                return

    async def __aiter__(self):
        assert self._async is not None, "submitted without an event loop: iterate it instead"
        while True:
            ev = await self._async.get()
            yield ev
            if ev.finish_reason is not None:
                return


class StopMatcher:
    """Text out, stop strings cut: holds back any tail that may begin a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, a stop string was reached)."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = max((n for s in self.stops for n in range(1, min(len(s), len(buf) + 1))
                    if buf.endswith(s[:n])), default=0)  # fmt: skip
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


@dataclass
class _Active:
    req: GenRequest
    stream: Stream
    caches: list
    fed: list[int]  # ids in the caches
    todo: list[int]  # prompt ids not prefilled yet
    usage: Usage
    sampler: object
    decoder: StreamDecoder
    stops: StopMatcher
    recent: list[int]
    t0: float
    next_token: int | None = None  # sampled, not yet fed


class Engine:
    def __init__(self, model, *, max_active: int = 8, max_queued: int = 64,
                 prefix_cache_bytes: int = 1 << 30):  # fmt: skip
        self.model = model
        self.max_active, self.max_queued = max_active, max_queued
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.steps = steps_for(model, self.prefix)
        self.fatal: str | None = None  # why the engine stopped on its own (a rank was lost)
        self.on_fatal: Callable[[str], None] | None = None  # told it, on the MLX thread
        self._queue: list[_Active] = []
        self._active: list[_Active] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._ids = itertools.count(1)
        self._done = mlx_thread.shared().submit(self._loop)

    # --- the caller's side ---
    def submit(self, req: GenRequest, loop: asyncio.AbstractEventLoop | None = None) -> Stream:
        if not req.prompt_ids:
            raise MlxlisError("empty prompt: nothing to generate from", field="prompt")
        req.params.validate()
        stream = Stream(next(self._ids), loop)
        with self._cv:
            if self._stopping:
                raise MlxlisError("the server is shutting down")
            self._drop_cancelled()
            # places: the free running ones plus the waiting room (not yet admitted counts)
            if len(self._queue) + len(self._active) >= self.max_active + self.max_queued:
                raise QueueFullError(f"{len(self._queue)} requests are waiting already")
            self._queue.append(self._new(req, stream))
            self._cv.notify()
        return stream

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish every request with an "error" event and stop the loop."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._done.result(timeout)

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cv:
            return len(self._active), len(self._queue)

    def _drop_cancelled(self) -> None:
        """Requests cancelled while waiting leave the queue at once (called under the lock)."""
        for a in [a for a in self._queue if a.stream.cancelled.is_set()]:
            self._queue.remove(a)
            a.stream._put(GenEvent("", finish_reason="cancelled", usage=a.usage))

    # --- the MLX thread's side ---
    def _new(self, req: GenRequest, stream: Stream) -> _Active:
        params = req.params
        n = params.repetition_context
        return _Active(req, stream, [], [], list(req.prompt_ids),
                       Usage(prompt_tokens=len(req.prompt_ids)), make_sampler(params),
                       StreamDecoder(self.model.tokenizer), StopMatcher(req.stop_strings),
                       list(req.prompt_ids)[-n:], time.perf_counter())  # fmt: skip

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._active and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    for a in self._queue + self._active:
                        a.stream._put(GenEvent("", finish_reason="error", usage=a.usage,
                                               error="the server is shutting down"))  # fmt: skip
                    self._queue, self._active = [], []
                    break
                self._drop_cancelled()
                while self._queue and len(self._active) < self.max_active:
                    self._active.append(self._queue.pop(0))
                active = list(self._active)
            ready = [a for a in active if a.next_token is not None and not a.todo
                     and not a.stream.cancelled.is_set()]  # fmt: skip
            try:
                if len(ready) > 1 and self.steps.batches:
                    self._run(ready, self._decode_batch)
                    active = [a for a in active if a not in ready]
                for a in active:
                    self._run([a], lambda one: [self._step(one[0])])
            except PipelineError as e:  # the ranks are out of step: nothing more can run
                self._fail(str(e))
                return
        self._close_steps()

    def _fail(self, message: str) -> None:
        self.fatal = message
        with self._cv:
            self._stopping = True
            for a in self._queue + self._active:
                a.stream._put(GenEvent("", finish_reason="error", usage=a.usage, error=message))
            self._queue, self._active = [], []
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _close_steps(self) -> None:
        try:
            self.steps.close()
        except PipelineError as e:  # the other ranks are already gone
            self.fatal = str(e)
            if self.on_fatal is not None:
                self.on_fatal(str(e))

    def _run(self, group: list[_Active], work) -> None:
        """`work(group)` -> done flags; a failure ends the group's requests with "error"."""
        try:
            done = work(group)
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001 — a failure ends these requests, not the server
            for a in group:
                a.stream._put(GenEvent("", finish_reason="error", usage=a.usage,
                                       error=f"{type(e).__name__}: {e}"))  # fmt: skip
                if a.caches:  # left mid-step: not consistent
                    self.steps.release(a.stream.id, None, a.caches)
                    a.caches = []
            done = [True] * len(group)
        with self._cv:
            for a, d in zip(group, done, strict=True):
                if d:
                    self._active.remove(a)

    def _decode_batch(self, group: list[_Active]) -> list[bool]:
        """One token for every request of `group` in one forward pass (weights read once)."""
        logits = self.steps.run([a.stream.id for a in group], [a.caches for a in group],
                                [[a.next_token] for a in group], "decode")  # (B, vocab)
        done = []
        for i, a in enumerate(group):
            a.fed.append(a.next_token)
            done.append(self._emit(a, logits[i : i + 1]))
        return done

    def _step(self, a: _Active) -> bool:
        """One unit of work for `a`; True when it has finished."""
        if a.stream.cancelled.is_set():
            return self._finish(a, "cancelled")
        rid = a.stream.id
        if not a.caches:  # admitted: take a cached prefix if one helps
            a.caches, reused = self.steps.admit(rid, a.todo)
            a.fed, a.todo = list(a.todo[:reused]), a.todo[reused:]
            a.usage.cached_tokens = reused
        if a.todo:  # prefill a chunk; the last one yields the first token's logits
            chunk, a.todo = a.todo[:PREFILL_CHUNK], a.todo[PREFILL_CHUNK:]
            logits = self.steps.run([rid], [a.caches], [chunk], "chunk" if a.todo else "prompt")
            a.fed += chunk
            return False if logits is None else self._emit(a, logits)
        logits = self.steps.run([rid], [a.caches], [[a.next_token]], "decode")
        a.fed.append(a.next_token)
        return self._emit(a, logits)

    def _emit(self, a: _Active, logits: mx.array) -> bool:
        """Sample from `logits`, send the token's text; True when the request is done."""
        p = a.req.params
        if p.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, a.recent[-p.repetition_context:],
                                              p.repetition_penalty)  # fmt: skip
        tok = a.sampler(logits)
        logprob, top = None, None
        if a.req.top_logprobs is not None:
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            logprob = float(logp[0, tok.item()].item())
            if a.req.top_logprobs:
                k = a.req.top_logprobs
                idx = mx.argsort(-logp[0])[:k]
                top = list(zip(idx.tolist(), logp[0, idx].tolist(), strict=True))
        token = int(tok.item())
        now = time.perf_counter()
        u = a.usage
        if u.completion_tokens == 0:
            u.time_to_first_token = now - a.t0
        u.completion_tokens += 1
        u.decode_seconds = now - a.t0 - u.time_to_first_token
        if token in a.req.stop_ids:
            return self._finish(a, "stop")
        a.recent.append(token)
        text, stopped = a.stops.feed(a.decoder.add(token))
        if stopped:
            if text:
                a.stream._put(GenEvent(text, token, logprob, top))
            return self._finish(a, "stop")
        a.stream._put(GenEvent(text, token, logprob, top))
        if u.completion_tokens >= p.max_tokens:
            return self._finish(a, "length")
        a.next_token = token
        return False

    def _finish(self, a: _Active, reason: str) -> bool:
        tail = "" if reason == "stop" else a.stops.feed(a.decoder.flush())[0] + a.stops.flush()
        a.stream._put(GenEvent(tail, finish_reason=reason, usage=a.usage))
        if a.caches:  # consistent (whole prompt fed): keep it for a later prefix
            self.steps.release(a.stream.id, a.fed if not a.todo else None, a.caches)
        a.caches = []
        return True


def steps_for(model, prefix: PrefixCache):
    """Rank 0's LeaderSteps for a model pipelined across ranks, else LocalSteps."""
    if getattr(model.net, "is_pipeline", False):
        from ..distributed.serving import LeaderSteps

        return LeaderSteps(model, prefix)
    return LocalSteps(model, prefix)
