"""A call's arguments in the formats that do not write them as one JSON object: XML rows of
tags, Gemma 4's syntax, LFM2's Python call (lark.py builds the rest of the grammar)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Protocol

from mlxlis.generation.constraints import JSON_LAYOUT
from mlxlis.generation.tool_grammar.lexemes import Rules, Unsupported, join, pattern_rx, rx
from mlxlis.generation.tool_grammar.values import ORDER, Walk, allows, branches, narrow
from mlxlis.prompt.tool_formats import ToolFormat
from mlxlis.prompt.tool_formats.args import Q
from mlxlis.prompt.tool_formats.values import _resolve, json_type, types_of, write_value

_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_PYTHON = ("python-scalars", "python", "cdata")  # styles that write True / None


class Grammar(Rules, Protocol):
    """What the arguments need of the grammar they are written into (lark.Lark)."""

    fmt: ToolFormat

    def plain_prefix(self, text: str) -> str: ...
    def template(self, text: str, fields: dict[str, str]) -> str: ...


class Arguments:
    """The rules of one format's arguments, written into `lark`."""

    def __init__(self, lark: Grammar) -> None:
        self.lark = lark
        self._walks: dict[tuple[str, str], Walk] = {}

    @staticmethod
    def _properties(params: dict) -> tuple[list[tuple[str, Any]], set[str]]:
        schema = _resolve(params, params)
        props = schema.get("properties") if isinstance(schema, dict) else None
        required = schema.get("required") if isinstance(schema, dict) else None
        return list((props or {}).items()), set(required or ())

    @staticmethod
    def _kinds(prop: Any, root: Any) -> list[str]:
        """The types a property's value may have: its schema's, those of its enum's values
        where it has one (["string", "integer"] with the enum ["a"]: a string)."""
        kinds = types_of(prop, root)
        if not kinds:
            return ["string"]
        schema = _resolve(prop, root)
        enum = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(enum, list):
            kinds = {k for k in kinds if any(allows({k}, v) for v in enum)}
        return [k for k in ORDER if k in kinds]

    # ---------------------------------------------------------------- XML rows

    def rows(self, params: dict) -> str:
        props, required = self._properties(params)
        items = [(self.row(k, p, params), k in required) for k, p in props]
        return self.lark.sequence(items, "")

    def row(self, key: str, prop: Any, root: dict) -> str:
        before, after = self.lark.fmt.arg.split("{value}")
        closing = self.lark.plain_prefix(after)
        end = closing.split()[0] if closing.split() else ""
        kinds = self._kinds(prop, root)
        alternatives = []
        for kind in kinds:
            fields = {
                "key": self.lark.lit(key),
                "string": self.lark.lit("true" if kind == "string" else "false"),
                "type": self.lark.lit(json_type(_SAMPLE[kind])),  # Kimi K3: integers "number"
            }
            head = self.lark.template(before, fields)
            if kind == "string":
                value = self.row_string(prop, root, closing, kinds)
                rest = self.lark.template(after[len(closing) :], fields)
            else:
                value, rest = self.top(kind, prop, root, end), self.lark.template(after, fields)
            alternatives.append(join(head, value, rest))
        return self.lark.rule(" | ".join(f"({a})" for a in alternatives))

    def row_string(self, prop: Any, root: Any, closing: str, kinds: list[str]) -> str:
        """A string argument as the row's text: never text its reader takes for another type
        the property allows (`3` where it may be an integer), nor a CDATA section (read as
        the text inside)."""
        hinted = "{string}" in self.lark.fmt.arg or "{type}" in self.lark.fmt.arg
        extra = [] if hinted else [f"~/{_READS[k]}/" for k in kinds if k in _READS]
        extra.append(r"~/<!\[CDATA\[(?s:.*)\]\]>/")
        if self.lark.fmt.values != "cdata":
            return self.string(prop, root, closing, extra=extra)
        # MiniCPM5: text holding <, & or a newline in <![CDATA[…]]>, other text as it is
        schema = _resolve(prop, root) if isinstance(prop, dict) else {}
        enum = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(enum, list):
            texts = [write_value(v, "cdata") + closing for v in enum if isinstance(v, str)]
            return self.lark.rule(" | ".join(self.lark.lit(t) for t in texts) or '""')
        plain = self.string(prop, root, closing, extra=[*extra, r"/[^<&\n]*/"])
        end = closing.split()[0] if closing.split() else ""
        wrapped = self.string(
            prop, root, "]]>" + closing, "<![CDATA[", end, [r"/(?s:.*)[<&\n](?s:.*)/"]
        )
        return self.lark.rule(f"({plain}) | ({wrapped})")

    def string(
        self,
        prop: Any,
        root: Any,
        closing: str,
        opening: str = "",
        end: str = "",
        extra: Iterable[str] = (),
    ) -> str:
        """A string value as text between `opening` and `closing`: within the schema's enum,
        lengths and pattern, and without `end` (by default the first word of `closing`: the
        tag that ends it), held to the `extra` terminals too. Quotes and value are one
        terminal where they are text (the lexer is greedy), grammar items around it where
        they are tokens."""
        schemas = branches(narrow(prop, root, "string"), root) if isinstance(prop, dict) else [{}]
        if len(schemas) != 1:  # a union's string branches, each with its own bounds
            args = (root, closing, opening, end, extra)
            return self.lark.rule(" | ".join(f"({self.string(b, *args)})" for b in schemas) or '""')
        schema = schemas[0]
        enum = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(enum, list):  # its strings (the other values are other kinds' rows)
            texts = [opening + v + closing for v in enum if isinstance(v, str)]
            return self.lark.rule(" | ".join(self.lark.lit(t) for t in texts) or '""')
        end = end or (closing.split()[0] if closing.split() else "")
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        text = f"/(?s:.{{{low},{'' if high is None else high}}})/"
        if end:
            text += f" & ~/(?s:.*){rx(end)}(?s:.*)/"
        try:
            pattern = pattern_rx(schema.get("pattern"))
        except Unsupported:  # anchored inside: llguidance's %json holds it as its own regex
            pattern = None
        text += f" & /{pattern}/" if pattern is not None else ""
        text += "".join(f" & {x}" for x in extra)
        value = self.lark.terminal(text)
        if self.lark.plain_prefix(opening + closing) != opening + closing:  # tokens around it
            return join(self.lark.lit(opening), value, self.lark.lit(closing))
        quoted = [json.dumps(t, ensure_ascii=False) if t else "" for t in (opening, closing)]
        # lazy: the value ends at the first closing text, as the reader reads it (a greedy
        # lexeme of text and closing together panics llguidance 1.9 when a token follows)
        return self.lark.rule(join(quoted[0], value, quoted[1]), "[lazy]")

    def top(self, kind: str, prop: Any, root: Any, end: str = "") -> str:
        """A non-string argument as the format's writer writes it, by the property's schema
        held to `kind`; where the exact walk cannot hold the schema, `%json` (scalar)."""
        fmt = self.lark.fmt
        python = fmt.values in _PYTHON or fmt.args == "python"  # True / None
        if kind in ("object", "array"):  # Python's repr in Seed-OSS, MiniCPM5, LFM2's lists
            python = fmt.values in ("python", "cdata") or (fmt.args, kind) == ("python", "array")
        style = "python" if python else "json"
        walk = self._walks.setdefault((style, end), Walk(self.lark, style, end))
        schema = narrow(prop, root, kind) if isinstance(prop, dict) else {"type": kind}
        try:
            return walk.value(schema, root)
        except Unsupported:  # its rules may name ones never made: the next walk starts anew
            del self._walks[style, end]
            return self.scalar(kind, prop, root)

    def scalar(self, kind: str, prop: Any, root: Any) -> str:
        """A non-string value as llguidance's JSON writes it (valid by the schema, not always
        the template's bytes: `1.50`, `[1]` in a Python list's place)."""
        schema = _resolve(prop, root) if isinstance(prop, dict) else {}
        schema = schema if isinstance(schema, dict) else {}
        python = self.lark.fmt.values in _PYTHON or self.lark.fmt.args == "python"
        enum = [v for v in schema.get("enum") or () if allows({kind}, v)]
        if enum:  # the values of this kind the schema allows, as the template writes them
            return self.lark.rule(
                " | ".join(self.lark.lit(write_value(v, self.lark.fmt.values)) for v in enum)
            )
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

    def g4(self, params: dict) -> str:
        """Gemma 4's arguments: its own syntax (keys sorted, as its template writes them)."""
        walk = Walk(self.lark, self.lark.fmt.args, "", quoted=self.g4_string)  # its syntax
        return walk.value(params, params)

    def g4_string(self, schema: Any = None) -> str:
        return self.string(schema, None, Q, opening=Q, end=Q)

    def python_args(self, params: dict) -> str:
        """LFM2's `key=value, …`: strings in single quotes (as its template writes them: as
        they are, so no quote inside), objects `tojson`, lists Python's repr, True / None."""
        props, required = self._properties(params)
        items = []
        for key, prop in props:
            kinds = self._kinds(prop, params)
            values = [
                self.string(prop, params, "'", opening="'", end="'")
                if k == "string"
                else self.top(k, prop, params)
                for k in kinds
            ]
            value = self.lark.rule(" | ".join(f"({v})" for v in values))
            items.append((join(self.lark.lit(f"{key}="), value), key in required))
        return self.lark.sequence(items, ", ")


# an XML row's text its reader takes for a value of each type (values.read_value; Python's
# strip() takes \x1c-\x1f for whitespace too)
_WS = r"[\s\x1c-\x1f]*"
_READS = {
    "null": rf"{_WS}(null|None){_WS}",
    "boolean": rf"{_WS}(true|false|True|False){_WS}",
    "integer": rf"{_WS}-?(0|[1-9][0-9]*){_WS}",
    "number": rf"{_WS}-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?{_WS}",
    "object": rf"{_WS}\{{(?s:.*)",
    "array": rf"{_WS}\[(?s:.*)",
}


_SAMPLE: dict[str, Any] = {
    "string": "",
    "integer": 0,
    "number": 0.5,
    "boolean": True,
    "null": None,
    "object": {},
    "array": [],
}
