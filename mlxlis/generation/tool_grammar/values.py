"""A forced argument's value as the template writes it, by its schema: the exact text of the
format's writer (tool_formats/values.py, args.py), so that the next turn's prompt, which
renders the past call again, repeats what the model wrote byte for byte (the prefix cache
matches, and the model reads its own text).

Three syntaxes of nested values, as the templates print them:

- "json": `tojson` (json.dumps, non-ASCII kept): "strings" with JSON's escapes, true / false /
  null (GLM's, MiniMax-M2's, DSML's, Qwen3-Coder's objects and arrays; LFM2's objects);
- "python": Jinja's `|string` of a list or a dict, Python's repr (Seed-OSS, MiniCPM5, LFM2's
  lists): 'strings' quoted and escaped as repr does (double quotes for one holding ' and no
  "), True / False / None;
- "gemma4": Gemma 4's own, `{key:<|"|>text<|"|>,n:[1,true,None]}`, its keys sorted.

Numbers and strings are the lexemes of lexemes.py. Objects hold the properties the
schema lists, in its order (the writer keeps the order it reads); arrays their items within
minItems and maxItems; unions (type lists, anyOf, oneOf whose branches' types are apart) each
branch; a recursive schema ($ref to itself) a rule that names itself.

A keyword the walk does not hold (allOf, multipleOf, uniqueItems…) raises Unsupported: the
caller writes that argument as llguidance's `%json` of its schema instead (valid, not the
template's bytes); Gemma 4's, which has no JSON to fall back on, any value of its syntax there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxlis.generation.tool_grammar.lexemes import Rules, Unsupported, number, string
from mlxlis.prompt.tool_formats.args import write_g4
from mlxlis.prompt.tool_formats.values import _resolve, types_of

ORDER = ("string", "integer", "number", "boolean", "null", "object", "array")
IGNORED = {  # keywords that say nothing about which values are valid
    *("title", "description", "default", "examples", "$schema", "$id", "$comment", "format"),
    *("deprecated", "readOnly", "writeOnly", "$defs", "definitions"),
    *("contentMediaType", "contentEncoding"),
}
HELD = {
    *("type", "enum", "const", "$ref", "anyOf", "oneOf", "properties", "required"),
    *("additionalProperties", "items", "minItems", "maxItems", "minLength", "maxLength"),
    *("pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
}
DEPTH = 24  # schemas nested deeper (through $ref chains that change): %json instead


def repeat(item: str, sep: str, schema: dict) -> str:
    """An array's items, `sep` between them, as many as its minItems and maxItems allow."""
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if high == 0:
        return ""
    inner = f"{item} ({sep} {item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
    return inner if low else f"({inner})?"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # tojson


def _python(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)  # |string, inside a list


def kind_of(value: Any) -> str:
    """A value's JSON Schema type (integers apart from numbers)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "")


def allows(kinds: set[str] | None, value: Any) -> bool:
    """Whether a value is of one of `kinds` (None: any); an integer is a number too."""
    k = kind_of(value)
    return kinds is None or k in kinds or (k == "integer" and "number" in kinds)


def narrow(schema: Any, root: Any, kind: str) -> Any:
    """`schema` held to one JSON type (the branches of a union that allow it)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return schema
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            kept = [
                narrow(b, root, kind)
                for b in schema[key]
                if (t := types_of(b, root)) is None or kind in t
            ]
            return {**schema, key: kept}
    out = {**schema, "type": kind}
    if isinstance(schema.get("enum"), list):
        out["enum"] = [v for v in schema["enum"] if allows({kind}, v)]
    return out


