"""A tool-call format's calls as an llguidance Lark grammar, built from its definition
(tool_formats/base.py) and the offered tools' schemas: the model's own syntax, token by token.

- The template's text is written as it writes it; a piece of it that is one token of the
  model's vocabulary (a special token, or a call tag) is named by id (`<[id]>`), the rest is
  text.
- A call written as a JSON object, or arguments written as one, is `%json` of a schema: the
  call's keys in the template's order, the arguments by the tool's `parameters`.
- Arguments written as rows of tags (XML formats): one row per parameter, in the order the
  schema lists them, the required ones always; each value by its JSON type: a string any text
  that does not hold the tag that ends it (with its enum, length and anchored pattern where the
  schema says them), integers and numbers their JSON lexemes within the schema's bounds,
  booleans and null as the template writes them (`true` / `True`), objects and arrays `%json`
  by the property's schema; the kind a tag says (DeepSeek's `string=`, Kimi K3's `type=`)
  follows the value's.
- Gemma 4's and LFM2's own argument syntaxes, likewise by the schema.

A string value and the text that ends it are one lazy lexeme, ended by the first closing text
as the reader ends it (llguidance's lexer is greedy: a value terminal alone would swallow the
start of its own closing tag).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from typing import Any

from mlxlis.generation.constraints import JSON_LAYOUT
from mlxlis.serve.tool_formats import TABLE, ToolFormat
from mlxlis.serve.tool_formats.args import Q, write_g4
from mlxlis.serve.tool_formats.base import FIELD
from mlxlis.serve.tool_formats.values import _resolve, json_type, types_of, write_value
from mlxlis.tokenizer import Tokenizer

_TAG = re.compile(r"<[^<>\s]{1,40}>|\[[A-Z_]{2,20}\]")
_META = set('\\.+*?()|[]{}^$#&-~/"')
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_PYTHON = ("python-scalars", "python", "cdata")  # styles that write True / None
ID = "/[a-zA-Z0-9]{9}/"  # a call id of the model's: Mistral's templates take no other
INDEX = "/[0-9]{1,3}/"
G4_DEPTH = 6  # Gemma 4 values nested deeper than this: any value of its syntax


def _texts(fmt: ToolFormat) -> list[str]:
    return [fmt.open, fmt.close or "", fmt.block, fmt.call, fmt.arg, fmt.sep, fmt.between]


@functools.cache
def format_tags() -> frozenset[str]:
    """Every tag-looking piece of every format's text (and Gemma 4's quote)."""
    out = {Q, "<|python_tag|>"}
    for fmt in TABLE:
        for text in _texts(fmt):
            out.update(_TAG.findall(FIELD.sub(" ", text)))
    return frozenset(out)


def one_token(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, special=True, add_bos=False, add_eos=False)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == text else None


def tag_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The call tags of every format that are single tokens: special to the grammar engine,
    so that free text never writes them (only a call's grammar does, by id)."""
    return tuple(sorted({i for t in format_tags() if (i := one_token(tokenizer, t)) is not None}))


def _rx(text: str) -> str:
    """`text` as a literal inside /…/."""
    return "".join("\\" + c if c in _META else {"\n": "\\n", "\t": "\\t"}.get(c, c) for c in text)


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


