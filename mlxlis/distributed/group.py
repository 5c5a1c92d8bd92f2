"""The ranks a launcher started (`mlx.launch`, MLX's distributed layer), and what happens
when one of them is lost.

MLX's ring backend fails a pending send/recv/all_sum with a RuntimeError ("[ring] connection to
a peer was lost") as soon as a peer's sockets close, which is what a rank that dies or exits
does; `mlx.launch` then also ends the remaining ranks with SIGTERM. A peer that stops without
closing its sockets (a frozen process, a link gone quiet) fails nothing: a watchdog ends this
rank when a pipeline wait lasts longer than `timeout` seconds (MLXLIS_RANK_TIMEOUT, default
30). Waits outside generation (loading, a chat waiting for its next prompt) are not timed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from mlxlis.errors import RankLostError
from mlxlis.settings import settings

import mlx.core as mx

# set by the launchers: mlx.launch (ring, jaccl, nccl) sets MLX_RANK; mpirun its own
LAUNCH_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
BACKEND_PREFIXES = ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "[distributed]")


def launched() -> bool:
    """This process was started by a distributed launcher."""
    return any(os.environ.get(k) for k in LAUNCH_ENV)


class Ranks:
    """This process's place among the launched ranks (an MLX distributed group of ≥ 2)."""

    def __init__(self, group: mx.distributed.Group, timeout: float):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.timeout = timeout
        self._since: float | None = None  # when the current pipeline wait began
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self.lost = False  # a peer was lost: collectives can only hang or fail from here

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, size={self.size})"

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values` (the same count of int32s on each), in rank order: one
        all_sum of a (size, k) array that is zero outside this rank's row."""
        k = len(values)
        rows = mx.zeros((self.size, k), dtype=mx.int32)
        rows[self.rank] = mx.array(list(values), dtype=mx.int32)
        with self.translate():
            total = mx.distributed.all_sum(rows, group=self.group)
            mx.eval(total)
        return total.tolist()

    def barrier(self) -> None:
        self.gather([1])

    def broadcast(self, payload: bytes) -> bytes:
        """Rank 0's `payload` on every rank (the others' are ignored): its length in a gather,
        then its bytes in an all_sum to which the others add zeros."""
        import numpy as np

        mine = payload if self.rank == 0 else b""
        n = self.gather([len(mine)])[0][0]
        if n == 0:
            return b""
        if self.rank == 0:
            part = mx.array(np.frombuffer(mine, dtype=np.uint8).astype(np.int32))
        else:
            part = mx.zeros((n,), dtype=mx.int32)
        with self.translate():
            total = mx.distributed.all_sum(part, group=self.group)
            mx.eval(total)
        return np.array(total).astype(np.uint8).tobytes()

    @contextlib.contextmanager
    def translate(self) -> Iterator[None]:
        """The backend's lost-peer RuntimeError as a RankLostError (other errors pass)."""
        try:
            yield
        except RuntimeError as e:
            if str(e).startswith(BACKEND_PREFIXES):
                self.lost = True
                raise RankLostError(
                    f"rank {self.rank} of {self.size} lost the connection to another rank "
                    f"(it ended or its link went down): {e}"
                ) from None
            raise

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A pipeline wait: the watchdog ends the process if it lasts over `timeout` s."""
        with self._lock:
            self._since = time.monotonic()
        try:
            with self.translate():
                yield
        finally:
            with self._lock:
                self._since = None

    def start_watchdog(self) -> None:
        if self._watchdog is None and self.timeout > 0:
            self._watchdog = threading.Thread(
                target=self._watch, name="mlxlis-rank-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.25, self.timeout / 4))
            with self._lock:
                since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                _die(
                    f"mlxlis: error: rank {self.rank} of {self.size}: no answer from the other "
                    f"ranks for {self.timeout:g} s (a rank stopped or its link went down; "
                    "MLXLIS_RANK_TIMEOUT sets the limit); ending the job"
                )

    def on_launcher_stop(self) -> None:
        """mlx.launch ends the remaining ranks with SIGTERM when one of them exits with an
        error: say so (rank 0) instead of vanishing. Main thread only (Python's rule)."""
        if threading.current_thread() is not threading.main_thread():
            return
        rank, size = self.rank, self.size

        def stopped(signum, frame) -> None:
            if rank == 0:
                _die(
                    f"mlxlis: error: rank 0 of {size}: stopped by the launcher because another "
                    "rank ended (its message, if any, is above)",
                    143,
                )
            os._exit(143)

        signal.signal(signal.SIGTERM, stopped)


def _die(message: str, code: int = 1) -> None:
    """Print one line and end the process now, from any thread (os._exit: a thread blocked in
    MLX waiting for a lost peer would keep a normal exit waiting)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


_ranks: Ranks | None = None
_checked = False


def world() -> Ranks | None:
    """The launched ranks when this process runs under a launcher with two or more, else
    None (a lone process, or `mlx.launch -n 1`). Initialised once per process."""
    global _ranks, _checked
    if _checked:
        return _ranks
    _checked = True
    if not launched():
        return None
    group = mx.distributed.init()
    if group.size() < 2:
        return None
    _ranks = Ranks(group, rank_timeout())
    share_cores(ranks_on_this_host(_ranks.rank))
    _ranks.on_launcher_stop()
    _ranks.start_watchdog()
    return _ranks


def rank_timeout() -> float:
    return settings().rank_timeout


def ranks_on_this_host(rank: int) -> int:
    """How many ranks share this rank's address in mlx.launch's ring hostfile (1 when it
    cannot tell): ranks on one machine share its cores."""
    import json

    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            nodes = json.load(f)
        hosts = [node[0].rsplit(":", 1)[0] for node in nodes]
        return max(1, hosts.count(hosts[rank]))
    except (KeyError, OSError, ValueError, TypeError, IndexError, AttributeError):
        return 1


def share_cores(ranks_here: int) -> None:
    """Give each of the `ranks_here` ranks on this machine its share of the cores for
    OpenBLAS (unless OPENBLAS_NUM_THREADS says otherwise). Its idle threads spin: on one
    2-core machine two ranks with two BLAS threads each decoded SmolLM2 at 0.8 tok/s, with
    one each at 7.8 tok/s. (The thread count changes float32 sums in the last bits: a run is
    bit-identical to a lone process using as many BLAS threads as each rank.)"""
    if ranks_here >= 2 and not os.environ.get("OPENBLAS_NUM_THREADS"):
        set_blas_threads(max(1, (os.cpu_count() or 1) // ranks_here))


def set_blas_threads(threads: int) -> int | None:
    """Set the thread count of the OpenBLAS that MLX calls (blas.py), and of the dispatch's
    batch kernel; returns the previous OpenBLAS count, or None when MLX runs another BLAS."""
    import ctypes
    import ctypes.util

    from mlxlis.runtime.blas import _wheel_library, state

    if state.dispatch is not None and hasattr(state.dispatch, "mlxlis_skinny_set_threads"):
        state.dispatch.mlxlis_skinny_set_threads(int(threads))

    if state.name.startswith("OpenBLAS"):  # the scipy-openblas32 wheel
        lib, prefix = _wheel_library(), "scipy_openblas"
    elif state.name.startswith("system OpenBLAS"):
        lib, prefix = ctypes.util.find_library("openblas"), "openblas"
    else:
        return None
    try:
        blas = ctypes.CDLL(str(lib))  # the library already loaded: the same handle
        previous = int(getattr(blas, f"{prefix}_get_num_threads")())
        getattr(blas, f"{prefix}_set_num_threads")(int(threads))
    except (OSError, AttributeError, TypeError):
        return None
    return previous
