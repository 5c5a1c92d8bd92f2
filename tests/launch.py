"""Start a command under `mlx.launch` (ring backend over loopback) for the pipeline tests, with
ports of its own and a hang guard that kills every process it started."""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

LAUNCH = str(Path(sys.executable).with_name("mlx.launch"))
MLXLIS = str(Path(sys.executable).with_name("mlxlis"))


def free_port_base(n: int) -> int:
    """A port p with p .. p+n-1 free on loopback (the ring listens on consecutive ports)."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def command(n: int, *args: str) -> list[str]:
    return [
        LAUNCH,
        "--backend",
        "ring",
        "-n",
        str(n),
        "--starting-port",
        str(free_port_base(n)),
        *args,
    ]


def start(n: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    """The launcher in a session of its own (so a hang guard can end all of it)."""
    return subprocess.Popen(
        command(n, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def run(n: int, *args: str, env: dict | None = None, timeout: float = 120) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a launch; a launch that outlives `timeout` fails."""
    p = start(n, *args, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(p)
        out, err = p.communicate()
        raise AssertionError(f"launch hung past {timeout} s:\n{err.decode()[-3000:]}") from None
    return p.returncode, out.decode(), err.decode()


def ranks(p: subprocess.Popen, n: int, timeout: float = 60) -> dict[int, int]:
    """rank -> pid of the processes the launcher started (each execs the command)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for pid in children(p.pid):
            rank = _env(pid).get("MLX_RANK")
            if rank is not None:
                found[int(rank)] = pid
        if len(found) == n:
            return found
        time.sleep(0.1)
    raise AssertionError(f"the launcher did not start {n} ranks")


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_all(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


def _env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def stdout_begins(p: subprocess.Popen, timeout: float = 90) -> bytes:
    """The first bytes rank 0 prints (the reply has begun), or a failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 0.5)
        if ready:
            data = os.read(p.stdout.fileno(), 4096)
            if data.strip():
                return data
        if p.poll() is not None:
            break
    kill_all(p)
    raise AssertionError(f"no output: {p.stderr.read().decode()[-2000:]}")


def freeze(pids: dict[int, int]) -> float:
    """SIGSTOP on rank 1 (its sockets stay open, so no collective fails); the seconds until
    rank 0 ended (its watchdog), at most 10."""
    os.kill(pids[1], signal.SIGSTOP)
    frozen = time.monotonic()
    while alive(pids[0]) and time.monotonic() - frozen < 10:
        time.sleep(0.05)
    return time.monotonic() - frozen