class Lark:
    """The rules of one format's grammar, gathered as they are made."""

    def __init__(self, fmt: ToolFormat, tokenizer: Tokenizer) -> None:
        self.fmt = fmt
        texts = _texts(fmt) + [Q]
        tags = {
            s: i for s, i in tokenizer.special_tokens.items() if s and any(s in t for t in texts)
        }
        for tag in format_tags():
            if any(tag in t for t in texts) and (i := one_token(tokenizer, tag)) is not None:
                tags[tag] = i
        self.tags = tags
        alternation = "|".join(re.escape(t) for t in sorted(tags, key=len, reverse=True))
        self._split = re.compile(f"({alternation})") if tags else None
        self.lines: list[str] = []
        self._count = 0

    def text(self) -> str:
        return "".join(self.lines)

    def rule(self, body: str, options: str = "") -> str:
        self._count += 1
        self.lines.append(f"r{self._count}{options}: {body}\n")
        return f"r{self._count}"

    def terminal(self, body: str) -> str:
        self._count += 1
        self.lines.append(f"T{self._count}: {body}\n")
        return f"T{self._count}"

    def lit(self, text: str) -> str:
        """`text` as grammar items: its tags by token id, the rest as strings."""
        pieces = self._split.split(text) if self._split is not None else [text]
        out = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(f"<[{self.tags[piece]}]>")
            elif piece:
                out.append(json.dumps(piece, ensure_ascii=False))
        return " ".join(out)

    def plain_prefix(self, text: str) -> str:
        """The start of `text` before its first tag that is a token (text can end a value's
        terminal; a token cannot be inside one)."""
        return self._split.split(text)[0] if self._split is not None else text

    def template(self, text: str, fields: dict[str, str]) -> str:
        return _join(
            *(fields[p] if i % 2 else self.lit(p) for i, p in enumerate(FIELD.split(text)))
        )

    # ---------------------------------------------------------------- calls

    def calls(self, functions: list[tuple[str, dict]], parallel: bool) -> str:
        fmt = self.fmt
        call = self.rule(" | ".join(self.call(n, p) for n, p in functions))
        head, tail = fmt.block.split("{calls}")
        if fmt.single:
            block = self.rule(_join(self.lit(head), call, self.lit(tail)))
            more = f" ({_join(self.lit(fmt.between), block)})*" if parallel else ""
            return self.rule(block + more)
        more = f" ({_join(self.lit(fmt.sep), call)})*" if parallel else ""
        return self.rule(_join(self.lit(head), call + more, self.lit(tail)))

    def call(self, name: str, params: dict) -> str:
        fmt = self.fmt
        if fmt.object_layout is not None:
            return self.rule(f"%json {json.dumps(self._call_object(name, params))}")
        head, tail = fmt.call.split("{args}")
        fields = {"name": self.lit(name), "id": ID, "index": INDEX, "index1": INDEX}
        args = {
            "json": lambda: f"%json {json.dumps({'x-guidance': JSON_LAYOUT, **params})}",
            "xml": lambda: self.rows(params),
            "gemma4": lambda: self.g4(params, params, 0),
            "python": lambda: self.python_args(params),
        }[fmt.args]()
        return self.rule(_join(self.template(head, fields), args, self.template(tail, fields)))

    def _call_object(self, name: str, params: dict) -> dict:
        """One call as the JSON object the template writes, its keys in the template's order."""
        props: dict[str, Any] = {}
        for key, field in self.fmt.object_layout or ():
            if key == "{name}":  # Apertus: {"NAME": {arguments}}
                props[name] = params
            elif field == "name":
                props[key] = {"const": name}
            elif field == "args":
                props[key] = params
            elif field == "id":
                props[key] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
            elif field in ("index", "index1"):
                props[key] = {"type": "string", "pattern": "^[0-9]{1,3}$"}
        return {
            "x-guidance": JSON_LAYOUT,
            "type": "object",
            "properties": props,
            "required": list(props),
            "additionalProperties": False,
        }

    # ---------------------------------------------------------------- sequences

    def sequence(self, items: list[tuple[str, bool]], sep: str) -> str:
        """`items` (expression, required) in order, the optional ones optional, `sep` between
        those present."""
        if not sep:
            return _join(*(e if req else f"({e})?" for e, req in items))
        rests = [""] * (len(items) + 1)  # rests[k]: items k.., each after a separator
        for k in reversed(range(len(items))):
            expr, req = items[k]
            item = _join(self.lit(sep), expr)
            body = _join(item if req else f"({item})?", rests[k + 1])
            rests[k] = self.rule(body) if body else ""
        firsts = []
        for k, (expr, req) in enumerate(items):
            firsts.append(_join(expr, rests[k + 1]))
            if req:
                return " | ".join(f"({f})" for f in firsts)
        return f"({' | '.join(f'({f})' for f in firsts)})?" if firsts else ""

    @staticmethod
    def _properties(params: dict) -> tuple[list[tuple[str, Any]], set[str]]:
        schema = _resolve(params, params)
        props = schema.get("properties") if isinstance(schema, dict) else None
        required = schema.get("required") if isinstance(schema, dict) else None
        return list((props or {}).items()), set(required or ())

    @staticmethod
    def _kinds(prop: Any, root: Any) -> list[str]:
        kinds = types_of(prop, root)
        order = ("string", "integer", "number", "boolean", "null", "object", "array")
        return [k for k in order if k in kinds] if kinds else ["string"]

    # ---------------------------------------------------------------- XML rows

    def rows(self, params: dict) -> str:
        props, required = self._properties(params)
        items = [(self.row(k, p, params), k in required) for k, p in props]
        return self.sequence(items, "")

    def row(self, key: str, prop: Any, root: dict) -> str:
        before, after = self.fmt.arg.split("{value}")
        alternatives = []
        for kind in self._kinds(prop, root):
            fields = {
                "key": self.lit(key),
                "string": self.lit("true" if kind == "string" else "false"),
                "type": self.lit(json_type(_SAMPLE[kind])),  # Kimi K3: integers "number"
            }
            head = self.template(before, fields)
            if kind == "string":
                closing = self.plain_prefix(after)
                value = self.string(prop, root, closing)
                rest = self.template(after[len(closing) :], fields)
            else:
                value, rest = self.scalar(kind, prop, root), self.template(after, fields)
            alternatives.append(_join(head, value, rest))
        return self.rule(" | ".join(f"({a})" for a in alternatives))

    def string(self, prop: Any, root: Any, closing: str, opening: str = "", end: str = "") -> str:
        """A string value as text between `opening` and `closing`: within the schema's enum,
        lengths and anchored pattern, and without `end` (by default the first word of
        `closing`: the tag that ends it). Quotes and value are one terminal where they are
        text (the lexer is greedy), grammar items around it where they are tokens."""
        schema = _resolve(prop, root) if isinstance(prop, dict) else {}
        schema = schema if isinstance(schema, dict) else {}
        enum = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return self.rule(" | ".join(self.lit(opening + v + closing) for v in enum))
        end = end or (closing.split()[0] if closing.split() else "")
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        text = f"/(?s:.{{{low},{'' if high is None else high}}})/"
        if end:
            text += f" & ~/(?s:.*){_rx(end)}(?s:.*)/"
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$"):
            text += f" & /{pattern[1:-1].replace('/', chr(92) + '/')}/"
        value = self.terminal(text)
        if self.plain_prefix(opening + closing) != opening + closing:  # tokens around it
            return _join(self.lit(opening), value, self.lit(closing))
        quoted = [json.dumps(t, ensure_ascii=False) if t else "" for t in (opening, closing)]
        # lazy: the value ends at the first closing text, as the reader reads it (a greedy
        # lexeme of text and closing together panics llguidance 1.9 when a token follows)
        return self.rule(_join(quoted[0], value, quoted[1]), "[lazy]")

    def scalar(self, kind: str, prop: Any, root: Any) -> str:
        """A non-string value as the template writes it."""
        schema = _resolve(prop, root) if isinstance(prop, dict) else {}
        schema = schema if isinstance(schema, dict) else {}
        python = self.fmt.values in _PYTHON
        enum = [v for v in schema.get("enum") or () if _kind(v) in (kind, _WIDER.get(kind))]
        if enum:  # the values of this kind the schema allows, as the template writes them
            return self.rule(" | ".join(self.lit(write_value(v, self.fmt.values)) for v in enum))
        if kind == "boolean":
            return '("True" | "False")' if python else '("true" | "false")'
        if kind == "null":
            return '"None"' if python else '"null"'
        if kind in ("integer", "number"):
            bounds = {k: schema[k] for k in _NUMERIC if k in schema}
            return f"%json {json.dumps({'type': kind, **bounds})}"
        own = types_of(prop, root) == {kind}
        whole = {**{k: root[k] for k in ("$defs", "definitions") if k in root}, **schema}
        return (
            f"%json {json.dumps({'x-guidance': JSON_LAYOUT, **(whole if own else {'type': kind})})}"
        )

    # ---------------------------------------------------------------- Gemma 4, LFM2

    def g4(self, schema: Any, root: Any, depth: int) -> str:
        """A value in Gemma 4's syntax by its schema (keys sorted, as its template writes)."""
        schema = _resolve(schema, root)
        if depth > G4_DEPTH or not isinstance(schema, dict):
            return self.g4_any()
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rule(" | ".join(self.lit(write_g4(v)) for v in schema["enum"]))
        alternatives = []
        for kind in self._kinds(schema, root) if types_of(schema, root) else ["any"]:
            if kind == "string":
                alternatives.append(self.g4_string(schema, root))
            elif kind == "object" and schema.get("properties"):
                props, required = self._properties(schema)
                items = [
                    (_join(self.lit(k + ":"), self.g4(p, root, depth + 1)), k in required)
                    for k, p in sorted(props)
                ]
                alternatives.append(_join(self.lit("{"), self.sequence(items, ","), self.lit("}")))
            elif kind == "array" and isinstance(schema.get("items"), dict):
                item = self.g4(schema["items"], root, depth + 1)
                alternatives.append(
                    _join(self.lit("["), f"({item} ({self.lit(',')} {item})*)?", self.lit("]"))
                )
            elif kind in ("integer", "number", "boolean"):
                alternatives.append(self.scalar(kind, schema, root))
            elif kind == "null":
                alternatives.append(self.lit("None"))  # Jinja prints None so
            else:
                alternatives.append(self.g4_any())
        return self.rule(" | ".join(f"({a})" for a in alternatives))

    def g4_string(self, schema: Any = None, root: Any = None) -> str:
        return self.string(schema, root, Q, opening=Q, end=Q)

    def g4_any(self) -> str:
        """Any value of Gemma 4's syntax (one rule, made once)."""
        if "g4any: " not in self.text():
            string, number = self.g4_string(), '%json {"type": "number"}'
            key = self.terminal("/[A-Za-z_][A-Za-z0-9_]*/")
            pair = f"{key} {self.lit(':')} g4any"
            comma = self.lit(",")
            self.lines.append(
                f'g4any: {string} | {number} | "true" | "false" | "None" | "null"'
                f" | {self.lit('{')} ({pair} ({comma} {pair})*)? {self.lit('}')}"
                f" | {self.lit('[')} (g4any ({comma} g4any)*)? {self.lit(']')}\n"
            )
        return "g4any"

    def python_args(self, params: dict) -> str:
        """LFM2's `key=value, …`: strings in single quotes (as its template writes them, no
        quote inside), objects and arrays JSON, True / False / None."""
        props, required = self._properties(params)
        items = []
        for key, prop in props:
            kinds = self._kinds(prop, params)
            values = [
                self.string(prop, params, "'", opening="'", end="'")
                if k == "string"
                else self.scalar(k, prop, params)
                for k in kinds
            ]
            value = self.rule(" | ".join(f"({v})" for v in values))
            items.append((_join(self.lit(f"{key}="), value), key in required))
        return self.sequence(items, ", ")


_WIDER = {"number": "integer"}  # an integer in an enum is a number too


def _kind(value: Any) -> str:
    """The JSON Schema type of a value (integers apart from numbers)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return "integer"
    return json_type(value)


_SAMPLE: dict[str, Any] = {
    "string": "",
    "integer": 0,
    "number": 0.5,
    "boolean": True,
    "null": None,
    "object": {},
    "array": [],
}


def lark_calls(
    fmt: ToolFormat, tokenizer: Tokenizer, functions: Iterable[tuple[str, dict]], parallel: bool
) -> tuple[str, str, str]:
    """(the rule of the calls, the grammar's other lines, the open tag as grammar items)."""
    lark = Lark(fmt, tokenizer)
    calls = lark.calls(list(functions), parallel)
    return calls, lark.text(), lark.lit(fmt.open)
