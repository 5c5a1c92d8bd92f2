"""A tool-call format's calls as an llguidance Lark grammar, built from its definition
(tool_formats/base.py) and the offered tools' schemas: the model's own syntax, token by token.

- The template's text is written as it writes it; a piece of it that is one token of the
  model's vocabulary (a special token, or a call tag) is named by id (`<[id]>`), the rest is
  text.
- A call written as a JSON object, or arguments written as one, is `%json` of a schema: the
  call's keys in the template's order, the arguments by the tool's `parameters`.
- Arguments written otherwise (args.py): XML rows of tags, one per parameter in the
  order the schema lists them, the required ones always; Gemma 4's and LFM2's own syntaxes.
  A string row is any text that does not hold the tag that ends it (with its enum, length and
  pattern where the schema says them; MiniCPM5's in <![CDATA[…]]> where it holds <, & or a
  newline, as its template writes it; never text that would read back as another type the
  property allows); other values exactly as the format's writer writes them
  (values.py: numbers as repr writes them, within the schema's bounds; true /
  True; objects and arrays `tojson`, Python's repr in Seed-OSS, MiniCPM5 and LFM2's lists,
  Gemma 4's own syntax); the kind a tag says (DeepSeek's `string=`, Kimi K3's `type=`)
  follows the value's.

Where the walk of values.py holds the schema, what the format's reader reads back
from a text the grammar allows its writer writes again byte for byte: the next turn's prompt
renders the call as the model wrote it. `%json` (arguments written as one JSON object, and a
schema the walk does not hold) holds the schema, not the bytes: `1.50` reads as 1.5, written
`1.5`.

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
from mlxlis.generation.tool_grammar.args import Arguments
from mlxlis.generation.tool_grammar.lexemes import join
from mlxlis.prompt.tool_formats import TABLE, ToolFormat
from mlxlis.prompt.tool_formats.args import Q
from mlxlis.prompt.tool_formats.base import FIELD
from mlxlis.tokenizer import Tokenizer

_TAG = re.compile(r"<[^<>\s]{1,40}>|\[[A-Z_]{2,20}\]")
ID = "/[a-zA-Z0-9]{9}/"  # a call id of the model's: Mistral's templates take no other
INDEX = "/[0-9]{1,3}/"


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
        self.args = Arguments(self)

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

    def reserve(self) -> str:
        """A rule's name, its body defined later (a rule that refers to itself)."""
        self._count += 1
        return f"r{self._count}"

    def define(self, name: str, body: str) -> None:
        self.lines.append(f"{name}: {body}\n")

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
        return join(*(fields[p] if i % 2 else self.lit(p) for i, p in enumerate(FIELD.split(text))))

    # ---------------------------------------------------------------- calls

    def calls(self, functions: list[tuple[str, dict]], parallel: bool) -> str:
        fmt = self.fmt
        call = self.rule(" | ".join(self.call(n, p) for n, p in functions))
        head, tail = fmt.block.split("{calls}")
        if fmt.single:
            block = self.rule(join(self.lit(head), call, self.lit(tail)))
            more = f" ({join(self.lit(fmt.between), block)})*" if parallel else ""
            return self.rule(block + more)
        more = f" ({join(self.lit(fmt.sep), call)})*" if parallel else ""
        return self.rule(join(self.lit(head), call + more, self.lit(tail)))

    def call(self, name: str, params: dict) -> str:
        fmt = self.fmt
        if fmt.object_layout is not None:
            return self.rule(f"%json {json.dumps(self._call_object(name, params))}")
        head, tail = fmt.call.split("{args}")
        fields = {"name": self.lit(name), "id": ID, "index": INDEX, "index1": INDEX}
        args = {
            "json": lambda: f"%json {json.dumps({'x-guidance': JSON_LAYOUT, **params})}",
            "xml": lambda: self.args.rows(params),
            "gemma4": lambda: self.args.g4(params),
            "python": lambda: self.args.python_args(params),
        }[fmt.args]()
        return self.rule(join(self.template(head, fields), args, self.template(tail, fields)))

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
            return join(*(e if req else f"({e})?" for e, req in items))
        rests = [""] * (len(items) + 1)  # rests[k]: items k.., each after a separator
        for k in reversed(range(len(items))):
            expr, req = items[k]
            item = join(self.lit(sep), expr)
            body = join(item if req else f"({item})?", rests[k + 1])
            rests[k] = self.rule(body) if body else ""
        firsts = []
        for k, (expr, req) in enumerate(items):
            firsts.append(join(expr, rests[k + 1]))
            if req:  # one group: a neighbour must not bind to its last alternative alone
                return f"({' | '.join(f'({f})' for f in firsts)})"
        return f"({' | '.join(f'({f})' for f in firsts)})?" if firsts else ""


def lark_calls(
    fmt: ToolFormat, tokenizer: Tokenizer, functions: Iterable[tuple[str, dict]], parallel: bool
) -> tuple[str, str, str]:
    """(the rule of the calls, the grammar's other lines, the open tag as grammar items)."""
    lark = Lark(fmt, tokenizer)
    calls = lark.calls(list(functions), parallel)
    return calls, lark.text(), lark.lit(fmt.open)
