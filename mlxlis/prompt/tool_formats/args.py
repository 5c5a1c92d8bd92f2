"""A call's arguments in the syntaxes that are not rows of tags: a JSON object, Gemma 4's own
object syntax and LFM2's Python call syntax. Each reader takes the text and where the
arguments start and gives (the arguments, where they end), or None; each writer writes them
as the template does."""

from __future__ import annotations

import json
import re
from typing import Any

from mlxlis.prompt.tool_formats.values import literal

Read = tuple[dict[str, Any], int] | None
_WS = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()  # type: ignore[union-attr]


def json_at(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at `pos` (whitespace before it skipped); ValueError if none."""
    return _DECODER.raw_decode(text, skip_ws(text, pos))


def read_json(text: str, pos: int) -> Read:
    value, end = json_at(text, pos)
    return (value, end) if isinstance(value, dict) else None


def write_json(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)  # Jinja's tojson, as the templates write it


# ---------------------------------------------------------------- Gemma 4

Q = '<|"|>'  # Gemma 4's string quote
_G4_KEY = re.compile(r"[^:{}\[\],]+")
_G4_WORD = re.compile(r"[^,}\]]+")
_G4_SCALARS = {"true": True, "false": False, "null": None, "None": None}


def g4_value(s: str, i: int) -> tuple[Any, int]:
    """Gemma 4's value at `i`: <|"|>strings<|"|>, numbers, true/false/null, {key:value,…}
    (keys bare or quoted) and […] — the template's format_argument, inverted."""
    if s.startswith(Q, i):
        end = s.index(Q, i + len(Q))
        return s[i + len(Q) : end], end + len(Q)
    if s[i] == "{":
        out: dict[str, Any] = {}
        i += 1
        while s[i] != "}":
            key, out[key], i = g4_member(s, i)
            if s[i] == ",":
                i += 1
        return out, i + 1
    if s[i] == "[":
        items: list[Any] = []
        i += 1
        while s[i] != "]":
            item, i = g4_value(s, i)
            items.append(item)
            if s[i] == ",":
                i += 1
        return items, i + 1
    m = _G4_WORD.match(s, i)
    if not m:
        raise ValueError("no value")
    word = m.group().strip()
    if word in _G4_SCALARS:
        return _G4_SCALARS[word], m.end()
    return json.loads(word), m.end()  # a number (json raises ValueError on anything else)


def g4_member(s: str, i: int) -> tuple[str, Any, int]:
    """`key:value` at `i` (the key bare or quoted): (key, value, where it ends)."""
    if s.startswith(Q, i):
        key, i = g4_value(s, i)
    else:
        m = _G4_KEY.match(s, i)
        if not m:
            raise ValueError("no key")
        key, i = m.group().strip(), m.end()
    if s[i] != ":":
        raise ValueError("no colon")
    value, i = g4_value(s, i + 1)
    return key, value, i


def g4_members(text: str, pos: int, out: list[tuple[str, Any]]) -> int | None:
    """The whole members of Gemma 4's object at `pos` into `out` (each once the "," or "}"
    after it came: "2" may go on); where the object ends, or None while it is open."""
    if not text.startswith("{", pos):
        return None
    i = pos + 1
    while i < len(text):
        if text[i] == "}":
            return i + 1
        try:
            key, value, i = g4_member(text, i)
        except (ValueError, IndexError):  # a member still coming in
            return None
        if i >= len(text) or text[i] not in ",}":
            return None
        out.append((key, value))
        i += text[i] == ","
    return None


def read_gemma4(text: str, pos: int) -> Read:
    if not text.startswith("{", pos):
        return None
    value, end = g4_value(text, pos)
    return (value, end) if isinstance(value, dict) else None


def write_g4(value: Any) -> str:
    """As Gemma 4's template writes a value: keys sorted, strings in its quotes."""
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{write_g4(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(write_g4(v) for v in value) + "]"
    return str(value)  # numbers; None as Jinja prints it


# ---------------------------------------------------------------- LFM2's Python call syntax

_PY_KEY = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*")
_PY_COMMA = re.compile(r"\s*,")
# what follows a string's closing quote: the next argument or the call's end
_PY_AFTER = re.compile(r"\s*(?:,\s*[A-Za-z_]\w*\s*=|\))")
_OPENERS, _CLOSERS = "([{", ")]}"


def _py_string(text: str, pos: int) -> tuple[str, int]:
    """A quoted string at `pos`. LFM2's template writes it between quotes as it is, with no
    escapes (a quote inside stays a quote), so it ends at the quote the next argument or the
    call's end follows."""
    quote, at = text[pos], pos + 1
    while True:
        at = text.index(quote, at)
        if _PY_AFTER.match(text, at + 1):
            return text[pos + 1 : at], at + 1
        at += 1


def _py_value(text: str, pos: int) -> tuple[Any, int]:
    if text[pos] in "'\"":
        return _py_string(text, pos)
    depth, at, quote = 0, pos, ""
    while at < len(text):  # a literal to the comma or parenthesis that ends it
        c = text[at]
        if quote and c == "\\":  # an escape: the next character is no quote's end
            at += 1
        elif quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in _OPENERS:
            depth += 1
        elif c in _CLOSERS:
            if depth == 0:
                break
            depth -= 1
        elif c == "," and depth == 0:
            break
        at += 1
    return literal(text[pos:at].strip()), at


def python_members(text: str, pos: int, out: list[tuple[str, Any]]) -> int | None:
    """The whole `key=value` arguments at `pos` into `out` (each once the "," or ")" after it
    came); where the call's closing parenthesis is, or None while it has not come."""
    while m := _PY_KEY.match(text, pos):
        try:
            value, end = _py_value(text, m.end())
        except (ValueError, IndexError):  # a string still coming in
            return None
        at = skip_ws(text, end)
        if at >= len(text) or text[at] not in ",)":
            return None
        out.append((m.group(1), value))
        if text[at] == ")":
            return at
        pos = at + 1
    at = skip_ws(text, pos)
    return at if text.startswith(")", at) else None


def read_python(text: str, pos: int) -> Read:
    """`key=value, …` up to the call's closing parenthesis."""
    args: dict[str, Any] = {}
    while m := _PY_KEY.match(text, pos):
        args[m.group(1)], pos = _py_value(text, m.end())
        comma = _PY_COMMA.match(text, pos)
        if comma is None:
            break
        pos = comma.end()
    return args, pos


def write_python(args: dict[str, Any]) -> str:
    """As LFM2's template writes arguments: strings quoted as they are, objects `tojson`,
    the rest Jinja's `|string`."""

    def one(v: Any) -> str:
        if isinstance(v, str):
            return f"'{v}'"
        return json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else str(v)

    return ", ".join(f"{k}={one(v)}" for k, v in args.items())
