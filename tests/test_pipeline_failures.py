"""What a pipelined run does when something is wrong: a rank killed or frozen mid-generation,
a bad --layers-split, a model that does not fit even when split (ring backend, loopback).

Proves: killing one of 3 ranks mid-generation ends every rank within 10 s with one clear
line from rank 0; a rank that freezes (SIGSTOP, its sockets open) is noticed by the others'
watchdog after MLXLIS_RANK_TIMEOUT seconds; every malformed or mismatched --layers-split is
refused with exit 2 and one line naming the flag, before any weight is read; a share larger
than its rank's memory is refused on every rank before loading, rank 0 naming each rank.
"""

from __future__ import annotations

import os
import select
import signal
import time

from mlxlis.commands.cli import main

import pytest
from conftest import need_pulled
from launch import MLXLIS, alive, freeze, kill_all, ranks, start, stdout_begins
from launch import run as launch

pytestmark = pytest.mark.real
ARGS = ["-m", "smollm2-135m", "--no-chat", "--temp", "0"]


def _stderr_until(p, text: str, timeout: float = 10) -> str:
    """What the launcher relayed on stderr, read until `text` appears or `timeout` passes (the
    launcher relays a rank's lines from a thread of its own, a little after that rank ends)."""
    err = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in err and time.monotonic() < deadline:
        ready, _, _ = select.select([p.stderr], [], [], 0.1)
        if ready:
            data = os.read(p.stderr.fileno(), 65536)
            if not data:
                break
            err += data
    return err.decode(errors="replace")


def test_killed_rank_ends_every_rank_with_a_clear_error():
    """SIGKILL on the middle one of 3 ranks while the reply streams: the launcher and both
    other ranks are gone within 10 s, and rank 0 said why on stderr."""
    need_pulled("smollm2-135m")
    p = start(3, MLXLIS, *ARGS, "--max-tokens", "3000", "Once upon a time")
    try:
        pids = ranks(p, 3)
        stdout_begins(p)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        p.wait(timeout=10)
        took = time.monotonic() - killed
        while any(alive(pid) for pid in pids.values()) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert not [r for r, pid in pids.items() if alive(pid)], "ranks still running"
        err = p.stderr.read().decode()
    finally:
        kill_all(p)
    assert took < 10
    lines = [ln for ln in err.splitlines() if ln.startswith("mlxlis: error: rank 0 of 3")]
    assert lines, err[-2000:]
    assert any(
        why in lines[0]
        for why in ("lost the connection to another rank", "stopped by the launcher")
    )


@pytest.mark.extended  # `make test-all` (6 s): a killed rank is noticed in make test
def test_frozen_rank_is_noticed_by_the_watchdog():
    """SIGSTOP on rank 1 of 2 (its sockets stay open, so nothing fails): rank 0's wait for the
    next token outlives MLXLIS_RANK_TIMEOUT=2 and its watchdog ends it with a clear line."""
    need_pulled("smollm2-135m")
    p = start(
        2,
        MLXLIS,
        *ARGS,
        "--max-tokens",
        "3000",
        "Once upon a time",
        env={"MLXLIS_RANK_TIMEOUT": "2"},
    )
    try:
        pids = ranks(p, 2)
        stdout_begins(p)
        took = freeze(pids)
        assert not alive(pids[0])
        err = _stderr_until(p, WHY)
    finally:
        kill_all(p)  # the stopped rank ignores the launcher's SIGTERM until it is killed
    assert 1.5 < took < 6
    assert WHY in err, err


WHY = "mlxlis: error: rank 0 of 2: no answer from the other ranks for 2 s"


@pytest.mark.parametrize("split", ["14,x", "0,30", "1.5,28", "15,,15", "-1,31"])
def test_malformed_layers_split_is_refused_before_loading(split, capsys):
    """A split that is not positive whole numbers: exit 2 at argument parsing, one line."""
    with pytest.raises(SystemExit) as e:
        main([*ARGS, "--layers-split", split, "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--layers-split" in err[-1] and "error" in err[-1]


@pytest.mark.parametrize(
    ("split", "says"),
    [
        ("29", "29 adds up to 29 layers; the model has 30"),
        ("15,15", "15,15 has 2 entries but this process runs alone"),
    ],
)
def test_layers_split_that_does_not_fit_the_model_is_refused(split, says, capsys):
    """A well-formed split the model or the number of ranks contradicts: exit 2, one line."""
    need_pulled("smollm2-135m")
    assert main([*ARGS, "--layers-split", split, "hi"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and says in out.err, out.err


def test_model_that_does_not_fit_even_split_says_so_before_loading():
    """MLXLIS_MAX_MEMORY=40M per rank and SmolLM2's 120 MiB of weights over 2 ranks: refused
    after reading the header only, rank 0's line naming both ranks' needs."""
    need_pulled("smollm2-135m")
    code, out, err = launch(2, MLXLIS, *ARGS, "hi", env={"MLXLIS_MAX_MEMORY": "40M"}, timeout=60)
    assert out == ""
    lines = [ln for ln in err.splitlines() if "does not fit even split across 2 ranks" in ln]
    # rank 0's line is the one the user reads; the launcher may end rank 1 before it prints
    assert lines, err
    assert "rank 0 needs" in lines[0] and "rank 1 needs" in lines[0] and "0.04 GiB" in lines[0]
