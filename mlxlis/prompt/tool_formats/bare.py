"""The formats whose calls have no tag of their own to start them.

- json    — the reply is the call: one JSON object `{"name": …, "parameters" | "arguments": …}`
  (Llama 3.1–3.3; Llama 3.1 may put `<|python_tag|>` first), or (Llama 4)
  `<|python_start|>text<|python_end|>` then one object per call, back to back;
- harmony — gpt-oss: a message to `functions.NAME` on the commentary channel, its body the
  arguments object; prompt/harmony.py's splitter hands each on as
  `to=functions.NAME<|message|>{…}<|call|>`, which is what the shared reader reads; only the
  start of a forced call (its header, written after the generation prompt) is its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mlxlis.prompt.harmony import CHANNEL, MESSAGE
from mlxlis.prompt.tool_formats.base import ParsedCall

PY_START, PY_END = "<|python_start|>", "<|python_end|>"  # Llama 4's tags before its calls
PYTHON_TAG = "<|python_tag|>"


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


def call_object(obj: Any, keys: tuple[str, ...]) -> ParsedCall | None:
    """A call object {"name", "arguments" | "parameters" (the first of `keys` present), "id"?}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = _object_text(next((obj[k] for k in keys if k in obj), {}))
    if args is None:
        return None
    return obj["name"], args, obj["id"] if isinstance(obj.get("id"), str) else None


def parse_json(body: str) -> list[ParsedCall] | None:
    """A bare-JSON reply's calls: objects back to back (after Llama 3.1's or 4's tags)."""
    body = body.strip().removeprefix(PYTHON_TAG).strip()
    if body.startswith(PY_START):  # Llama 4: the turn's text between the tags, the calls after
        inner, sep, after = body[len(PY_START) :].partition(PY_END)
        body = (after.strip() or inner.strip()) if sep else inner.strip()
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return None
        call = call_object(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        at = len(body) - len(body[end:].lstrip())
    return calls or None


def json_opener(key: str, lead: str = "") -> Callable[[str | None], str]:
    """tool_choice's start of a bare-JSON call (after Llama 4's empty text tags, `lead`)."""

    def forced(name: str | None) -> str:
        return lead + (f'{{"name": {json.dumps(name)}, "{key}": {{' if name else '{"name": "')

    return forced


def harmony_opener(name: str | None) -> str:
    """What opens a call after harmony's generation prompt, as the model writes it."""
    return (
        CHANNEL
        + "commentary to=functions."
        + (f"{name} <|constrain|>json{MESSAGE}" if name else "")
    )
