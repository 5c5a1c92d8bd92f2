"""A block of calls read while it streams, so that each call's name and arguments can go out
before the block ends (prompt/tool_calls.py streams them; base.py reads the whole block when
it closes).

`read_open` gives the calls begun so far: each one's name, once it is whole, and its arguments
that are whole so far, argument by argument, in the order written — a JSON argument once its
value ends (a number once something follows it: "3" may become "35"), a tagged row once its
closing tag came. A value is never sent in part, so a call the model breaks midway leaves
whole arguments behind, never a cut one. `done` says the call's arguments have all come.

Formats with a reader of their own (bare JSON, whose reply may not be a call at all) are
read whole only: `read_open` gives nothing for them. Gemma 4's arguments and LFM2's Python
call stream argument by argument as JSON ones do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from json.decoder import scanstring
from typing import Any

from mlxlis.prompt.tool_formats.args import g4_members, python_members, skip_ws
from mlxlis.prompt.tool_formats.base import _PATTERNS, ToolFormat

_DECODER = json.JSONDecoder()
_NAME = re.compile(_PATTERNS["name"])
Member = tuple[str, Any]
_ARGS = ("arguments", "parameters")  # the keys a model may use for them (base.py reads both)


@dataclass
class OpenCall:
    name: str
    members: list[Member]  # the arguments whole so far, in the order written
    done: bool = False  # every argument came (the object closed, the call's closing tag)

    def text(self) -> str:
        """The arguments so far as JSON text, as json.dumps writes the whole object (so the
        text sent grows into the call's final arguments): "{" and the members, "}" when done."""
        body = ", ".join(
            f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
            for k, v in self.members
        )
        if not self.members:
            return "{}" if self.done else ""
        return "{" + body + ("}" if self.done else "")


def streams(fmt: ToolFormat) -> bool:
    """Whether a format's calls can be read while they stream."""
    return fmt.reader is None and (fmt.args in MEMBERS or fmt.args == "xml") and bool(fmt.open)


def read_open(fmt: ToolFormat, body: str, schemas: Mapping[str, Any]) -> list[OpenCall]:
    """The calls begun in `body` (a block's text after its open tag, the block still open),
    each but the last done. Reading stops at the first call not yet readable."""
    if not streams(fmt):
        return []
    text = fmt.open + body
    p = fmt.parts
    m = p["block_head"].match(text)
    if m is None:
        return []
    pos, out = m.end(), []
    while not (out and fmt.single):
        at = pos
        if out:
            sep = p["sep"].match(text, pos)
            if sep is None:
                break
            at = sep.end()
        call = _open_call(fmt, text, at, schemas)
        if call is None:
            break
        got, end = call
        out.append(got)
        if end is None:
            break
        pos = end
    return out


def _open_call(
    fmt: ToolFormat, text: str, pos: int, schemas: Mapping[str, Any]
) -> tuple[OpenCall, int | None] | None:
    """(the call at `pos`, where it ends or None while it is open), or None before its name
    is whole."""
    keys = fmt.object_keys
    if keys is not None:
        return _open_object(text, pos, keys)
    p = fmt.parts
    m = p["call_head"].match(text, pos)
    if m is None or m.end() >= len(text):  # the name may go on ("get_wea" | "ther")
        return None
    call = OpenCall(m.group("name"), [])
    if fmt.args != "xml":
        end = MEMBERS[fmt.args](text, m.end(), call.members)
        call.done = end is not None  # the arguments closed: they are all there
    else:
        end = fmt.read_rows(text, m.end(), schemas.get(call.name), call.members)
        if not fmt.call.split("{args}")[1].strip():  # no tag of its own closes the call
            return call, None
    if end is None:
        return call, None
    tail = p["call_tail"].match(text, end)
    if tail is None:
        return call, None
    call.done = True
    return call, tail.end()


def _members(text: str, pos: int, out: list[Member]) -> int | None:
    """The whole members of the JSON object at `pos` into `out`; where the object ends, or
    None while it is open (or not an object: then it is read whole, when the call ends)."""
    i = skip_ws(text, pos)
    if not text.startswith("{", i):
        return None
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return None
        if text[i] == "}":
            return i + 1
        if out:
            if text[i] != ",":
                return None
            i = skip_ws(text, i + 1)
        got = _member(text, i)
        if got is None:
            return None
        key, value, i = got
        out.append((key, value))


def _member(text: str, i: int) -> tuple[str, Any, int] | None:
    """`"key": value` at `i`, whole (the value followed by something), or None."""
    if not text.startswith('"', i):
        return None
    try:
        key, i = scanstring(text, i + 1)
        i = skip_ws(text, i)
        if not text.startswith(":", i):
            return None
        value, end = _DECODER.raw_decode(text, skip_ws(text, i + 1))
    except (ValueError, RecursionError):
        return None
    if not _ends(text, end):
        return None
    return key, value, end


def _ends(text: str, end: int) -> bool:
    """Whether the value before `end` is whole: the object's "," or "}" follows it ("2" may
    become "2.5", "25" or "2e3")."""
    return text[skip_ws(text, end) : skip_ws(text, end) + 1] in (",", "}")


def _open_object(text: str, pos: int, keys: dict[str, str]) -> tuple[OpenCall, int | None] | None:
    """A call written as a JSON object ({"name": N, "arguments": {…}}; Apertus' {"N": {…}}):
    begun once its name is whole and comes before its arguments."""
    i = skip_ws(text, pos)
    if not text.startswith("{", i):
        return None
    i, call, first = i + 1, None, True
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return (call, None) if call else None
        if text[i] == "}":
            if call is None:
                return None
            call.done = True
            return call, i + 1
        if not first:
            if text[i] != ",":
                return (call, None) if call else None
            i = skip_ws(text, i + 1)
        first = False
        if not text.startswith('"', i):
            return (call, None) if call else None
        try:
            key, j = scanstring(text, i + 1)
        except ValueError:
            return (call, None) if call else None
        j = skip_ws(text, j)
        if not text.startswith(":", j):
            return (call, None) if call else None
        j = skip_ws(text, j + 1)
        if "keyed" in keys or (call is not None and key in (keys["args"], *_ARGS)):
            if "keyed" in keys:
                if call is not None or not _NAME.fullmatch(key):
                    return None
                call = OpenCall(key, [])
            end = _members(text, j, call.members)
            if end is None:
                return call, None
            i = end
            continue
        try:
            value, end = _DECODER.raw_decode(text, j)
        except (ValueError, RecursionError):
            return (call, None) if call else None
        if not _ends(text, end):
            return (call, None) if call else None
        if key == keys["name"] and call is None:
            if not isinstance(value, str) or not _NAME.fullmatch(value):
                return None
            call = OpenCall(value, [])
        elif key in (keys["args"], *_ARGS) and call is None:
            return None  # its arguments before its name: read whole when the call ends
        i = end


# a format's arguments -> the reader of their whole members (each (text, pos, out) -> where
# they end, or None while they are open); "xml" rows are base.py's
MEMBERS = {"json": _members, "gemma4": g4_members, "python": python_members}
