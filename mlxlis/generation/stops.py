"""Stop strings: text out, each stop string cut across token boundaries and never emitted."""

from __future__ import annotations


class StopMatcher:
    """Holds back any tail that may begin a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.matched: str | None = None  # the stop string that ended the text (the earliest)

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, a stop string was reached)."""
        buf = self.held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            self.held = ""
            return buf[:at], True
        keep = max(
            (
                n
                for s in self.stops
                for n in range(1, min(len(s), len(buf) + 1))
                if buf.endswith(s[:n])
            ),
            default=0,
        )
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
