"""Tool calls in a reply, in the form the model's template asks for (tool_formats.py).

`ToolCallParser` takes the answer text as it streams and splits it into plain text and
parsed calls, in OpenAI's shape. A call is held back from its opening tag to its closing one
(to the end of the reply for formats without one), a reply that starts with `{` until it
ends (Llama 3's bare JSON, Llama 4's after its <|python_start|> tags: one object per call;
small Qwen models answer so too, so every format takes it when it
names an offered tool); what does not parse comes back as the text it was, never dropped, and
so does a call the reply leaves open, unless what it holds is a whole call of an offered tool
(models often end the reply where the closing tag would be). Whitespace between calls is dropped.
"""

from __future__ import annotations

from typing import Any

from mlxlis.prompt.segments import partial_suffix
from mlxlis.serve.tool_formats import HERMES, PY_END, PY_START, ParsedCall, ToolFormat, parse_json

LEADS = ("<|python_tag|>", PY_START)  # tags a bare-JSON call may start with (Llama 3.1, 4)


def tool_names(tools: list[dict[str, Any]]) -> frozenset[str]:
    """The function names of a request's `tools`."""
    out = set()
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.add(fn["name"])
    return frozenset(out)


class ToolCallParser:
    def __init__(self, names: frozenset[str] = frozenset(), fmt: ToolFormat = HERMES) -> None:
        self.names = names  # the offered tools: a bare-JSON reply must name one
        self.fmt = fmt
        self.calls: list[dict[str, Any]] = []
        self._buf = ""  # held: a possible start of the open tag, or an open call's body
        self._ws = ""  # whitespace held until text (emitted) or a call (dropped) follows
        self._inside = False
        self._json: str | None = None  # the reply so far, when it started with "{"
        self._started = False  # some answer text (not whitespace) was seen
        self._lead = ""  # the reply's start while it may still become a LEADS tag

    def _call(self, parsed: ParsedCall) -> dict[str, Any]:
        name, args, _ = parsed  # ids are the server's to give (unique; the format's shape)
        return {
            "id": self.fmt.new_id(),
            "type": "function",
            "function": {"name": name, "arguments": args},
        }

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(plain text to show, calls completed by `text`)."""
        if self._json is not None:
            self._json += text
            return "", []
        if not self._started and self.names and not final:
            text, self._lead = self._lead + text, ""
            head = text.lstrip()
            if head and any(len(head) < len(t) and t.startswith(head) for t in LEADS):
                self._lead = text  # "<|py…": held until it is a tag or is not
                return "", []
        if not self._started and text.strip():
            self._started = True
            head = (self._ws + self._buf + text).lstrip()
            if self.names and head.startswith(("{", *LEADS)):
                self._json, self._ws, self._buf = self._ws + self._buf + text, "", ""
                return "", []
        if not self.fmt.open:  # json: nothing but a whole-reply call is a call
            return self._text(text), []
        op, cl = self.fmt.open, self.fmt.close
        out, new = "", []
        buf, self._buf = self._buf + text, ""
        while buf:
            if self._inside:
                at = buf.find(cl) if cl is not None else -1
                if at < 0:
                    self._buf = buf
                    break
                body, buf = buf[:at], buf[at + len(cl) :]
                self._inside = False
                parsed = self.fmt.parse(body)
                if parsed is None:
                    out += self._text(op + body + cl)
                else:
                    self._ws = ""
                    new += [self._call(p) for p in parsed]
                continue
            at = buf.find(op)
            if at < 0:
                keep = partial_suffix(buf, op)
                out += self._text(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            out += self._text(buf[:at])
            buf, self._inside = buf[at + len(op) :], True
        self.calls += new
        return out, new

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held at the end of the reply: text (an unclosed call included) and the
        calls that end with the reply (a bare-JSON reply, a format without a closing tag)."""
        if self._lead:  # the reply ended inside what could have been a tag: text
            lead, self._lead = self._lead, ""
            shown, _ = self.feed(lead, final=True)
            rest, calls = self.flush()
            return shown + rest, calls
        if self._json is not None:
            reply, self._json = self._json, None
            parsed = parse_json(reply)
            if parsed is None or any(p[0] not in self.names for p in parsed):
                return reply, []
            new = [self._call(p) for p in parsed]
            self.calls += new
            body = reply.strip()  # Llama 4: the turn's text between its tags is content
            if body.startswith(PY_START) and PY_END in body:
                inner, _, after = body[len(PY_START) :].partition(PY_END)
                return (inner.strip() if after.strip() else ""), new
            return "", new
        if self._inside:  # a call the reply ended in: whole without its closing tag?
            body, self._buf, self._inside = self._buf, "", False
            parsed = self.fmt.parse(body)
            if parsed is not None and (
                self.fmt.close is None or all(p[0] in self.names for p in parsed)
            ):
                new = [self._call(p) for p in parsed]
                self.calls += new
                self._ws = ""
                return "", new
            self._buf = self.fmt.open + body
        held = (self.fmt.open if self._inside else "") + self._buf
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
