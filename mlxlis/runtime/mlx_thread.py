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
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_lock = threading.Lock()
_shared: MlxThread | None = None


class MlxThread:
    """A single daemon thread running submitted callables in order."""

    def __init__(self, name: str = "mlxlis-mlx") -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the thread after the jobs before it; its result or exception lands in
        the returned Future."""
        fut: Future = Future()
        with self._idle:
            self._pending += 1
        self._jobs.put((fn, fut))
        return fut

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running; False if `timeout` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 — handed to the caller
                        fut.set_exception(e)
            finally:
                del fn, fut  # drop references before waiting again
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


def shared() -> MlxThread:
    """The process's MLX thread (started on first use)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = MlxThread()
        return _shared
