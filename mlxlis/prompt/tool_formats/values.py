"""One argument's value in the formats that write arguments as text, not as a JSON object.

XML-parameter formats (Qwen3-Coder, GLM, MiniMax-M2, DeepSeek's DSML, Kimi K3, …) write each
argument between tags with no quotes to say what it is: `3` may be the number 3 or the string
"3". The tool's schema says which: `read_value` turns the text into the value its property's
type asks for (a string stays the exact text, even one that looks like a number), and a tag's
own hint wins where a format writes one (DeepSeek's `string="true|false"`, Kimi K3's
`type="…"`). How a template writes each type (`write_value`'s styles), as the templates do:

- json            — strings as they are, everything else `tojson` (GLM, MiniMax-M2, DSML, Hy3)
- python-scalars  — strings as they are, objects and arrays `tojson`, other values Jinja's
                    `|string` (True, None: Qwen3-Coder, Qwen3.5, Nemotron 3)
- python          — strings as they are, everything else `|string` (Python's repr of a dict
                    or a list: Seed-OSS)
- cdata           — `python`, a string holding <, & or a newline inside <![CDATA[…]]> (MiniCPM5)

Reading accepts both spellings (JSON's and Python's literals) whatever the style: a model
trained on one writes the other now and then, and either means the same value.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

STYLES = ("json", "python-scalars", "python", "cdata")
# ASCII digits (\d takes any script's: "١٢" would read as 12, and be written "12")
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WORDS = {"true": True, "false": False, "True": True, "False": False, "null": None, "None": None}
_CDATA = ("<![CDATA[", "]]>")
# the JSON type names a value of a Python type has (bool before int: bool is an int)
_TYPE_OF = ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"))


def json_type(value: Any) -> str:
    """The JSON type name of `value` as Kimi K3's template writes it (integers are "number")."""
    if value is None:
        return "null"
    for kind, name in _TYPE_OF:
        if isinstance(value, kind):
            return name
    return "object" if isinstance(value, Mapping) else "array"


def _python(value: Any) -> str:
    """Jinja's `|string`: Python's str() (True, None, {'k': 'v'})."""
    return str(value)


def write_value(value: Any, style: str) -> str:
    """`value` as a template of `style` writes it between its tags."""
    if isinstance(value, str):
        if style == "cdata" and any(c in value for c in "<&\n"):
            return _CDATA[0] + value + _CDATA[1]
        return value
    if style == "json" or (style == "python-scalars" and isinstance(value, (dict, list))):
        return json.dumps(value, ensure_ascii=False)
    return _python(value)


def literal(text: str) -> Any:
    """A JSON value, or Python's literal of one (True, None, {'k': 1}); ValueError if neither.
    ast.literal_eval evaluates no code; nesting past its reach raises RecursionError, which
    the format's reader turns into "no call"."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, TypeError, MemoryError) as e:
        raise ValueError(f"not a literal: {e}") from None
    if isinstance(value, tuple | set | bytes | complex):  # Python-only kinds: no JSON value
        raise ValueError("not a JSON literal")
    return value


def _resolve(schema: Any, root: Any, depth: int = 0) -> Any:
    """A local `$ref` ("#/$defs/X", "#/definitions/X") followed within the tool's schema."""
    while isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str) and depth < 16:
        node: Any = root
        for part in schema["$ref"].removeprefix("#").strip("/").split("/"):
            if not part:
                continue
            node = node.get(part) if isinstance(node, Mapping) else None
        schema, depth = node, depth + 1
    return schema


def types_of(schema: Any, root: Any = None, depth: int = 0) -> set[str] | None:
    """The JSON types a schema allows, or None when it does not say (no schema, `{}`)."""
    schema = _resolve(schema, root if root is not None else schema)
    if not isinstance(schema, Mapping) or depth > 16:
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    found: set[str] = set()
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            sub_types = types_of(sub, root if root is not None else schema, depth + 1)
            if sub_types is None:
                return None
            found |= sub_types
    if "enum" in schema or "const" in schema:
        values = schema.get("enum") if "enum" in schema else [schema.get("const")]
        found |= {json_type(v) for v in values or ()}
    if not found and "properties" in schema:
        found = {"object"}
    if not found and "items" in schema:
        found = {"array"}
    return found or None


def property_schema(parameters: Any, key: str) -> Any:
    """The schema of argument `key` among a tool's `parameters` (None when it has none)."""
    params = _resolve(parameters, parameters)
    props = params.get("properties") if isinstance(params, Mapping) else None
    return props.get(key) if isinstance(props, Mapping) else None


def _typed(text: str, kind: str) -> tuple[bool, Any]:
    """(True, the value) when `text` is a lexeme of JSON type `kind`, else (False, None)."""
    word = text.strip()
    if kind == "integer" and _INT.fullmatch(word):
        return True, int(word)
    if kind == "number" and _NUMBER.fullmatch(word):
        return True, json.loads(word)
    if kind == "boolean" and word in _WORDS and isinstance(_WORDS[word], bool):
        return True, _WORDS[word]
    if kind == "null" and word in _WORDS and _WORDS[word] is None:
        return True, None
    if kind in ("object", "array") and word[:1] in "{[":
        try:
            value = literal(word)
        except ValueError:
            return False, None
        if isinstance(value, dict if kind == "object" else list):
            return True, value
    return False, None


def read_value(text: str, schema: Any, root: Any = None, hint: str | None = None) -> Any:
    """The value of an argument written as `text`, by its property's `schema` (within the
    tool's parameters `root`) or the format's own `hint` ("string" / another JSON type name).
    A string parameter is the text exactly; a value of no type its schema allows stays the
    text the model wrote (the client sees what came, as with a JSON format's wrong type)."""
    if text.startswith(_CDATA[0]) and text.endswith(_CDATA[1]):
        return text[len(_CDATA[0]) : -len(_CDATA[1])]
    if hint == "string":
        return text
    kinds = {hint} if hint else types_of(schema, root)
    if kinds is None:  # no schema for it: a JSON value if it reads as one, else the text
        try:
            return literal(text.strip())
        except ValueError:
            return text
    for kind in ("null", "boolean", "integer", "number", "object", "array"):
        if kind not in kinds:
            continue
        ok, value = _typed(text, kind)
        if ok:
            return value
    return text