def branches(schema: Any, root: Any) -> list[dict]:
    """The plain schemas a union (anyOf, oneOf, nested) is made of; `schema` alone if none."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return [{}] if schema is True else []
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [b for sub in schema[key] for b in branches(sub, root)]
    return [schema]


@dataclass(frozen=True)
class Syntax:
    """How one syntax writes what is not a string."""

    words: tuple[str, str, str]  # true, false, null
    comma: str  # between items
    colon: str  # between a key and its value
    key: Callable[[str], str]
    write: Callable[[Any], str]  # an enum's value
    sort: bool = False  # keys in sorted order (Gemma 4's template sorts them)


SYNTAXES = {
    "json": Syntax(("true", "false", "null"), ", ", ": ", _json, _json),
    "python": Syntax(("True", "False", "None"), ", ", ": ", repr, _python),
    "gemma4": Syntax(("true", "false", "None"), ",", ":", str, write_g4, sort=True),
}
G4_KEY = "/[A-Za-z_][A-Za-z0-9_]*/"  # a key of a map Gemma 4 writes bare


class Walk:
    """Values of one syntax (`style`) inside one argument, without `end` in any string.
    Gemma 4's strings come from `quoted` (its quote may be a token), and where a keyword is
    not held it writes any value of its syntax (it has no JSON to fall back on)."""

    def __init__(
        self,
        rules: Rules,
        style: str,
        end: str,
        quoted: Callable[[dict], str] | None = None,
    ) -> None:
        self.rules, self.style, self.end, self.quoted = rules, style, end, quoted
        self.syntax = SYNTAXES[style]
        self._made: dict[str, str] = {}
        self._any = ""

    def value(self, schema: Any, root: Any, depth: int = 0) -> str:
        schema = _resolve(schema, root)
        if schema is True or (isinstance(schema, dict) and _only_notes(schema)):
            return self.any()
        try:
            if not isinstance(schema, dict) or depth > DEPTH:
                raise Unsupported("a schema nested too deep, or false")
            unknown = {k for k in schema if k not in HELD | IGNORED and not k.startswith("x-")}
            if unknown:
                raise Unsupported(", ".join(sorted(unknown)))
        except Unsupported:
            if self.quoted is None:
                raise
            return self.any()
        key = f"{id(root)} {json.dumps(schema, sort_keys=True, default=str)}"
        if key not in self._made:  # named first: a recursive schema refers to itself
            name = self._made[key] = self.rules.reserve()
            try:
                body = self._body(schema, root, depth)
            except Unsupported:
                if self.quoted is None:
                    raise
                body = self.any()
            self.rules.define(name, body)
        return self._made[key]

    def _body(self, schema: dict, root: Any, depth: int) -> str:
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if set(schema) & HELD - {key} or not isinstance(options, list) or not options:
                    raise Unsupported(f"{key} beside other keywords")
                if key == "oneOf":
                    _disjoint(options, root)
                return " | ".join(f"({self.value(b, root, depth + 1)})" for b in options)
        kinds = types_of(schema, root)
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            texts = [self.syntax.write(v) for v in values if allows(kinds, v)]
            texts = [t for t in texts if not self.end or self.end not in t]
            if not texts:
                raise Unsupported("no value of the enum can be written")
            return " | ".join(f"({self.rules.lit(t)})" for t in texts)
        if kinds is None:  # no type, and keywords that hold some types: not any value
            raise Unsupported("bounds without a type")
        return " | ".join(f"({self._kind(k, schema, root, depth)})" for k in ORDER if k in kinds)

    def _kind(self, kind: str, schema: dict, root: Any, depth: int) -> str:
        true, false, null = self.syntax.words
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            return number(self.rules, kind, schema)
        if kind == "boolean":
            return f'"{true}" | "{false}"'
        if kind == "null":
            return f'"{null}"'
        if kind == "array":
            items = schema.get("items", True)
            inner = "" if items is False else self.value(items, root, depth + 1)
            return f'"[" {repeat(inner, self._comma, schema) if inner else ""} "]"'
        return self._object(schema, root, depth)

    @property
    def _comma(self) -> str:
        return json.dumps(self.syntax.comma)

    def _string(self, schema: dict) -> str:
        if self.quoted is not None:
            return self.quoted(schema)
        return string(self.rules, self.style, schema, self.end)

    def _object(self, schema: dict, root: Any, depth: int) -> str:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        if required - set(props):
            raise Unsupported("a required key without its schema")
        colon = json.dumps(self.syntax.colon)
        if not props:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return '"{}"'
            pair = f"{self._key()} {colon} {self.value(extra, root, depth + 1)}"
            return f'"{{" ({pair} ({self._comma} {pair})*)? "}}"'
        keys = sorted(props) if self.syntax.sort else list(props)
        items = [
            (
                f"{self.rules.lit(self.syntax.key(k) + self.syntax.colon)} "
                f"{self.value(props[k], root, depth + 1)}",
                k in required,
            )
            for k in keys
        ]
        return f'"{{" {self.rules.sequence(items, self.syntax.comma)} "}}"'

    def _key(self) -> str:
        return self.rules.terminal(G4_KEY) if self.quoted is not None else self._string({})

    def any(self) -> str:
        """Any value of the syntax (one rule, made once)."""
        if not self._any:
            self._any = name = self.rules.reserve()
            true, false, null = self.syntax.words
            text, num = self._string({}), number(self.rules, "number", {})
            pair = f"{self._key()} {json.dumps(self.syntax.colon)} {name}"
            comma = self._comma
            self.rules.define(
                name,
                f'{text} | {num} | "{true}" | "{false}" | "{null}"'
                f' | "[" ({name} ({comma} {name})*)? "]" | "{{" ({pair} ({comma} {pair})*)? "}}"',
            )
        return self._any


def _only_notes(schema: dict) -> bool:
    return all(k in IGNORED or k.startswith("x-") for k in schema)


def _disjoint(options: list, root: Any) -> None:
    """oneOf held as anyOf: only where no value can match two branches (their types apart)."""
    seen: set[str] = set()
    for b in options:
        kinds = types_of(b, root)
        if kinds is None:
            raise Unsupported("oneOf with a branch of any type")
        kinds = kinds | ({"integer"} if "number" in kinds else set())
        if kinds & seen:
            raise Unsupported("oneOf whose branches share a type")
        seen |= kinds
