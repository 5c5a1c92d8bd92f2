"""How each chat template asks a model to write tool calls, as data.

Read from the templates themselves (what they render for an assistant message's
`tool_calls`, which is what the model was trained to write):

- hermes  — Qwen2.5/Qwen3 and Hermes: `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`
- mistral — `[TOOL_CALLS]` then, by template generation, a JSON list
  `[{"name": …, "arguments": {…}, "id": …}]` (Mistral Nemo, v3), or `name[ARGS]{…}`
  (Ministral 3, Devstral) or `name[CALL_ID]id[ARGS]{…}` (Mistral Small 3.2), one
  `[TOOL_CALLS]` before each call; Mistral's templates refuse ids that are not 9 letters/digits
- gemma4  — `<|tool_call>call:name{key:value,…}<tool_call|>`, strings quoted with `<|"|>`
- json    — no tag: the reply is one JSON object `{"name": …, "parameters" | "arguments": …}`
  (Llama 3.1–3.3; Llama 3.1 may put `<|python_tag|>` first), or (Llama 4)
  `<|python_start|>text<|python_end|>` then one object per call, back to back
- harmony — gpt-oss: a message to `functions.NAME` on the commentary channel, its body the
  arguments object; prompt/harmony.py's splitter hands each on as
  `to=functions.NAME<|message|>{…}<|call|>`, which is what is parsed here

A parse function takes the text of a call (between the tags) and gives
[(name, arguments JSON text, id or None)], or None when it does not parse — as for a body
nested deeper than Python's readers go (json's and Gemma 4's recursive one stop at about a
thousand levels with a RecursionError): a model may write one, and it is text like any other.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any

from mlxlis.prompt.harmony import CALL, CALL_OPEN, CHANNEL, MESSAGE

PY_START, PY_END = "<|python_start|>", "<|python_end|>"  # Llama 4's tags before its calls
ParsedCall = tuple[str, str, str | None]  # (name, arguments as JSON text, id given by the model)
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # the tag that starts a call ("" for json: the whole reply is the call)
    close: str | None  # the tag that ends one; None: the calls run to the end of the reply
    parse: Callable[[str], list[ParsedCall] | None]
    # tool_choice: what starts a call (of that name and up to its arguments' "{", if named)
    forced: Callable[[str | None], str]
    new_id: Callable[[], str]


def _parser(parse: Callable[[str], list[ParsedCall] | None]) -> Callable:
    """`parse` with a body nested too deep to read (RecursionError) read as no call."""

    @wraps(parse)
    def guarded(body: str) -> list[ParsedCall] | None:
        try:
            return parse(body)
        except RecursionError:
            return None

    return guarded


def _openai_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _mistral_id() -> str:  # Mistral's templates raise on any other id
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _loads(text: str) -> Any:
    """JSON text -> value; None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _object_text(args: Any) -> str | None:
    """Call arguments as JSON text: an object, or a JSON string holding one; else None."""
    if isinstance(args, str):
        args = _loads(args)
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _call(obj: Any, keys: tuple[str, ...]) -> ParsedCall | None:
    """A call object {"name", "arguments" | "parameters" (the first of `keys` present), "id"?}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = _object_text(next((obj[k] for k in keys if k in obj), {}))
    if args is None:
        return None
    return obj["name"], args, obj["id"] if isinstance(obj.get("id"), str) else None


def _json_object(body: str, keys: tuple[str, ...]) -> ParsedCall | None:
    return _call(_loads(body), keys)


@_parser
def parse_hermes(body: str) -> list[ParsedCall] | None:
    call = _json_object(body.strip(), ("arguments", "parameters"))
    return [call] if call else None


@_parser
def parse_json(body: str) -> list[ParsedCall] | None:
    body = body.strip().removeprefix("<|python_tag|>").strip()
    if body.startswith(PY_START):  # Llama 4: the turn's text between the tags, the calls after
        inner, sep, after = body[len(PY_START) :].partition(PY_END)
        body = (after.strip() or inner.strip()) if sep else inner.strip()
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return None
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        at = len(body) - len(body[end:].lstrip())
    return calls or None


@_parser
def parse_harmony(body: str) -> list[ParsedCall] | None:
    """`NAME<|message|>{…}` (the text between harmony.CALL_OPEN and <|call|>)."""
    name, sep, args = body.partition(MESSAGE)
    name = name.strip()
    obj = _loads(args.strip())
    if not sep or not re.fullmatch(r"[\w.\-]+", name) or not isinstance(obj, dict):
        return None
    return [(name, json.dumps(obj, ensure_ascii=False), None)]


def _harmony_forced(name: str | None) -> str:
    """What opens a call after harmony's generation prompt, as the model writes it."""
    return (
        CHANNEL + "commentary " + CALL_OPEN + (f"{name} <|constrain|>json{MESSAGE}" if name else "")
    )


