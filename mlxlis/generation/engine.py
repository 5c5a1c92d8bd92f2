"""The serving engine: many requests over one model, on the generation core, step by step.

`Engine.submit(Request)` returns a `Stream` of Events (iterate it, or `async for` it when
submitted with an event loop). The engine is a worker of the process's MLX thread
(runtime/mlx_thread.py), in turn with the other models' engines: each round
is one `Core.step` over the running requests (the decoding ones get one token each from a
single batched forward, a request still reading its prompt gets one chunk), so a long prompt
never stalls the streams already running, and a request that is cancelled (client gone)
leaves at the next round. At most `max_active` requests run; `max_queued` more may wait
(beyond that `submit` raises QueueFullError: HTTP 429).

A request's greedy tokens are those it gets alone (up to the last bits of a batched vs a
single-row product). The prefix cache keeps the caches of finished requests: a new prompt
takes over the one sharing its longest prefix and prefills only the rest. Where the caches
live and how a step runs is the model's Steps (steps.py: this process, or a pipeline of ranks
led from rank 0).

An engine still running when the interpreter exits is shut down first (atexit): its rounds on
the MLX thread must not be torn down mid-step.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import traceback
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from mlxlis.cache.disk import DiskCache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.cache.store import KVChoice, KVFormat, resolve
from mlxlis.errors import MlxlisError, PipelineError
from mlxlis.generation.core import Core, Request, Sequence
from mlxlis.generation.events import Event, Usage
from mlxlis.generation.steps import steps_for
from mlxlis.models.footprint import Footprint
from mlxlis.models.model import Model
from mlxlis.runtime import mlx_thread

__all__ = [
    "Engine",
    "MemoryFullError",
    "MemoryPlan",
    "QueueFullError",
    "Stream",
    "TooLongForMemoryError",
]


MAX_FAILED_ROUNDS = 3  # steps failing in a row before the engine stops (fatal)
# events a stream may hold unread before its request is cancelled: a client that stops reading
# (its socket's buffers full) held its whole reply in memory, ~17 MB for 4 000 tokens with 20
# top logprobs; one that reads keeps a handful
MAX_UNREAD = 1024
_log = logging.getLogger("mlxlis.engine")


class QueueFullError(MlxlisError):
    """Too many requests waiting: try again later (HTTP 429)."""


class MemoryFullError(MlxlisError):
    """The requests running and waiting hold the memory this one needs: later (HTTP 503)."""


class TooLongForMemoryError(MlxlisError):
    """The request's context would not fit the memory even alone (HTTP 400)."""


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine's requests may hold: `room` bytes for their caches (the budget less the
    weights and the prefix cache's bound), each request's caches as the footprint of its KV
    format says for its prompt + max_tokens (`footprint`: the model's own format `kv`;
    `formats`: the others a request may ask for). The caches of requests of one format
    decoding together are stacked padded to the longest (cache/batch.py), so n of them
    reserve n times the longest one's."""

    footprint: Footprint
    room: int
    context: int  # a request's tokens when its max_tokens is unset
    kv: KVFormat | None = None
    formats: Mapping[KVFormat | None, Footprint] = field(default_factory=dict)

    def of(self, choice: KVChoice) -> Footprint:
        kv = resolve(choice, self.kv)
        if kv == self.kv:
            return self.footprint
        if kv not in self.formats:
            raise MlxlisError(f"no memory plan for KV format {kv or 'dense'}", field="kv_format")
        return self.formats[kv]

    def need(self, reqs: list[Request]) -> int:
        groups: dict[KVFormat | None, list[Request]] = {}
        for r in reqs:
            groups.setdefault(resolve(r.kv_format, self.kv), []).append(r)
        total = 0
        for kv, rs in groups.items():
            longest = max(len(r.prompt) + (r.params.max_tokens or self.context) for r in rs)
            total += len(rs) * self.of(kv).reserve(min(longest, self.context))
        return total


