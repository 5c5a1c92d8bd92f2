"""Forced calls are written as the model's own template writes them, byte for byte, in the
formats whose values are not JSON: Seed-OSS's and MiniCPM5's Python reprs (XML parameters),
LFM2's Python call (`[f(city='Paris', tags=['a'])]`), Qwen3-Coder's True / None beside JSON
objects, Gemma 4's own syntax (generation/tool_grammar/values.py).

The next turn's prompt renders the call the model wrote through the template again: where the
forced text differs from the template's (a JSON `["a", true]` in a Python `['a', True]`'s
place), the prefix cache stops matching and the model reads text it never wrote. So, on
Qwen2.5-Coder's vocabulary and llguidance (as test_tool_forcing.py drives them):

1. the format's writer's text for arguments of every type (strings with quotes, newlines,
   non-ASCII, a string that looks like a number; integers, floats, booleans, null, arrays,
   nested and free objects) is allowed token by token, and the JSON spellings are not;
2. random calls the grammar allows read back (the server's call parser) to arguments valid by
   the schema (jsonschema), and the writer writes them back to the same text;
3. the vendors' templates of those families (llama.cpp's corpus) render the calls read back
   exactly as the grammar let the model write them.
"""

from __future__ import annotations

import json

import mlxlis
from mlxlis.generation.constraints import constraint
from mlxlis.generation.tool_grammar import tag_ids, tool_grammar
from mlxlis.prompt.template import ChatTemplate
from mlxlis.prompt.tool_calls import ToolCallParser, tool_schemas
from mlxlis.prompt.tool_formats import TABLE, template_match

import jsonschema
import pytest
from conftest import need_pulled
from test_tool_corpus import CORPUS, cut_at_turn_end, reply_of
from test_tool_forcing import walk

FORMATS = [f for f in TABLE if f.name in ("seed-oss", "minicpm", "lfm2", "qwen3-coder", "gemma4")]
IDS = [f.name for f in FORMATS]

