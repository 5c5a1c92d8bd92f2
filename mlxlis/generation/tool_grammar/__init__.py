"""Tool calls enforced token by token: a grammar (llguidance's Lark, with each call's JSON
embedded as `%json` schemas) for the call syntax the model's template teaches (tool_formats/),
the arguments held to each tool's `parameters`.

- `tool_choice` "required" or a named function: the whole reply is one or more calls (of that
  function);
- "auto" with tools marked `"strict": true`: the reply is free text, or calls whose arguments
  follow the schemas (tags written as the model's single special tokens, which free text can
  never produce, so text and calls cannot be confused).

Every format of prompt/tool_formats/ is held in its own syntax (lark.py builds the grammar from
its definition); what a template's syntax cannot hold is refused (a 400 naming the field): a
format without a call tag (Llama 3's bare JSON object) cannot tell a strict call from free
text under "auto", nor can gpt-oss's (harmony), whose calls follow its reasoning, nor a format
whose call tag is no single token of the vocabulary. Each tool's parameters are checked on
their own first (the bounds and refusals of a response_format's schema, named by
`tools[i].function.parameters`): a ParametersError.
"""

from __future__ import annotations

import json
from typing import Any

from mlxlis.generation.constraints import JSON_LAYOUT, ConstraintError, check_json_schema
from mlxlis.generation.tool_grammar.lark import lark_calls
from mlxlis.generation.tool_grammar.lark import tag_ids as tag_ids
from mlxlis.prompt.tool_formats import HARMONY, ToolFormat
from mlxlis.tokenizer import Tokenizer


class ParametersError(ConstraintError):
    """A tool's parameters the engine cannot hold: a 400 whatever the tool_choice (a call
    syntax the grammar cannot hold may instead leave a forced call unconstrained)."""


def _functions(tools: list[dict[str, Any]], name: str | None) -> list[tuple[str, dict]]:
    """(name, parameters) of the tools a call may name, each schema checked (named by its
    place in `tools`)."""
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") or {}
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters", {"type": "object"})
        try:
            check_json_schema(params, f"tools[{i}].function.parameters")
        except ConstraintError as e:
            raise ParametersError(e.message, field=e.field) from None
        # its own resource: the `$ref`s inside ("#", "#/$defs/…") resolve against the
        # parameters, not the call object they are embedded in, and each tool's $defs stay
        # apart from another's of the same name
        if not isinstance(params.get("$id"), str):
            params = {**params, "$id": f"urn:mlxlis:tools:{i}"}
        out.append((fn["name"], params))
    return out


def _call_schema(functions: list[tuple[str, dict]], key: str) -> dict:
    """One call object of any of `functions`: {"name": const, key: its parameters}."""
    options = []
    for name, params in functions:
        props: dict[str, Any] = {"name": {"const": name}, key: params}
        options.append(
            {
                "type": "object",
                "properties": props,
                "required": list(props),
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"x-guidance": JSON_LAYOUT, **schema}  # one line, as the schemas of response_format


def _tag(tokenizer: Tokenizer, text: str) -> str:
    """A tag as the grammar writes it: the model's single token by id, else the literal."""
    ids = tokenizer.encode(text, special=True, add_bos=False, add_eos=False)
    if len(ids) == 1 and tokenizer.decode(ids) == text:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def tool_grammar(
    fmt: ToolFormat,
    tools: list[dict[str, Any]],
    tokenizer: Tokenizer,
    name: str | None,
    required: bool,
    parallel: bool = False,
) -> str:
    """Lark for the reply: calls only (`required`), or free text or calls; `name`: only that
    function may be called; one call unless `parallel` (a small model asked for a call with
    room for more writes the same call again until max_tokens)."""
    if fmt.reader is not None and not required:  # bare JSON
        raise ConstraintError(
            "a template without a call tag cannot tell a strict call "
            'from free text under tool_choice "auto"',
            field="tools",
        )
    if fmt is HARMONY and not required:  # one call a reply: its <|call|> ends it
        raise ConstraintError(
            'gpt-oss\'s strict calls under tool_choice "auto" cannot be enforced: its '
            "reply reasons first and may call at any message",
            field="tools",
        )
    functions = _functions(tools, name)
    if fmt.reader is not None:  # the reply is the call object itself
        key = "parameters" if '"parameters"' in fmt.forced("x") else "arguments"
        return f"start: %json {json.dumps(_call_schema(functions, key))}\n"
    if fmt is HARMONY:  # the header the model writes, not the canonical text it is read as
        ch, msg = _tag(tokenizer, "<|channel|>"), _tag(tokenizer, "<|message|>")
        rules = [
            f"{ch} {json.dumps(f'commentary to=functions.{n} ')} "
            f'{_tag(tokenizer, "<|constrain|>")} "json" {msg} args{i} '
            f"{_tag(tokenizer, '<|call|>')}"
            for i, (n, _) in enumerate(functions)
        ]
        calls = "calls: " + " | ".join(rules) + "\n"
        calls += "".join(
            f"args{i}: %json {json.dumps({'x-guidance': JSON_LAYOUT, **p})}\n"
            for i, (_, p) in enumerate(functions)
        )
        return "start: calls\n" + calls
    calls, lines, opener = lark_calls(fmt, tokenizer, functions, parallel)
    if required:
        return f"start: {calls}\n" + lines
    if not opener.startswith("<["):
        raise ConstraintError(
            f"the call tag {fmt.open!r} is not one token of this vocabulary: "
            "free text could spell it",
            field="tools",
        )
    # free text: any text, which cannot hold the call tag (a special token to the engine)
    return f"start: {calls} | TEXT\nTEXT: /(?s:.+)/\n" + lines
