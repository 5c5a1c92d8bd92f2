"""Tool calls streamed as they are written (tools.py, tool_formats/partial.py), in every format
of the table: a call begins in the stream once its name is whole, its arguments go out one
whole argument at a time, and together they are exactly the call read whole (tool_pieces.py
says what a stream must be). The vendors' templates' own text is streamed the same way in
test_tool_corpus.py; the official clients see it in test_tool_serve.py.

Self-consistency of the parser (its stream against its own whole reading): the reference for
the arguments themselves is the corpus test, where they come from the vendors' templates."""

from __future__ import annotations

import json
import logging

from mlxlis.prompt.tool_calls import ToolCallParser
from mlxlis.prompt.tool_formats import TABLE
from mlxlis.prompt.tool_formats.partial import streams

import pytest
from tool_pieces import check_pieces, joined

TAGGED = [f for f in TABLE if f.open]
SCHEMA = {
    "type": "object",
    "properties": {
        "alpha": {"type": "integer"},
        "beta": {"type": "string"},
        "gamma": {"type": "array", "items": {"type": "number"}},
    },
}
CALLS = [
    ("fetch_one", {"alpha": 25, "beta": 'x "y"\nz', "gamma": [1.5, 2e3]}),
    ("fetch_two", {"alpha": -3, "beta": "ü", "gamma": []}),
]


def fed(parser: ToolCallParser, text: str, piece: int = 1):
    """(the calls read whole, the pieces, and for each piece how much of `text` was fed
    when it came)."""
    calls, pieces, at = [], [], []
    for i in range(0, len(text), piece):
        calls += parser.feed(text[i : i + piece])[1]
        got = parser.take_pieces()
        pieces, at = pieces + got, at + [i + piece] * len(got)
    calls += parser.flush()[1]
    got = parser.take_pieces()
    return calls, pieces + got, at + [len(text)] * len(got)


@pytest.mark.parametrize("fmt", TAGGED, ids=[f.name for f in TAGGED])
def test_arguments_stream_one_whole_argument_at_a_time(fmt):
    """Two calls, three arguments each, a character at a time: each call's first argument
    goes out before its last one is written, in three or more pieces of whole arguments, in
    every format with tags of its own (Gemma 4's syntax and LFM2's Python call too); the
    pieces are the calls read whole."""
    text = fmt.write(CALLS)
    schemas = {"fetch_one": SCHEMA, "fetch_two": SCHEMA}
    calls, pieces, at = fed(ToolCallParser(frozenset(schemas), fmt, schemas), text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (n, a) for n, a in CALLS
    ]
    check_pieces(pieces, calls)
    args = joined(pieces)
    assert streams(fmt)
    for i, (name, _) in enumerate(CALLS):
        first = next(
            k for k, p in enumerate(pieces) if p["index"] == i and p["function"]["arguments"]
        )
        gamma = text.index("gamma", text.index(name))
        assert at[first] <= gamma, (fmt.name, i, pieces)
        assert len([a for a in args[i] if a]) >= 3, (fmt.name, pieces)


@pytest.mark.parametrize("fmt", [f for f in TAGGED if streams(f) and f.close], ids=lambda f: f.name)
def test_a_call_broken_midway_leaves_whole_arguments_and_its_text(fmt, caplog):
    """A call the model breaks after its first argument (a string left open, then the
    closing tag): the stream has the call's first argument whole and nothing of the cut
    one; the text comes back as the model wrote it, and a warning says so."""
    whole = fmt.write([("f", {"alpha": 1, "beta": "abc"})])
    at = whole.index("abc") + 2
    broken = whole[:at] + fmt.close
    with caplog.at_level(logging.WARNING, logger="mlxlis.serve"):
        parser = ToolCallParser(frozenset({"f"}), fmt, {"f": SCHEMA})
        shown, calls, pieces = "", [], []
        for ch in broken:
            text, new = parser.feed(ch)
            shown, calls, pieces = shown + text, calls + new, pieces + parser.take_pieces()
        text, new = parser.flush()
    assert calls == [] and new == [] and (shown + text).strip() == broken.strip()
    sent = "".join(p["function"]["arguments"] for p in pieces)
    assert sent == '{"alpha": 1', (fmt.name, pieces)
    assert any("begun in the stream" in r.getMessage() for r in caplog.records)


def test_a_tool_not_offered_goes_out_whole():
    """A call of a tool the request did not offer is not streamed: it goes out in one piece
    once read whole (as calls of unknown tools always did)."""
    fmt = next(f for f in TAGGED if f.name == "hermes")
    calls, pieces, at = fed(ToolCallParser(frozenset({"f"}), fmt), fmt.write(CALLS[1:]))
    check_pieces(pieces, calls)
    assert len(pieces) == 1 and at == [len(fmt.write(CALLS[1:]))]


def test_a_number_is_sent_when_it_has_ended():
    """ "2" may still become "2.5", "25" or "2e3": an argument is sent once the object's next
    comma or brace follows it."""
    fmt = next(f for f in TAGGED if f.name == "hermes")
    parser = ToolCallParser(frozenset({"f"}), fmt)
    for part in ('<tool_call>\n{"name": "f", "arguments": {"a": 2', ".5", "e1 ", ", "):
        parser.feed(part)
        sent = "".join(p["function"]["arguments"] for p in parser.pieces)
        assert sent in ("", '{"a": 25.0'), sent
    assert "".join(p["function"]["arguments"] for p in parser.take_pieces()) == '{"a": 25.0'
