"""Tool calls in a reply, in the two forms templates ask for:

- Qwen's (and Hermes') blocks, `<tool_call>{"name": …, "arguments": …}</tool_call>`, anywhere
  in the answer;
- a reply that is one JSON object `{"name": …, "arguments" | "parameters": …}` naming an
  offered tool (Llama 3's form; small Qwen models answer so too).

`ToolCallParser` takes the answer text as it streams and splits it into plain text and
parsed calls, in OpenAI's shape. A block is held back from its opening tag to its closing
one, a reply that starts with `{` until it ends; what does not parse (not JSON, no name, a
tool that was not offered) comes back as the text it was, never dropped, and so does a block
the reply leaves open. Whitespace between calls is dropped.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_call(body: str, names: frozenset[str] | None = None) -> dict[str, Any] | None:
    """{"id", "type": "function", "function": {"name", "arguments": JSON text}} or None;
    `names`: the tools a call may name (None: any)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def tool_names(tools: list[dict[str, Any]]) -> frozenset[str]:
    """The function names of a request's `tools`."""
    out = set()
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.add(fn["name"])
    return frozenset(out)


class ToolCallParser:
    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        self.names = names  # the offered tools: a bare-JSON reply must name one
        self.calls: list[dict[str, Any]] = []
        self._buf = ""  # held: a possible start of OPEN, or an open block's body
        self._ws = ""  # whitespace held until text (emitted) or a call (dropped) follows
        self._inside = False
        self._json: str | None = None  # the reply so far, when it started with "{"
        self._started = False  # some answer text (not whitespace) was seen

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(plain text to show, calls completed by `text`)."""
        if self._json is not None:
            self._json += text
            return "", []
        if not self._started and text.strip():
            self._started = True
            if self.names and (self._ws + self._buf + text).lstrip().startswith("{"):
                self._json, self._ws, self._buf = self._ws + self._buf + text, "", ""
                return "", []
        out, new = "", []
        buf, self._buf = self._buf + text, ""
        while buf:
            if self._inside:
                at = buf.find(CLOSE)
                if at < 0:
                    self._buf = buf
                    break
                body, buf = buf[:at], buf[at + len(CLOSE) :]
                self._inside = False
                call = parse_call(body)
                if call is None:
                    out += self._text(OPEN + body + CLOSE)
                else:
                    self._ws = ""
                    new.append(call)
                continue
            at = buf.find(OPEN)
            if at < 0:
                keep = _partial_suffix(buf, OPEN)
                out += self._text(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            out += self._text(buf[:at])
            buf, self._inside = buf[at + len(OPEN) :], True
        self.calls += new
        return out, new

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held at the end of the reply: text (an unclosed block included) and, for
        a reply that was one JSON object, the call."""
        if self._json is not None:
            reply, self._json = self._json, None
            call = parse_call(reply, self.names)
            if call is None:
                return reply, []
            self.calls.append(call)
            return "", [call]
        held = (OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        ws, self._ws = self._ws, ""
        if held:
            return ws + held, []
        return ("" if self.calls else ws), []

    def _text(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            self._ws += text
            return ""
        out = self._ws + body
        self._ws = text[len(body) :]
        return out
