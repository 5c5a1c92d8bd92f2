"""A tool-call format as data, and the one reader and writer every format shares.

A format is a few templates of text with placeholders:

- `block`: how a reply's calls are wrapped, `{calls}` where they go (`<minimax:tool_call>\\n
  {calls}</minimax:tool_call>`); with `single`, a block holds one call and blocks repeat,
  `between` apart (Hermes' `<tool_call>` around each call);
- `call`: one call, `{name}` and `{args}` in it (and `{id}`, `{index}` from 0, `{index1}` from
  1, as some templates number calls); a call that starts with `{` is a JSON object whose keys
  the template names (`{"name": "{name}", "arguments": {args}}`) and is read as JSON, its keys
  in any order;
- `args`: how `{args}` is written: "json" (an object), "xml" (one `arg` row per argument,
  `{key}` and `{value}` in it, and `{string}` / `{type}` where a template says a value's kind
  in the tag; values written in `values` style, read by the tool's schema: values.py),
  "gemma4" or "python" (args.py);
- `open` / `close`: the tags the streaming parser looks for (tool_calls.py): what starts a block and
  what ends it (None: the block runs to the end of the reply, as Mistral's does).

Reading is lenient where models are: whitespace in a template's text may be any whitespace or
none, except next to an argument's value (the one newline Qwen3-Coder puts around it is taken
off, once, and nothing else, so a string keeps its own whitespace). Writing is exact: the probe
render (detect.py) recognises a format by the text its writer makes.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from mlxlis.prompt.tool_formats import args as codecs
from mlxlis.prompt.tool_formats.values import json_type, property_schema, read_value, write_value

ParsedCall = tuple[str, str, str | None]  # (name, arguments as JSON text, id given by the model)
Call = tuple[str, Mapping[str, Any]]  # (name, arguments) to write
FIELD = re.compile(r"\{(calls|name|args|id|index|index1|key|value|string|type)\}")
_ALNUM = string.ascii_letters + string.digits
_PATTERNS = {
    "name": r"(?P<name>[\w.\-]+)",  # OpenAI's function names, Responses' namespace.name
    "id": r"(?P<id>[\w\-]*)",
    "index": r"\d+",
    "index1": r"\d+",
    "key": r"(?P<key>[^\n]*?)",
    "string": r"(?P<string>true|false)",
    "type": r"(?P<type>\w+)",
}
SENTINEL = "\u241f"  # marks where a placeholder was, in text a template never holds


def openai_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def mistral_id() -> str:  # Mistral's templates raise on any other id
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _literal(text: str, lead: bool = True) -> str:
    """A template's literal text as a pattern: each run of whitespace any whitespace or none,
    and (`lead`) any whitespace before it."""
    out = r"\s*" if lead else ""
    for part in re.split(r"(\s+)", text):
        if part:
            out += r"\s*" if part.isspace() else re.escape(part)
    return out


def _pattern(template: str, lead: bool = True) -> str:
    """A template (without `{args}` / `{calls}` / `{value}`) as a pattern."""
    out = ""
    for i, piece in enumerate(FIELD.split(template)):
        out += _PATTERNS[piece] if i % 2 else _literal(piece, lead or i > 0)
    return out


def _row_pattern(row: str) -> re.Pattern[str]:
    """An XML argument row as a pattern; the whitespace right around `{value}` is the
    template's padding, taken off once if there (and never any more of the value's)."""
    before, after = row.split("{value}")
    pad_l = before[len(before.rstrip()) :]
    pad_r = after[: len(after) - len(after.lstrip())]
    pattern = _pattern(before[: len(before) - len(pad_l)])
    pattern += f"(?:{re.escape(pad_l)})?" if pad_l else ""
    pattern += r"(?P<value>.*?)"
    pattern += f"(?:{re.escape(pad_r)})?" if pad_r else ""
    return re.compile(pattern + _pattern(after[len(pad_r) :], lead=False), re.S)


def _fill(template: str, values: Mapping[str, str]) -> str:
    """`template` with its placeholders replaced in one pass (a value holding "{name}" stays)."""
    return FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), template)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # the tag that starts a block ("" for bare JSON: the whole reply is the call)
    close: str | None  # the tag that ends it; None: the calls run to the end of the reply
    block: str
    call: str
    args: str = "json"  # "json" | "xml" | "gemma4" | "python"
    arg: str = ""  # "xml": one argument's row
    values: str = "json"  # "xml": how a value is written (values.STYLES)
    sep: str = ""  # between the calls of one block
    single: bool = False  # one call a block, blocks repeated `between` apart
    between: str = ""
    new_id: Callable[[], str] = openai_id
    # a reader of its own where the shared one cannot say it (bare JSON's Llama 4 tags)
    reader: Callable[[str], list[ParsedCall] | None] | None = None
    # tool_choice's call start, where it is not the written call's start (harmony's header)
    opener: Callable[[str | None], str] | None = None
    models: str = field(default="", compare=False)  # who writes it, for the docs

    # ---------------------------------------------------------------- the compiled pieces

    @cached_property
    def parts(self) -> dict[str, Any]:
        head, tail = self.block.split("{calls}")
        call_head, call_tail = self.call.split("{args}")
        return {
            "block_head": re.compile(_pattern(head)),
            "block_tail": re.compile(_pattern(tail) + r"\s*\Z"),
            "sep": re.compile(_pattern(self.sep)),
            "call_head": re.compile(_pattern(call_head)),
            "call_tail": re.compile(_pattern(call_tail)),
            "row": _row_pattern(self.arg) if self.args == "xml" else None,
            "row_closer": (self.arg.split("{value}")[-1].split() or [""])[0],
        }

    @cached_property
    def object_layout(self) -> list[tuple[str, str]] | None:
        """For a call written as a JSON object, its keys in the template's order with the
        placeholder each holds ([("name", "name"), ("arguments", "args")]; Apertus' call is
        keyed by the name: [("{name}", "args")]); None for other calls."""
        call = self.call.lstrip()
        if not call.startswith("{") or FIELD.match(call):  # "{name}…" is no object
            return None
        text = FIELD.sub(
            lambda m: (
                json.dumps(SENTINEL + m.group(1)) if m.group(1) == "args" else SENTINEL + m.group(1)
            ),
            self.call,
        )
        out = []
        for key, value in json.loads(text).items():
            field_ = value[1:] if isinstance(value, str) and value[:1] == SENTINEL else ""
            out.append(("{name}" if key == SENTINEL + "name" else key, field_))
        return out

    @cached_property
    def object_keys(self) -> dict[str, str] | None:
        """placeholder -> its key ("name" -> "name", "args" -> "arguments"; "keyed": the
        name is the key, the arguments its value)."""
        if self.object_layout is None:
            return None
        keys = {f: k for k, f in self.object_layout if f and k != "{name}"}
        if any(k == "{name}" for k, _ in self.object_layout):
            keys["keyed"] = "yes"
        return keys

    # ---------------------------------------------------------------- reading

    def parse(self, body: str, schemas: Mapping[str, Any] | None = None) -> list[ParsedCall] | None:
        """The calls of one block, from the text between `open` and `close` (without them),
        or None when it does not parse — as for a body nested deeper than Python's readers
        go (a RecursionError at about a thousand levels): a model may write one, and it is
        text like any other. `schemas`: each offered tool's parameters, by name."""
        try:
            if self.reader is not None:
                return self.reader(body)
            return self._read(self.open + body + (self.close or ""), schemas or {})
        except (RecursionError, ValueError, IndexError):
            return None

    def _read(self, text: str, schemas: Mapping[str, Any]) -> list[ParsedCall] | None:
        p = self.parts
        m = p["block_head"].match(text)
        if m is None:
            return None
        pos, calls = m.end(), []
        while not (calls and self.single):
            at = pos
            if calls:
                sep = p["sep"].match(text, pos)
                if sep is None:
                    break
                at = sep.end()
            got = self._read_call(text, at, len(calls), schemas)
            if got is None:
                break
            calls.append(got[0])
            pos = got[1]
        if not calls or p["block_tail"].match(text, pos) is None:
            return None
        return calls

    def _read_call(
        self, text: str, pos: int, index: int, schemas: Mapping[str, Any]
    ) -> tuple[ParsedCall, int] | None:
        keys = self.object_keys
        if keys is not None:
            return self._read_object(text, pos, keys)
        p = self.parts
        m = p["call_head"].match(text, pos)
        if m is None:
            return None
        name = m.group("name")
        got = self._read_args(text, m.end(), schemas.get(name))
        if got is None:
            return None
        args, end = got
        tail = p["call_tail"].match(text, end)
        if tail is None:
            return None
        call_id = m.groupdict().get("id") or None
        return (name, json.dumps(args, ensure_ascii=False), call_id), tail.end()

    def _read_object(
        self, text: str, pos: int, keys: dict[str, str]
    ) -> tuple[ParsedCall, int] | None:
        if not text.startswith("{", codecs.skip_ws(text, pos)):
            return None
        obj, end = codecs.json_at(text, pos)
        if not isinstance(obj, dict):
            return None
        if "keyed" in keys:  # {"NAME": {arguments}} (Apertus)
            if len(obj) != 1:
                return None
            ((name, args),) = obj.items()
        else:
            name = obj.get(keys["name"])
            # the template's key first; a model may use the other common one
            found = [k for k in (keys["args"], "arguments", "parameters") if k in obj]
            args = obj[found[0]] if found else {}
        if isinstance(args, str):  # arguments as JSON text holding an object
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(name, str) or not re.fullmatch(_PATTERNS["name"], name):
            return None
        if not isinstance(args, dict):
            return None
        call_id = obj.get(keys["id"]) if "id" in keys else None
        call_id = call_id if isinstance(call_id, str) else None
        return (name, json.dumps(args, ensure_ascii=False), call_id), end

    def _read_args(self, text: str, pos: int, schema: Any) -> codecs.Read:
        if self.args == "json":
            return codecs.read_json(text, pos)
        if self.args == "gemma4":
            return codecs.read_gemma4(text, codecs.skip_ws(text, pos))
        if self.args == "python":
            return codecs.read_python(text, pos)
        out: list[tuple[str, Any]] = []
        end = self.read_rows(text, pos, schema, out)
        return dict(out), end

    def read_rows(self, text: str, pos: int, schema: Any, out: list[tuple[str, Any]]) -> int:
        """The whole argument rows at `pos` ("xml"), each (key, value) into `out`; where they
        end. `schema`: the tool's parameters."""
        row, closer = self.parts["row"], self.parts["row_closer"]
        # a row ends with its closing tag: no need to try one that has not come (a long
        # value streaming in would be scanned again at each piece)
        while text.find(closer, pos) >= 0 and (m := row.match(text, pos)) is not None:
            found = m.groupdict()
            hint = "string" if found.get("string") == "true" else found.get("type")
            key = m.group("key")
            # DeepSeek's string="false": JSON, whatever the schema says
            prop = None if found.get("string") == "false" else property_schema(schema, key)
            out.append((key, read_value(m.group("value"), prop, schema, hint)))
            pos = m.end()
        return pos

    # ---------------------------------------------------------------- writing

    def write_args(self, args: Mapping[str, Any]) -> str:
        if self.args == "json":
            return codecs.write_json(dict(args))
        if self.args == "gemma4":
            return codecs.write_g4(dict(args))
        if self.args == "python":
            return codecs.write_python(dict(args))
        rows = []
        for key, value in args.items():
            fields = {
                "key": key,
                "value": write_value(value, self.values),
                "string": "true" if isinstance(value, str) else "false",
                "type": json_type(value),
            }
            rows.append(_fill(self.arg, fields))
        return "".join(rows)

    def write_call(self, call: Call, index: int = 0, call_id: str | None = None) -> str:
        name, args = call
        fields = {
            "name": name,
            "args": self.write_args(args),
            "id": call_id if call_id is not None else f"call{index:05d}",
            "index": str(index),
            "index1": str(index + 1),
        }
        return _fill(self.call, fields)

    def write(self, calls: Sequence[Call], ids: Sequence[str] | None = None) -> str:
        """`calls` as a template of this format writes them in an assistant turn."""
        texts = [self.write_call(c, i, ids[i] if ids else None) for i, c in enumerate(calls)]
        if self.single:
            return self.between.join(self.block.replace("{calls}", t) for t in texts)
        return self.block.replace("{calls}", self.sep.join(texts))

    def forced(self, name: str | None) -> str:
        """What opens a call, as the model writes it (tool_choice): up to the name (None), or
        with that name up to its arguments (a JSON object's "{" included)."""
        if self.opener is not None:
            return self.opener(name)
        head = self.block.split("{calls}")[0]
        call = _fill(self.call, {"id": "call00000", "index": "0", "index1": "1"})
        if name is None:
            return head + call[: call.index("{name}")]
        start = call[: call.index("{args}")].replace("{name}", name)
        return head + start + ("{" if self.args in ("json", "gemma4") else "")