@_parser
def parse_mistral(body: str) -> list[ParsedCall] | None:
    """The text after the first [TOOL_CALLS]: a JSON list, or `name[ARGS]{…}` calls separated
    by further [TOOL_CALLS] tags (with `[CALL_ID]id` before [ARGS] in some versions)."""
    body = body.strip()
    if body.startswith("["):
        items = _loads(body)
        if not isinstance(items, list) or not items:
            return None
        calls = [_call(i, ("arguments", "parameters")) for i in items]
        return None if None in calls else calls  # type: ignore[return-value]
    calls: list[ParsedCall] = []
    for part in body.split("[TOOL_CALLS]"):
        head, sep, args = part.partition("[ARGS]")
        name, _, call_id = head.partition("[CALL_ID]")
        name = name.strip()
        if not sep or not re.fullmatch(r"[\w.\-]+", name):
            return None
        obj = _loads(args)
        if not isinstance(obj, dict):
            return None
        calls.append((name, json.dumps(obj, ensure_ascii=False), call_id.strip() or None))
    return calls


_Q = '<|"|>'  # Gemma 4's string quote


@_parser
def parse_gemma4(body: str) -> list[ParsedCall] | None:
    """`call:name{key:value,…}`; values: <|"|>strings<|"|>, numbers, true/false/null,
    {…} and […] (keys bare or quoted) — the template's format_argument, inverted."""
    m = re.match(r"\s*call:([\w.\-]+)\{", body)
    if not m:
        return None
    try:
        args, end = _g4_value(body, m.end() - 1)
    except (ValueError, IndexError):
        return None
    if body[end:].strip() or not isinstance(args, dict):
        return None
    return [(m.group(1), json.dumps(args, ensure_ascii=False), None)]


def _g4_value(s: str, i: int) -> tuple[Any, int]:
    if s.startswith(_Q, i):
        end = s.index(_Q, i + len(_Q))
        return s[i + len(_Q) : end], end + len(_Q)
    if s[i] == "{":
        out: dict[str, Any] = {}
        i += 1
        while s[i] != "}":
            if s.startswith(_Q, i):
                key, i = _g4_value(s, i)
            else:
                m = re.compile(r"[^:{}\[\],]+").match(s, i)
                if not m:
                    raise ValueError("no key")
                key, i = m.group().strip(), m.end()
            if s[i] != ":":
                raise ValueError("no colon")
            out[key], i = _g4_value(s, i + 1)
            if s[i] == ",":
                i += 1
        return out, i + 1
    if s[i] == "[":
        items: list[Any] = []
        i += 1
        while s[i] != "]":
            item, i = _g4_value(s, i)
            items.append(item)
            if s[i] == ",":
                i += 1
        return items, i + 1
    m = re.compile(r"[^,}\]]+").match(s, i)
    if not m:
        raise ValueError("no value")
    word = m.group().strip()
    scalars = {"true": True, "false": False, "null": None, "None": None}
    if word in scalars:
        return scalars[word], m.end()
    return json.loads(word), m.end()  # a number (json raises ValueError on anything else)


def _hermes_forced(name: str | None) -> str:
    return "<tool_call>\n" + (
        f'{{"name": {json.dumps(name)}, "arguments": {{' if name else '{"name": "'
    )


def _gemma4_forced(name: str | None) -> str:
    return "<|tool_call>call:" + (f"{name}{{" if name else "")


def _json_forced(key: str, lead: str = "") -> Callable[[str | None], str]:
    def forced(name: str | None) -> str:
        return lead + (f'{{"name": {json.dumps(name)}, "{key}": {{' if name else '{"name": "')

    return forced


def _mistral_forced(listed: bool) -> Callable[[str | None], str]:
    def forced(name: str | None) -> str:
        if listed:
            return "[TOOL_CALLS][" + _hermes_forced(name)[len("<tool_call>\n") :]
        return "[TOOL_CALLS]" + (f"{name}[ARGS]{{" if name else "")

    return forced


HERMES = ToolFormat(
    "hermes", "<tool_call>", "</tool_call>", parse_hermes, _hermes_forced, _openai_id
)
GEMMA4 = ToolFormat(
    "gemma4", "<|tool_call>", "<tool_call|>", parse_gemma4, _gemma4_forced, _openai_id
)


HARMONY = ToolFormat("harmony", CALL_OPEN, CALL, parse_harmony, _harmony_forced, _openai_id)


def for_template(text: str) -> ToolFormat:
    """The tool-call format a chat template renders (see the module docstring)."""
    if CHANNEL in text and CALL in text:  # gpt-oss (harmony)
        return HARMONY
    if "<|tool_call>" in text:
        return GEMMA4
    if "[TOOL_CALLS]" in text:
        listed = "[ARGS]" not in text
        return ToolFormat(
            "mistral", "[TOOL_CALLS]", None, parse_mistral, _mistral_forced(listed), _mistral_id
        )
    if "<tool_call>" in text:
        return HERMES
    key = "parameters" if '"parameters"' in text else "arguments"
    lead = PY_START + PY_END if PY_START in text else ""  # Llama 4 writes the tags first
    return ToolFormat("json", "", None, parse_json, _json_forced(key, lead), _openai_id)