class Stream:
    """The events of one request, in order; the last has a finish_reason."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None):
        self.id = 0  # the core's request id, once admitted
        self._loop = loop
        self._sync: queue.Queue[Event] = queue.Queue()
        self._async: asyncio.Queue[Event] | None = asyncio.Queue() if loop else None
        self.cancelled = threading.Event()
        self._sent = self._read = 0  # each written by one thread only: their difference unread
        # set when the core takes the request: its Usage (prompt and reused tokens) known
        # before its prompt is read, for an API that reports them at the start of a stream
        self.admitted: asyncio.Future[Usage] | None = loop.create_future() if loop else None

    def cancel(self) -> None:
        """Stop generating (the client left); the stream ends with finish_reason "cancelled"."""
        self.cancelled.set()

    def _put(self, ev: Event) -> None:
        self._sent += 1
        if self._sent - self._read > MAX_UNREAD:  # nobody reads it: it ends (cancelled)
            self.cancelled.set()
        if self._async is None:
            self._sync.put(ev)
            return
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, ev)
        except RuntimeError:  # its event loop is closed: nobody reads it any more
            self.cancelled.set()

    def _admit(self, usage: Usage) -> None:
        fut = self.admitted
        if fut is not None:
            try:
                self._loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(usage))
            except RuntimeError:  # its event loop is closed: nobody reads it any more
                self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self._sync.get()
            self._read += 1
            yield ev
            if ev.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        assert self._async is not None, "submitted without an event loop: iterate it instead"
        while True:
            ev = await self._async.get()
            self._read += 1
            yield ev
            if ev.finish_reason is not None:
                return


def _ended(reason: str, error: str | None = None, usage: Usage | None = None) -> Event:
    return Event(None, "", usage or Usage(), finish_reason=reason, error=error)


class Engine:
    def __init__(
        self,
        model: Model,
        *,
        max_active: int = 8,
        max_queued: int = 64,
        prefix_cache_bytes: int = 1 << 30,
        memory: MemoryPlan | None = None,
        disk: DiskCache | None = None,
    ):
        """`memory`: refuse requests whose caches would outgrow it (None: no check)."""
        self.model = model
        self.memory = memory
        self.max_active, self.max_queued = max_active, max_queued
        self.prefix = PrefixCache(prefix_cache_bytes, disk=disk)
        self.steps = steps_for(model, self.prefix)
        self.core = Core(model, self.steps)
        self.fatal: str | None = None  # why the engine stopped on its own (a rank was lost)
        self.on_fatal: Callable[[str], None] | None = None  # told it, on the MLX thread
        # told of a step that failed outside any one request (with its traceback): its
        # requests end with an error, the loop goes on
        self.on_error: Callable[[str], None] = _log.error
        # bytes the requests of the other models' engines in this process hold (serve/pool.py):
        # this engine's requests fit in its plan's room less that
        self.others: Callable[[], int] | None = None
        self._failed_rounds = 0  # in a row: MAX_FAILED_ROUNDS of them and the engine stops
        # waiting: groups of requests with their streams (the samples of one prompt, or one)
        self._queue: list[tuple[list[Request], list[Stream]]] = []
        self._active: list[tuple[Sequence, Stream]] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._done: Future = Future()  # set when the loop has stopped
        self._thread = mlx_thread.shared()
        self._thread.add(self)  # its rounds, in turn with other engines' (one per model)
        _live.add(self)

    # --- the caller's side ---
    def submit(self, req: Request, loop: asyncio.AbstractEventLoop | None = None) -> Stream:
        return self.submit_samples([req], loop)[0]

    def submit_samples(
        self, reqs: list[Request], loop: asyncio.AbstractEventLoop | None = None
    ) -> list[Stream]:
        """Samples of one prompt (OpenAI's `n`; generation/samples.py): admitted together, the
        prompt read once, its caches forked for the others; at most `max_active` of them (a
        MlxlisError naming `n` beyond)."""
        if len(reqs) > self.max_active:
            raise MlxlisError(
                f"n: at most {self.max_active} samples (the server's batch), not {len(reqs)}",
                field="n",
            )
        for req in reqs:
            if not req.prompt:
                raise MlxlisError("empty prompt: nothing to generate from", field="prompt")
            req.params.validate()
            self.model.lane(req.adapter, req.adapter_scale)  # an adapter it has, a sane scale
        streams = [Stream(loop) for _ in reqs]
        others = self.others() if self.others is not None else 0
        with self._cv:
            if self._stopping:
                raise MlxlisError(
                    f"the engine stopped: {self.fatal}"
                    if self.fatal
                    else "the server is shutting down"
                )
            self._drop_cancelled()
            # places: the free running ones plus the waiting room (not yet admitted counts)
            waiting = sum(len(rs) for rs, _ in self._queue)
            if waiting + len(self._active) + len(reqs) > self.max_active + self.max_queued:
                raise QueueFullError(f"{waiting} requests are waiting already")
            self._check_memory(reqs, others)
            self._queue.append((list(reqs), streams))
        self._thread.wake()
        return streams

    def reserved(self) -> int:
        """Bytes the caches of the requests running and waiting may reach (0 without a plan)."""
        plan = self.memory
        with self._cv:
            held = [r for rs, _ in self._queue for r in rs] + [s.req for s, _ in self._active]
        return plan.need(held) if plan is not None and held else 0

    def _check_memory(self, reqs: list[Request], others: int = 0) -> None:
        """Under the lock: refuse `reqs` if their caches, with those of the requests running and
        waiting (here, and `others` bytes in other engines), could outgrow the memory plan
        (before anything is allocated)."""
        plan = self.memory
        if plan is None:
            return
        room = plan.room - others
        req = reqs[0]
        alone = plan.need(reqs)
        if alone > plan.room:
            raise TooLongForMemoryError(
                f"its caches would need {alone / 2**20:.0f} MiB at {len(req.prompt)} prompt + "
                f"{req.params.max_tokens} new tokens, and {max(plan.room, 0) / 2**20:.0f} MiB "
                "are left for caches beside the weights (MLXLIS_MAX_MEMORY, --kv-bits)",
                field="max_tokens",
            )
        held = [r for rs, _ in self._queue for r in rs] + [s.req for s, _ in self._active]
        need = plan.need([*held, *reqs])
        if need > room:
            elsewhere = (
                f", other models' requests holding {others / 2**20:.0f} MiB" if others else ""
            )
            raise MemoryFullError(
                f"the {len(held)} requests running and waiting hold the memory it needs "
                f"({need / 2**20:.0f} MiB of {room / 2**20:.0f} MiB with it{elsewhere})"
            )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish every request with an "error" event and stop the loop."""
        with self._cv:
            self._stopping = True
        self._thread.wake()
        self._done.result(timeout)
        _live.discard(self)

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cv:
            return len(self._active), sum(len(rs) for rs, _ in self._queue)

    @property
    def prefilled(self) -> int:
        """Prompt ids its steps have read so far (not those a cache or a fork gave)."""
        return self.core.prefilled

    def _drop_cancelled(self) -> None:
        """Requests cancelled while waiting leave the queue at once (called under the lock); a
        group of samples when all of them are."""
        for reqs, streams in [q for q in self._queue if all(s.cancelled.is_set() for s in q[1])]:
            self._queue.remove((reqs, streams))
            for req, stream in zip(reqs, streams, strict=True):
                stream._put(_ended("cancelled", usage=Usage(prompt_tokens=len(req.prompt))))

    # --- the MLX thread's side (mlx_thread.Worker) ---
    def has_work(self) -> bool:
        return bool(self._queue or self._active or self._stopping)

    def run_round(self) -> bool:
        """One round; False once the engine has stopped (its steps closed)."""
        try:
            more = self._round()
        except BaseException as e:  # the loop's own failure: said, never a silent hang
            self.on_error(traceback.format_exc())
            self._fail(f"the engine's loop failed: {type(e).__name__}: {e}")
            more = False
        if not more:
            try:
                self._close_steps()
            finally:
                self._done.set_result(None)
        return more

    def _round(self) -> bool:
        """Admit what fits, run one core step; False once the engine is stopping."""
        with self._cv:
            if not self._queue and not self._active and not self._stopping:
                return True
            if self._stopping:
                self._end_all("the server is shutting down")
                return False
            self._drop_cancelled()
            waiting: list[tuple[list[Request], list[Stream]]] = []
            running = len(self._active)
            while self._queue and running + len(self._queue[0][0]) <= self.max_active:
                waiting.append(self._queue.pop(0))
                running += len(waiting[-1][0])
        try:
            for reqs, streams in waiting:  # each admitted or ended: never lost between
                try:
                    self._admit(reqs, streams)
                except PipelineError:
                    raise
                except Exception as e:  # noqa: BLE001 — it fails, not those after it
                    for stream in streams:
                        stream._put(_ended("error", f"{type(e).__name__}: {e}"))
            for seq, stream in self._active:
                if stream.cancelled.is_set():
                    seq.cancelled = True
            streams = {id(seq): stream for seq, stream in self._active}
            self.core.step(
                [seq for seq, _ in self._active], lambda seq, ev: streams[id(seq)]._put(ev)
            )
        except PipelineError as e:  # the ranks are out of step: nothing more can run
            self._fail(str(e))
            return False
        except Exception as e:  # noqa: BLE001 — no one request's
            self._step_failed(e)
            if self._stopping:
                return False
        else:
            self._failed_rounds = 0
        with self._cv:
            self._active = [(s, st) for s, st in self._active if not s.done]
        return True

    def _step_failed(self, e: Exception) -> None:
        """A step failed outside the core's per-request guards (a bug): its requests end with
        an error and their caches are dropped (left mid-step); the loop goes on unless it
        keeps failing."""
        self.on_error(traceback.format_exc())
        message = f"the engine's step failed: {type(e).__name__}: {e}"
        for seq, stream in self._active:
            if seq.done:
                continue
            try:
                stream._put(seq.final("error", flush=False, error=message))
                if seq.caches is not None:
                    caches, seq.caches = seq.caches, None
                    self.steps.release(seq.id, None, caches)
            except PipelineError:
                raise
            except Exception:  # noqa: BLE001 — it has ended whatever else is wrong
                seq.done = True
                stream._put(_ended("error", message, seq.usage))
        self._failed_rounds += 1
        if self._failed_rounds >= MAX_FAILED_ROUNDS:
            self._fail(f"{message} ({self._failed_rounds} steps in a row)")

    def _admit(self, reqs: list[Request], streams: list[Stream]) -> None:
        try:
            seqs = self.core.start_samples(reqs) if len(reqs) > 1 else [self.core.start(reqs[0])]
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001 — this request fails, not the server
            for stream in streams:
                stream._put(_ended("error", f"{type(e).__name__}: {e}"))
            return
        for seq, stream in zip(seqs, streams, strict=True):
            stream.id = seq.id
            stream._admit(replace(seq.usage))  # a copy: the MLX thread goes on updating its own
        with self._cv:
            self._active += zip(seqs, streams, strict=True)

    def _end_all(self, message: str) -> None:
        """Under the lock: every request ends with an "error" event."""
        for reqs, streams in self._queue:
            for req, stream in zip(reqs, streams, strict=True):
                stream._put(_ended("error", message, Usage(prompt_tokens=len(req.prompt))))
        for seq, stream in self._active:
            stream._put(_ended("error", message, seq.usage))
        self._queue, self._active = [], []

    def _fail(self, message: str) -> None:
        self.fatal = message
        with self._cv:
            self._stopping = True
            self._end_all(message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _close_steps(self) -> None:
        try:
            self.steps.close()
        except PipelineError as e:  # the other ranks are already gone
            self.fatal = str(e)
            if self.on_fatal is not None:
                self.on_fatal(str(e))


# engines still running: shut down before the interpreter exits (an engine left running
# through finalization ended the process with "terminate called without an active exception")
_live: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_live() -> None:
    for engine in list(_live):
        try:
            engine.shutdown(timeout=5.0)
        except Exception:  # noqa: BLE001, S110 — exiting anyway
            pass
