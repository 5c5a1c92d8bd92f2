"""Tool calls in a reply, in the form the model's template asks for (tool_formats/).

`ToolCallParser` takes the answer text as it streams and splits it into plain text and
parsed calls, in OpenAI's shape. A call is held back from its opening tag to its closing one
(to the end of the reply for formats without one), a reply that starts with `{` until it
ends (Llama 3's bare JSON, Llama 4's after its <|python_start|> tags: one object per call;
small Qwen models answer so too, so every format takes it when it
names an offered tool); what does not parse comes back as the text it was, never dropped, and
so does a call the reply leaves open, unless what it holds is a whole call of an offered tool
(models often end the reply where the closing tag would be). Whitespace between calls is dropped.

A reply cut by max_tokens (`flush(cut=True)`) is the exception: a call it was cut inside never
came, so its markup is no text the model meant to show; it is dropped (a possible start of a
tag too), and the calls completed before the cut are kept (one whose closing tag alone was cut
included); the finish reason tells the client. A bare-JSON reply is dropped so only while it
can still be a call of an offered tool: a cut JSON answer stays the text it is.

The calls also stream (`take_pieces`): a call begins once its name is whole and its arguments
go out one whole argument at a time (tool_formats/partial.py), the rest when the call is read
whole; a call of a tool not offered goes out whole. A call begun and then broken keeps what
was sent (a warning says so) and its text is returned as above.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from mlxlis.prompt.segments import partial_suffix
from mlxlis.prompt.tool_formats import HERMES, PY_END, PY_START, ParsedCall, ToolFormat, parse_json
from mlxlis.prompt.tool_formats.partial import read_open

log = logging.getLogger("mlxlis.serve")
LEADS = ("<|python_tag|>", PY_START)  # tags a bare-JSON call may start with (Llama 3.1, 4)
# where an open call's argument or the call may end (_advance): JSON's and Gemma 4's "," and
# "}", a tag's ">", LFM2's ")" and the "=" of the key after a string
ENDS = frozenset(",}>)=")


def tool_names(tools: list[dict[str, Any]]) -> frozenset[str]:
    """The function names of a request's `tools`."""
    return frozenset(tool_schemas(tools))


