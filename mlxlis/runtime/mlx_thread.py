"""One long-lived daemon thread for MLX work done off the main thread.

MLX keeps its compile cache per thread, and the cache's entries hold Python callables (the
compiled kernels of fastmath and sampling). When a thread that compiled something exits, its
thread-local destructors release those callables, which needs the GIL. A short-lived worker
(Textual's thread workers, a ThreadPoolExecutor) exits while the interpreter is shutting down;
the destructor then asks for the GIL during finalization, Python ends the thread with a forced
unwind through MLX's C++ destructor, and the process aborts ("terminate called without an
active exception", exit status 134).

So MLX work that cannot run on the main thread goes to one daemon thread that never exits:
at shutdown it is blocked waiting for work (no GIL, no thread-local destructors run) and the
process ends around it. Before the interpreter shuts down, callers stop what is running (the
generation loop checks its stop flag between tokens and prefill chunks) and `wait_idle()`.

The thread runs two kinds of work: jobs (a callable, run once: a load, a warm-up) and
workers (a generation engine: one round at a time while it has work). Each engine is a
worker, so several models' engines share the thread in turn: one round of each engine with
work, then one waiting job, then again; a long prompt of one model delays another model's
decoding by one prefill chunk, never by the whole prompt.
"""

from __future__ import annotations

import threading
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

_lock = threading.Lock()
_threads: dict[str, MlxThread] = {}  # by name: the MLX thread, the loading thread


class Worker(Protocol):
    """What the thread runs in turns (generation/engine.Engine)."""

    def has_work(self) -> bool:
        """Whether a round would do anything now (called under the thread's lock)."""
        ...

    def run_round(self) -> bool:
        """One round of work; False once the worker is done (it is dropped)."""
        ...


class MlxThread:
    """A single daemon thread running submitted callables in order, and its workers' rounds
    in turn between them."""

    def __init__(self, name: str = "mlxlis-mlx") -> None:
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self._workers: list[Worker] = []
        self._turn = 0  # the worker whose round comes first next time (round robin)
        self.cond = threading.Condition()  # jobs and workers' state: notify() on a change
        self._busy = False  # a job or a round is running
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the thread after the jobs before it (and between workers' rounds);
        its result or exception lands in the returned Future."""
        fut: Future = Future()
        with self.cond:
            self._jobs.append((fn, fut))
            self.cond.notify_all()
        return fut

    def add(self, worker: Worker) -> None:
        """Run `worker`'s rounds on the thread, in turn with the others', until one returns
        False."""
        with self.cond:
            self._workers.append(worker)
            self.cond.notify_all()

    def wake(self) -> None:
        """A worker's state changed (a request came, a stop was asked): look again."""
        with self.cond:
            self.cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running and no worker has work; False if `timeout`
        seconds passed first."""
        with self.cond:
            return self.cond.wait_for(self._idle, timeout)

    def _idle(self) -> bool:
        return not (self._busy or self._jobs or any(w.has_work() for w in self._workers))

    def _next(self) -> tuple[Callable[[], Any], Future] | Worker:
        """Under the lock: the next job or worker round, waiting for one."""
        while True:
            ready = [i for i, w in enumerate(self._workers) if w.has_work()]
            later = [i for i in ready if i >= self._turn]
            if later or (ready and not self._jobs):
                i = (later or ready)[0]
                self._turn = i + 1
                return self._workers[i]
            if self._jobs:  # every ready worker had its round since the last job
                self._turn = 0
                return self._jobs.popleft()
            self.cond.notify_all()  # idle: wake wait_idle()
            self.cond.wait()

    def _run(self) -> None:
        while True:
            with self.cond:
                self._busy = False
                work = self._next()
                self._busy = True
            try:
                if isinstance(work, tuple):
                    fn, fut = work
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except BaseException as e:  # noqa: BLE001 — handed to the caller
                            fut.set_exception(e)
                    del fn, fut  # drop references before waiting again
                else:
                    try:
                        more = work.run_round()
                    except BaseException:  # noqa: BLE001 — an engine says its own failures
                        traceback.print_exc()
                        more = False
                    if not more:
                        with self.cond:
                            self._workers.remove(work)
                            self._turn = 0
            finally:
                del work


def shared() -> MlxThread:
    """The process's MLX thread (started on first use)."""
    return _started("mlxlis-mlx")


def loading() -> MlxThread:
    """The thread models are read on while the MLX thread goes on generating (a server's
    models loaded on demand); MLX evaluates on several threads, each on its own stream, since
    0.31.2."""
    return _started("mlxlis-load")


def _started(name: str) -> MlxThread:
    """The process's thread of that name, started on first use."""
    with _lock:
        if name not in _threads:
            _threads[name] = MlxThread(name)
        return _threads[name]
