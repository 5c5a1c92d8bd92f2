"""Download progress: bytes, speed and ETA per file, as `progress(stage, done, total)` calls.

The hub's transfers report through a tqdm class (`tqdm_class=`); `bar_class(report)` is one that
draws nothing and turns each refresh into a `report(line, done_bytes, total_bytes)` call. The
line reads "downloading FILE: 12.3 MB of 45.6 MB, 5.1 MB/s, ETA 7s" while it runs and
"downloaded FILE: 45.6 MB in 8.9 s (5.1 MB/s)" once done. The CLI shows them on stderr
(`StderrProgress`); the chat app shows them in its header.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

Progress = Callable[[str, int, int], None]  # (stage, done, total), as catalog.pull reports
DONE = "downloaded "
BIG = 10**6  # in a log, files from this size get a line when they start too


def human(n: float) -> str:
    """Bytes in decimal units, as the Hub and tqdm show them: '45.6 MB'."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # unreachable: the loop returns at GB


def duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(name: str, done: int, total: int | None, rate: float | None) -> str:
    """The line shown while `name` downloads (total None or 0: size unknown)."""
    size = f"{human(done)} of {human(total)}" if total else human(done)
    speed = f", {human(rate)}/s" if rate else ""
    eta = f", ETA {duration((total - done) / rate)}" if rate and total and total > done else ""
    return f"downloading {name}: {size}{speed}{eta}"


def done_line(name: str, size: int, seconds: float) -> str:
    speed = f" ({human(size / seconds)}/s)" if seconds > 0 and size else ""
    return f"{DONE}{name}: {human(size)} in {seconds:.1f} s{speed}"


def bar_class(report: Progress) -> type[tqdm]:
    """A tqdm class for the hub's `tqdm_class=` that reports instead of drawing."""

    class ReportingBar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # the hub's own bars take a group name; vanilla tqdm not
            kwargs["file"] = io.StringIO()  # draws nothing: display() reports instead
            kwargs["disable"] = False
            kwargs.setdefault("mininterval", 0.25)
            self._reported_done = False
            super().__init__(*args, **kwargs)

        # Network bytes of a Xet transfer: with these two the hub folds its second
        # ("Downloading bytes") bar into this one, so each file has one line.
        def update_transfer(self, n: int) -> None:
            pass

        def set_transfer_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            pass

        def display(self, msg=None, pos=None) -> bool:
            d = self.format_dict
            name = str(self.desc or "file").rsplit("/", 1)[-1]  # the hub may pass a URL
            total = int(d["total"]) if d["total"] else 0
            if total and d["n"] >= total:
                if not self._reported_done:
                    self._reported_done = True
                    fresh = d["n"] - (self.initial or 0)
                    report(
                        done_line(name, int(d["n"]), time.time() - self.start_t if fresh else 0.0),
                        total,
                        total,
                    )
                return True
            report(progress_line(name, int(d["n"]), total, d["rate"]), int(d["n"]), total)
            return True

    return ReportingBar


class StderrProgress:
    """Shows progress lines on a stream: rewritten in place on a terminal; in a log, a line
    when a file starts and one when it is done."""

    def __init__(self, stream: TextIO | None = None, prefix: str = "mlxlis: "):
        self.stream = stream or sys.stderr
        self.prefix = prefix
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._started: set[str] = set()
        self._width = 0

    def __call__(self, stage: str, done: int, total: int) -> None:
        text = self.prefix + stage
        if self.tty:
            pad = max(0, self._width - len(text))
            end = "\n" if stage.startswith(DONE) else ""
            self.stream.write("\r" + text + " " * pad + end)
            self._width = 0 if end else len(text)
        else:
            name = stage.split(":", 1)[0].split(" ", 1)[-1]
            if stage.startswith(DONE):
                self.stream.write(text + "\n")
            elif name not in self._started and total >= BIG:
                self._started.add(name)
                size = f" ({human(total)})" if total else ""
                self.stream.write(f"{self.prefix}downloading {name}{size}\n")
        self.stream.flush()


def default_progress() -> Progress | None:
    """Progress on stderr, as the hub's own bars, unless HF_HUB_DISABLE_PROGRESS_BARS is set."""
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() in ("1", "true", "yes", "on"):
        return None
    return StderrProgress()
