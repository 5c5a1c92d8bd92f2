"""What a streamed tool call must be, checked on the pieces a parser gave (OpenAI's chunk
shape: `prompt.tool_calls.ToolCallParser.take_pieces`) against the calls it read whole."""

from __future__ import annotations

import json
from typing import Any


def joined(pieces: list[dict[str, Any]]) -> dict[int, list[str]]:
    """index -> the argument texts of that call's pieces, in order."""
    out: dict[int, list[str]] = {}
    for p in pieces:
        out.setdefault(p["index"], []).append(p["function"]["arguments"])
    return out


def whole_prefix(text: str, final: dict[str, Any]) -> bool:
    """Whether `text`, arguments streamed so far, holds whole values only: closed, it reads
    as the first members of `final`, in order (a cut string or number would not)."""
    if not text:
        return True
    closed = text if text.endswith("}") and _loads(text) is not None else text + "}"
    got = _loads(closed)
    return isinstance(got, dict) and list(got.items()) == list(final.items())[: len(got)]


def check_pieces(pieces: list[dict[str, Any]], calls: list[dict[str, Any]]) -> None:
    """The stream of `calls`: each call's pieces together (all before the next call's),
    the first with its id and name, their arguments joined its `arguments` exactly, and at
    every piece's end whole values only."""
    indices = [p["index"] for p in pieces]
    assert indices == sorted(indices), indices
    assert sorted(set(indices)) == list(range(len(calls))), (indices, len(calls))
    for i, call in enumerate(calls):
        mine = [p for p in pieces if p["index"] == i]
        assert mine[0]["id"] == call["id"] and mine[0]["type"] == "function"
        assert mine[0]["function"]["name"] == call["function"]["name"]
        assert all("id" not in p and "name" not in p["function"] for p in mine[1:])
        final, sent = call["function"]["arguments"], ""
        for p in mine:
            sent += p["function"]["arguments"]
            assert whole_prefix(sent, json.loads(final)), (sent, final)
        assert sent == final, (sent, final)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
