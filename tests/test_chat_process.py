"""`mlxlis chat` as a real process on a pseudo-terminal, driven by keystrokes.

Proves the app quits cleanly (exit status 0, nothing on stderr) after a finished reply, during
a reply, after a stopped reply and after several turns. What can go wrong there: a thread that
used MLX exiting while the interpreter shuts down aborts the process (status 134, "terminate
called without an active exception"), since MLX's per-thread compile cache needs the GIL to go;
and a quit that has to give up waiting for the model says so on stderr.
Nothing here checks the text of the reply (the parity tests do).
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from mlxlis.loading import catalog

import pytest

SMOLLM2 = pytest.mark.skipif(not catalog.is_pulled("smollm2-135m"), reason="not pulled")
ANSI = re.compile(rb"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")
LEAVE_ALT_SCREEN = b"\x1b[?1049l"
CTRL_Q, CTRL_C, ENTER = b"\x11", b"\x03", b"\r"  # not Esc: a lone ESC byte is ambiguous


class Chat:
    """`mlxlis chat` on a pty. Textual draws on stderr, so "nothing on stderr" means nothing
    is printed after the app leaves the terminal's alternate screen."""

    def __init__(self, tmp_path: Path, *args: str, model: str = "smollm2-135m"):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "MLXLIS_DATA": str(tmp_path / "data")}
        exe = Path(sys.executable).with_name("mlxlis")
        self.proc = subprocess.Popen(
            [str(exe), "chat", "-m", model, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=tmp_path,
            close_fds=True,
            start_new_session=True,
        )
        os.close(slave)
        self.fd = master
        self.screen = b""

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if ready:
                try:
                    self.screen += os.read(self.fd, 1 << 16)
                except OSError:
                    return

    def text(self) -> str:
        return ANSI.sub(b"", self.screen).decode("utf-8", "replace")

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while len(re.findall(pattern, self.text())) < count:
            assert self.proc.poll() is None, f"exited early: {self.finish()}"
            assert time.monotonic() < end, f"no {pattern!r} x{count} within {timeout} s"
            self.pump(0.2)

    def send(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self.pump(0.2)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.pump(0.5)
        after = self.screen.rpartition(LEAVE_ALT_SCREEN)[2]
        return self.proc.wait(), ANSI.sub(b"", after).decode("utf-8", "replace").strip()


@pytest.fixture
def launch(tmp_path):
    """Start `mlxlis chat` with arguments; every process is killed at teardown, pass or fail."""
    started: list[Chat] = []

    def start(*args: str, model: str = "smollm2-135m") -> Chat:
        started.append(Chat(tmp_path, *args, model=model))
        return started[-1]

    yield start
    for chat in started:
        if chat.proc.poll() is None:
            os.killpg(chat.proc.pid, signal.SIGKILL)
            chat.proc.wait()
        os.close(chat.fd)


def replies_done(n: int, chat: Chat, timeout: float = 180) -> None:
    """The status line shows a peak-memory figure once a reply is finished; each finished reply
    has its own context figure, so distinct status lines count replies (repaints do not)."""
    end = time.monotonic() + timeout
    while len(set(re.findall(r"ctx \d+/\d+ │ peak \d+ MiB", chat.text()))) < n:
        assert chat.proc.poll() is None, f"exited early: {chat.finish()}"
        assert time.monotonic() < end, f"{n} replies not finished within {timeout} s"
        chat.pump(0.2)


def loaded(chat: Chat, template: str = r"gguf:tokenizer\.chat_template") -> None:
    chat.wait_for(f"template: {template}", timeout=120)
    chat.pump(0.5)


def test_tiny_model_send_stop_quit(launch, tiny):
    """The same on a tiny random checkpoint (loads in milliseconds; runs without the catalog
    models): a reply stopped mid-way, a finished one, then quit: status 0, nothing printed."""
    folder, _ = tiny("llama_long")  # a context of 131 072: the first reply runs until stopped
    chat = launch(
        "--chat-template",
        "chatml",
        "--max-tokens",
        "100000",
        "--temp",
        "1",
        "--seed",
        "3",
        model=str(folder),
    )
    loaded(chat, "builtin:chatml")
    chat.send(b"Hello" + ENTER)
    chat.wait_for(r"generating…")
    chat.pump(0.5)
    chat.send(CTRL_C)
    chat.wait_for(r"■ stopped")
    chat.send(b"/params max_tokens=5" + ENTER)
    chat.pump(0.5)
    chat.send(b"Again" + ENTER)
    replies_done(2, chat)
    chat.pump(0.5)
    chat.send(CTRL_Q)
    assert chat.finish() == (0, "")


@pytest.mark.real
@pytest.mark.extended  # the tiny model's test quits after a finished reply in `make test`
@SMOLLM2
def test_quit_after_a_finished_reply_exits_0(launch):
    chat = launch("--max-tokens", "12")
    loaded(chat)
    chat.send(b"Hi there" + ENTER)
    replies_done(1, chat)
    chat.pump(1.0)  # the worker that generated the reply has gone idle
    chat.send(CTRL_Q)
    assert chat.finish() == (0, "")


@pytest.mark.real
@pytest.mark.extended  # `make test-all` (8 s): quitting is proved in make test (send, stop, quit)
@SMOLLM2
def test_quit_during_a_reply_exits_0(launch):
    chat = launch("--max-tokens", "2000", "--temp", "0")  # greedy counting: still going at quit
    loaded(chat)
    chat.send(b"List the numbers from 1 to 1000, separated by commas." + ENTER)
    chat.wait_for(r"generating…")
    chat.pump(1.0)
    chat.send(CTRL_Q)
    code, err = chat.finish()
    # a token that takes over 0.5 s on a busy machine makes quit say that it waits for it
    assert code == 0 and err in ("", "mlxlis chat: waiting for the model to stop…"), err


@pytest.mark.real
@pytest.mark.extended  # so does the tiny model's, after a stopped reply and several turns
@SMOLLM2
def test_quit_after_a_stopped_reply_and_several_turns_exits_0(launch):
    # greedy counting runs to max_tokens: the reply is still going when Ctrl+C comes (a sampled
    # story can end at its first sentence, before the keystroke; the kernels are warm by then)
    chat = launch("--max-tokens", "2000", "--temp", "0")
    loaded(chat)
    chat.send(b"List the numbers from 1 to 1000, separated by commas." + ENTER)
    chat.wait_for(r"generating…")
    chat.pump(1.0)
    chat.send(CTRL_C)  # stop the reply (the app binds Ctrl+C and Esc to it)
    chat.wait_for(r"■ stopped")
    chat.send(b"/params max_tokens=10" + ENTER)
    chat.pump(1.0)
    for i, text in enumerate((b"Hi", b"And again?")):
        chat.send(text + ENTER)
        replies_done(i + 2, chat)
    chat.pump(0.5)
    chat.send(CTRL_Q)
    assert chat.finish() == (0, "")
