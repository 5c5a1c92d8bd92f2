"""Tool calls enforced token by token: a grammar (llguidance's Lark, with each call's JSON
embedded as `%json` schemas) for the call syntax the model's template teaches (tool_formats.py),
the arguments held to each tool's `parameters`.

- `tool_choice` "required" or a named function: the whole reply is one or more calls (of that
  function);
- "auto" with tools marked `"strict": true`: the reply is free text, or calls whose arguments
  follow the schemas (tags written as the model's single special tokens, which free text can
  never produce, so text and calls cannot be confused).

What a template's syntax cannot hold this way is refused (a 400 naming the field): Gemma 4's
calls are not JSON, and a format without a call tag (Llama 3's bare JSON object) cannot tell a
strict call from free text under "auto", nor gpt-oss's (harmony) whose calls follow its
reasoning. Each tool's parameters are checked on their own first (the bounds and refusals of
a response_format's schema, named by `tools[i].function.parameters`): a ParametersError.
"""

from __future__ import annotations

import json
from typing import Any

from mlxlis.generation.constraints import JSON_LAYOUT, ConstraintError, check_json_schema
from mlxlis.serve.tool_formats import ToolFormat
from mlxlis.tokenizer import Tokenizer

ID_SCHEMA = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}  # Mistral's 9-character call ids


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


def _call_schema(functions: list[tuple[str, dict]], key: str, with_id: bool = False) -> dict:
    """One call object of any of `functions`: {"name": const, key: its parameters}."""
    options = []
    for name, params in functions:
        props: dict[str, Any] = {"name": {"const": name}, key: params}
        if with_id:
            props["id"] = ID_SCHEMA
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
    more = ' ("\\n" call)*' if parallel else ""
    if fmt.name == "gemma4":
        raise ConstraintError(
            "Gemma 4's tool-call syntax is not JSON: its arguments cannot be held to a schema",
            field="tools",
        )
    if fmt.name == "json" and not required:
        raise ConstraintError(
            "a template without a call tag cannot tell a strict call "
            'from free text under tool_choice "auto"',
            field="tools",
        )
    if fmt.name == "harmony" and not required:  # one call a reply: its <|call|> ends it
        raise ConstraintError(
            'gpt-oss\'s strict calls under tool_choice "auto" cannot be enforced: its '
            "reply reasons first and may call at any message",
            field="tools",
        )
    functions = _functions(tools, name)
    if fmt.name == "json":  # the reply is the call object itself
        key = "parameters" if '"parameters"' in fmt.forced("x") else "arguments"
        return f"start: %json {json.dumps(_call_schema(functions, key))}\n"
    if fmt.name == "hermes":
        open_, close = _tag(tokenizer, "<tool_call>"), _tag(tokenizer, "</tool_call>")
        schema = json.dumps(_call_schema(functions, "arguments"))
        calls = f'calls: call{more}\ncall: {open_} "\\n" body "\\n" {close}\n'
        calls += f"body: %json {schema}\n"
    elif fmt.name.startswith("mistral"):
        open_ = _tag(tokenizer, "[TOOL_CALLS]")
        if fmt.forced(None).endswith("["):  # the JSON-list generation, with call ids
            schema = {
                "type": "array",
                "minItems": 1,
                "maxItems": 64 if parallel else 1,
                "items": _call_schema(functions, "arguments", with_id=True),
            }
            calls = f"calls: {open_} body\nbody: %json {json.dumps(schema)}\n"
        else:  # `name[ARGS]{…}` per call
            call_id = ""  # Mistral Small 3.2 writes an id of 9 letters and digits first
            if "[CALL_ID]" in fmt.call:
                call_id = f"{_tag(tokenizer, '[CALL_ID]')} /[a-zA-Z0-9]{{9}}/ "
            rules = [
                f"{open_} {json.dumps(n)} {call_id}{_tag(tokenizer, '[ARGS]')} args{i}"
                for i, (n, _) in enumerate(functions)
            ]
            calls = f"calls: call{'+' if parallel else ''}\ncall: " + " | ".join(rules) + "\n"
            calls += "".join(
                f"args{i}: %json {json.dumps(p)}\n" for i, (_, p) in enumerate(functions)
            )
    elif fmt.name == "harmony":
        ch, msg = _tag(tokenizer, "<|channel|>"), _tag(tokenizer, "<|message|>")
        rules = [
            f"{ch} {json.dumps(f'commentary to=functions.{n} ')} "
            f'{_tag(tokenizer, "<|constrain|>")} "json" {msg} args{i} '
            f"{_tag(tokenizer, '<|call|>')}"
            for i, (n, _) in enumerate(functions)
        ]
        calls = "calls: " + " | ".join(rules) + "\n"
        calls += "".join(f"args{i}: %json {json.dumps(p)}\n" for i, (_, p) in enumerate(functions))
    else:
        raise ConstraintError(f"no grammar for the {fmt.name!r} tool-call format", field="tools")
    if required:
        return "start: calls\n" + calls
    if not open_.startswith("<["):
        raise ConstraintError(
            f"the call tag {fmt.open!r} is not one token of this vocabulary: "
            "free text could spell it",
            field="tools",
        )
    # free text: any text, which cannot hold the call tag (a special token to the engine)
    return "start: calls | TEXT\nTEXT: /(?s:.+)/\n" + calls


TAGS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>")


def tag_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The call tags that are single tokens: special to the grammar engine, so a free reply
    never writes them (only a call's grammar, by id)."""
    out = []
    for text in TAGS:
        ids = tokenizer.encode(text, special=True, add_bos=False, add_eos=False)
        if len(ids) == 1 and tokenizer.decode(ids) == text:
            out.append(ids[0])
    return tuple(out)