S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def _object(props: dict, required: list | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


EVERY = _object(
    {
        "text": S,
        "digits": S,  # a string that reads as a number where the schema does not say string
        "count": I,
        "ratio": {"type": "number", "minimum": -2.5, "maximum": 10},
        "big": N,
        "tiny": N,
        "whole": N,
        "flag": {"type": "boolean"},
        "none": {"type": "null"},
        "maybe": {"type": ["integer", "null"]},
        "unit": {"enum": ["c", "f"]},
        "tags": {"type": "array", "items": S},
        "filter": _object(
            {
                "lang": S,
                "max": {"type": "array", "items": N},
                "deep": _object({"ok": {"type": "boolean"}, "none": {"type": "null"}, "k": S}),
            },
            ["lang"],
        ),
        "free": {"type": "object"},
    }
)
ARGS = {
    # LFM2 writes a string between single quotes as it is: no quote inside at the top
    "text": 'Paris "Rive Gauche"\n  naïve — ü <b> & \\',
    "digits": "42",
    "count": -7,
    "ratio": 2.5,
    "big": 1e20,
    "tiny": 1.5e-07,
    "whole": 3.0,
    "flag": True,
    "none": None,
    "maybe": None,
    "unit": "f",
    "tags": ["a b", "it's", 'say "hi"', "both ' and \"", "tab\there", "back\\", "日本"],
    "filter": {"lang": "fr", "max": [1, 2.5], "deep": {"ok": False, "none": None, "k": "x\ny"}},
    "free": {"a": [1, {"b": None, "c": "d"}], "e": True},
}
# the same calls spelled otherwise (JSON's words and strings, numbers repr never writes): refused
OTHERWISE = {
    "seed-oss": [("True", "true"), ("None", "null"), ("'a b'", '"a b"'), ("2.5", "2.50")],
    "minicpm": [("True", "true"), ("'b': None", "'b': null"), ("'fr'", '"fr"'), ("1e+20", "1e20")],
    "lfm2": [("True", "true"), ("none=None", "none=null"), ("'a b'", '"a b"')],
    "qwen3-coder": [("True", "true"), ('["a b"', "['a b'"), ("false", "False"), ("2.5", "2.50")],
    "gemma4": [("None", "null"), ("true", "True"), ("1.5e-07", "1.5e-7")],
}
# bounded, for random walks that end within their steps
BOUNDED = _object(
    {
        "text": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": -50, "maximum": 50},
        "ratio": {"type": "number", "minimum": -2.5, "exclusiveMaximum": 1000},
        "free": N,
        "flag": {"type": "boolean"},
        "none": {"type": "null"},
        "maybe": {"type": ["integer", "null", "string"], "maxLength": 3},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "nested": _object(
            {
                "k": {"type": "string", "maxLength": 3},
                "v": {"type": ["number", "boolean", "null"], "maximum": 9},
                "deep": {"type": "array", "items": {"$ref": "#/$defs/small"}, "maxItems": 2},
            },
            ["k"],
        ),
        "pick": {"anyOf": [{"enum": ["a'b", 1, None]}, {"type": "string", "maxLength": 2}]},
    }
)
BOUNDED["$defs"] = {"small": {"type": "integer", "minimum": 0, "maximum": 99}}
SEEDS = 6


def _tools(name: str, params: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": params}}]


@pytest.fixture(scope="module")
def tok():
    need_pulled("qwen2.5-coder-0.5b")
    return mlxlis.load_tokenizer("qwen2.5-coder-0.5b")


def _mask(fmt, tok, tools):
    stop = tok.special_tokens["<|im_end|>"]
    lark = tool_grammar(fmt, tools, tok, tools[0]["function"]["name"], required=True)
    spec = {"type": "grammar", "grammar": lark}
    return constraint(spec, tok, tok.vocab_size, [stop], special=tag_ids(tok)), stop


def _allows(mask, tok, stop: int, text: str) -> bool:
    """Whether the grammar lets the model write `text` token by token, and end there."""
    history = [0]
    for token in tok.encode(text, special=True, add_bos=False, add_eos=False):
        if not mask.allowed(history)[token]:
            return False
        history.append(token)
    return bool(mask.allowed(history)[stop])


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_the_writers_text_is_what_the_grammar_allows(tok, fmt):
    mask, stop = _mask(fmt, tok, _tools("every", EVERY))
    text = fmt.write([("every", ARGS)])
    assert _allows(mask.fork(), tok, stop, text), (fmt.name, text)
    same = json.dumps(_read(fmt, text, "every", EVERY), sort_keys=True)  # 3.0 apart from 3
    assert same == json.dumps(ARGS, sort_keys=True), (fmt.name, text)
    for old, new in OTHERWISE[fmt.name]:
        assert old in text, (fmt.name, old, text)
        other = text.replace(old, new, 1)
        assert not _allows(mask.fork(), tok, stop, other), (fmt.name, other)


def _read(fmt, text: str, name: str, params: dict) -> dict:
    """The arguments of the one call in `text`, as the server's parser reads them."""
    tools = _tools(name, params)
    parser = ToolCallParser(frozenset([name]), fmt, tool_schemas(tools))
    shown, calls = parser.feed(text)
    rest, more = parser.flush()
    assert (shown + rest).strip() == "" and len(calls + more) == 1, (fmt.name, text)
    return json.loads((calls + more)[0]["function"]["arguments"])


_FORCED: dict[str, list] = {}


def forced(tok, fmt) -> list[tuple[str, dict]]:
    """[(forced text, the arguments read back)] of random walks, made once per format."""
    if fmt.name in _FORCED:
        return _FORCED[fmt.name]
    tools = _tools("probe", BOUNDED)
    mask, stop = _mask(fmt, tok, tools)
    out = []
    for seed in range(SEEDS):
        text = walk(mask.fork(), tok, stop, seed, steps=1200)
        assert text is not None, (fmt.name, seed, "no end within the steps")
        out.append((text, _read(fmt, text, "probe", BOUNDED)))
    _FORCED[fmt.name] = out
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_random_calls_read_back_valid_and_write_back_the_same(tok, fmt):
    for text, args in forced(tok, fmt):
        jsonschema.validate(args, BOUNDED)
        assert fmt.write([("probe", args)]) == text, (fmt.name, args)


# the corpus' templates that write one of these formats' tags (the probe then says which)
MARKS = (
    "<seed:tool_call>",
    '<function name="',
    "<|tool_call_start|>",
    "<parameter=",
    "<|tool_call>",
)
TEMPLATES = sorted(
    p.name for p in CORPUS.glob("*.jinja") if any(m in p.read_text() for m in MARKS)
) or ["(corpus not fetched)"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_template_renders_the_forced_call_as_it_was_written(tok, name):
    if not (CORPUS / name).exists():
        pytest.skip("llama.cpp's templates not fetched (scripts/fetch_references.py)")
    template = ChatTemplate("corpus", (CORPUS / name).read_text())
    fmt, how = template_match(template)
    if fmt.name not in IDS or how != "exact":
        pytest.skip(f"{fmt.name} ({how}): not a format of these")
    for text, args in forced(tok, fmt):
        got = reply_of(template, "", [("probe", args)])
        assert got is not None, (name, args)
        turn = cut_at_turn_end(got[1]).rstrip()
        assert turn[turn.find(fmt.open) :] == text, (name, args)
