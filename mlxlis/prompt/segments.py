"""The segments a reply's stream is split into (reasoning or answer), shared by the splitters
(reasoning.py's tags, harmony.py's channels)."""

from __future__ import annotations

REASONING, ANSWER = "reasoning", "answer"

Segment = tuple[str, str]  # (REASONING | ANSWER, text)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def join(segments: list[Segment], kind: str) -> str:
    """The text of the segments of one kind (REASONING or ANSWER), in order."""
    return "".join(text for k, text in segments if k == kind)