def tool_schemas(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Each offered function's parameters schema, by name (what a format that writes
    arguments as text reads their values by)."""
    out: dict[str, Any] = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters")
    return out


class ToolCallParser:
    def __init__(
        self,
        names: frozenset[str] = frozenset(),
        fmt: ToolFormat = HERMES,
        schemas: Mapping[str, Any] | None = None,
    ) -> None:
        self.names = names  # the offered tools: a bare-JSON reply must name one
        self.fmt = fmt
        self.schemas = schemas or {}  # their parameters, by name: how text values read
        self.calls: list[dict[str, Any]] = []
        self._buf = ""  # held: a possible start of the open tag, or an open call's body
        self._ws = ""  # whitespace held until text (emitted) or a call (dropped) follows
        self._inside = False
        self._json: str | None = None  # the reply so far, when it started with "{"
        self._started = False  # some answer text (not whitespace) was seen
        self._lead = ""  # the reply's start while it may still become a LEADS tag
        self.pieces: list[dict[str, Any]] = []  # the stream's call deltas not yet taken
        self._sent: list[list[str]] = []  # the open block's calls begun: [id, name, args sent]
        self._held = False  # the open block's calls go out whole, when it closes
        self._between = True  # no call of the open block is open: a name may begin any time

    def take_pieces(self) -> list[dict[str, Any]]:
        """The calls' stream since the last take, in OpenAI's chunk shape: a call's first
        piece has its index, id and name, the next ones more of its arguments' JSON text,
        whole arguments at a time (partial.py); all of a call's pieces come before the next
        call's, and together its arguments are the call's `arguments`."""
        out, self.pieces = self.pieces, []
        return out

    def _advance(self, body: str, new: str) -> None:
        """Send what the open block's calls hold so far (`body`: the block's text, `new` its
        last piece). Inside a call, an argument or the call ends only at one of ENDS: without
        one the block is not read again (a long argument would be read once a token); between
        calls a name may end anywhere."""
        if self._held or not (self._between or any(c in new for c in ENDS)):
            return
        calls = read_open(self.fmt, body, self.schemas)
        self._between = not calls or calls[-1].done
        for j, call in enumerate(calls):
            index = len(self.calls) + j
            if j == len(self._sent):
                if self.names and call.name not in self.names:
                    self._held = True  # not a tool offered: it goes out as it reads whole
                    return
                self._sent.append([self.fmt.new_id(), call.name, ""])
                fn = {"name": call.name, "arguments": ""}
                self.pieces.append(
                    {"index": index, "id": self._sent[j][0], "type": "function", "function": fn}
                )
            sent, text = self._sent[j][2], call.text()
            if len(text) > len(sent) and text.startswith(sent):
                self.pieces.append({"index": index, "function": {"arguments": text[len(sent) :]}})
                self._sent[j][2] = text

    def _finish(self, parsed: list[ParsedCall], cut: bool = False) -> list[dict[str, Any]]:
        """The calls of a block read whole (ids are the server's to give: unique, in the
        format's shape); what their stream still lacks goes out."""
        new = []
        for j, (name, args, _) in enumerate(parsed):
            index = len(self.calls) + j
            if j < len(self._sent):
                call_id, sent_name, sent = self._sent[j]
                if sent_name != name or not args.startswith(sent):
                    log.warning(
                        "a %s tool call read whole differs from what streamed of it", self.fmt.name
                    )
                elif len(args) > len(sent):
                    self.pieces.append(
                        {"index": index, "function": {"arguments": args[len(sent) :]}}
                    )
            else:
                call_id = self.fmt.new_id()
                fn = {"name": name, "arguments": args}
                self.pieces.append(
                    {"index": index, "id": call_id, "type": "function", "function": fn}
                )
            new.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        if len(self._sent) > len(parsed) and not cut:
            log.warning("a %s tool call begun in the stream did not read whole", self.fmt.name)
        self._sent, self._held, self._between = [], False, True
        self.calls += new
        return new

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
                    self._advance(buf, text)
                    break
                body, buf = buf[:at], buf[at + len(cl) :]
                self._inside = False
                parsed = self.fmt.parse(body, self.schemas)
                if parsed is None:  # the model broke the format: what it wrote, as text
                    self._finish([])
                    log.warning(
                        "a %s tool call did not parse; returned as text (%d characters)",
                        self.fmt.name,
                        len(op + body + cl),
                    )
                    out += self._text(op + body + cl)
                else:
                    self._ws = ""
                    new += self._finish(parsed)
                continue
            at = buf.find(op)
            if at < 0:
                keep = partial_suffix(buf, op)
                out += self._text(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            out += self._text(buf[:at])
            buf, self._inside = buf[at + len(op) :], True
        return out, new

    def flush(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """What is held at the end of the reply: text (an unclosed call included) and the
        calls that end with the reply (a bare-JSON reply, a format without a closing tag).
        `cut`: the reply was cut (max_tokens), so what is held as a possible call is dropped
        and the whole calls before the cut are kept (see the module docstring)."""
        if self._lead:  # the reply ended inside what could have been a tag
            lead, self._lead = self._lead, ""
            if cut:
                return "", []
            shown, _ = self.feed(lead, final=True)
            rest, calls = self.flush()
            return shown + rest, calls
        if self._json is not None:
            reply, self._json = self._json, None
            parsed = parse_json(reply)
            if parsed is None or any(p[0] not in self.names for p in parsed):
                if cut and (whole := self._cut_json(reply)) is not None:
                    shown, parsed = whole
                    return shown, self._finish(parsed)
                return reply, []
            new = self._finish(parsed)
            body = reply.strip()  # Llama 4: the turn's text between its tags is content
            if body.startswith(PY_START) and PY_END in body:
                inner, _, after = body[len(PY_START) :].partition(PY_END)
                return (inner.strip() if after.strip() else ""), new
            return "", new
        if self._inside:  # a call the reply ended in: whole without its closing tag?
            body, self._buf, self._inside = self._buf, "", False
            if cut and self.fmt.close is not None:  # the cut may fall in the closing tag
                body = body[: len(body) - partial_suffix(body, self.fmt.close)]
            parsed = self.fmt.parse(body, self.schemas)
            if parsed is not None and (
                self.fmt.close is None or all(p[0] in self.names for p in parsed)
            ):
                self._ws = ""
                return "", self._finish(parsed)
            if cut:  # cut inside the call: the calls before it in its body, if any, are whole
                self._ws = ""
                return "", self._finish(self._before_cut(body), cut=True)
            self._finish([])
            self._buf = self.fmt.open + body
        held = (self.fmt.open if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        ws, self._ws = self._ws, ""
        if held and not cut:
            return ws + held, []
        # cut: what is held is a possible start of the open tag, a call the cut stopped,
        # dropped with the whitespace before it
        return ("" if self.calls or held else ws), []

    def _before_cut(self, body: str) -> list[ParsedCall]:
        """The whole calls at the start of a cut call body of a format whose calls run to the
        end of the reply (Mistral's `[TOOL_CALLS]`, one tag before each call; or its JSON
        list, the list's whole items); none for the formats that close each call."""
        if self.fmt.close is not None:
            return []
        text = body.strip()
        if text.startswith("["):  # a JSON list cut in one of its items
            items, _ = _objects(text[1:], ",")
            return (self.fmt.parse(json.dumps(items), self.schemas) or []) if items else []
        text = text[: len(text) - partial_suffix(text, self.fmt.open)]  # cut in the next tag
        while not (parsed := self.fmt.parse(text, self.schemas)) and self.fmt.open in text:
            text = text[: text.rindex(self.fmt.open)]
        return parsed or []

    def _cut_json(self, reply: str) -> tuple[str, list[ParsedCall]] | None:
        """A bare-JSON reply cut by max_tokens: (the text between Llama 4's tags, the whole
        calls before the cut) while what follows them can still be a call of an offered
        tool, else None (it is text). The tags are read as parse_json reads them; text cut
        between them is the turn's text."""
        body, shown = reply.strip().removeprefix("<|python_tag|>").strip(), ""
        in_tags = False
        if body.startswith(PY_START):
            inner, sep, after = body[len(PY_START) :].partition(PY_END)
            if not sep:  # cut inside the tags, maybe in <|python_end|> itself
                inner = inner[: len(inner) - partial_suffix(inner, PY_END)]
            in_tags = not (sep and after.strip())
            shown, body = ("", inner) if in_tags else (inner.strip(), after)
        objects, rest = _objects(body)
        parsed = [parse_json(json.dumps(o, ensure_ascii=False)) for o in objects]
        if any(p is None or p[0][0] not in self.names for p in parsed) or not _call_start(
            rest, self.names
        ):
            return (body.strip(), []) if in_tags and not objects else None
        return shown, [p[0] for p in parsed if p]

    def _text(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            self._ws += text
            return ""
        out = self._ws + body
        self._ws = text[len(body) :]
        return out


def _objects(text: str, sep: str = "") -> tuple[list[Any], str]:
    """The whole JSON values at the start of `text` (whitespace and `sep` between them), and
    the rest."""
    out: list[Any] = []
    decoder, at = json.JSONDecoder(), 0
    while True:
        rest = text[at:].lstrip()
        if out and sep and rest.startswith(sep):
            rest = rest[len(sep) :].lstrip()
        try:
            value, end = decoder.raw_decode(rest)
        except (ValueError, RecursionError):  # not JSON, or nested past json's reach
            return out, rest
        out.append(value)
        text, at = rest, end


def _call_start(text: str, names: frozenset[str]) -> bool:
    """Whether `text` can still become `{"name": N, …}` for an offered tool N (whitespace
    aside): the start of that opening, or that opening with the start of an offered name."""
    compact = re.sub(r"\s+", "", text)
    head = '{"name":"'
    if len(compact) <= len(head):
        return head.startswith(compact)
    if not compact.startswith(head):
        return False
    name = compact[len(head) :]
    name = name[: name.index('"')] if '"' in name else name
    closed = '"' in compact[len(head) :]
    return any(n == name or (not closed and n.startswith(name)) for n in names)
