"""Forced tool calls in every format (tool_grammar.py, tool_lark.py), on a real vocabulary.

For each format of the table: the grammar of a required call, built from the tools' schemas,
is compiled by the engine (llguidance) on Qwen2.5-Coder's vocabulary and driven token by token
with random allowed tokens (seeded); the reply it lets through is read back by the format's
own parser (the one a reply is read with, proven against the vendors' templates in
test_tool_corpus.py), and the arguments validate against the tool's schema (jsonschema, an
independent validator). The text each format's grammar allows is also checked to be the
template's own text where the template is at hand: the calls mlxlis writes for a format are
what its template renders (Qwen3.5's XML rows, GLM's, MiniMax-M2's, DeepSeek's DSML).
"""

from __future__ import annotations

import json
import random
from typing import Any

import mlxlis
from mlxlis.generation.constraints import ConstraintError, constraint
from mlxlis.generation.tool_grammar import tag_ids, tool_grammar
from mlxlis.prompt.template import ChatTemplate
from mlxlis.prompt.tool_calls import ToolCallParser, tool_schemas
from mlxlis.prompt.tool_formats import TABLE, template_match

import jsonschema
import numpy as np
import pytest
from conftest import need_pulled
from test_tool_corpus import CORPUS, XFAIL, cut_at_turn_end, reply_of

CORPUS_NAMES = sorted(p.name for p in CORPUS.glob("*.jinja")) or ["(corpus not fetched)"]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 8},
        "limit": {"type": "number", "minimum": 0, "maximum": 10},
        "exact": {"type": "boolean"},
        "cursor": {"type": ["integer", "null"], "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
        "filter": {
            "type": "object",
            "properties": {"lang": {"type": "string", "maxLength": 3}},
            "required": ["lang"],
            "additionalProperties": False,
        },
    },
    "required": ["query", "exact", "cursor", "tags", "filter"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "maxLength": 4}},
}
LOOKUP = {  # a string the call ends with: its closing tag meets the call's own
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 8}},
    "required": ["q"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}}
    for n, p in (("get_weather", WEATHER), ("search", SEARCH), ("lookup", LOOKUP))
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "lookup": LOOKUP}


@pytest.fixture(scope="module")
def tok():
    need_pulled("qwen2.5-coder-0.5b")
    return mlxlis.load_tokenizer("qwen2.5-coder-0.5b")


def walk(mask, tok, stop: int, seed: int, steps: int = 600) -> str | None:
    """The text of a random reply the mask allows: uniform draws among its tokens, the stop
    token taken half the time it is allowed (a finished call ends); None past `steps`."""
    rng, history = random.Random(seed), [0]
    for _ in range(steps):
        allowed = np.flatnonzero(mask.allowed(history))
        assert len(allowed), "a mask that allows nothing"
        if stop in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return tok.decode(history[1:])
        token = int(allowed[rng.randrange(len(allowed))])
        if token == stop:
            return tok.decode(history[1:])
        history.append(token)
    return None


def forced_calls(fmt, tok, name: str | None, seed: int, parallel: bool = False):
    stop = tok.special_tokens["<|im_end|>"]
    lark = tool_grammar(fmt, TOOLS, tok, name, required=True, parallel=parallel)
    mask = constraint(
        {"type": "grammar", "grammar": lark}, tok, tok.vocab_size, [stop], special=tag_ids(tok)
    )
    text = walk(mask, tok, stop, seed)
    assert text is not None, (fmt.name, "no end within the steps")
    reply = text
    if fmt.name == "harmony":  # its header as the splitter hands it on
        from mlxlis.prompt.harmony import HarmonySplitter

        splitter = HarmonySplitter()
        reply = "".join(t for _, t in splitter.feed(text) + splitter.flush())
    parser = ToolCallParser(frozenset(SCHEMAS), fmt, tool_schemas(TOOLS))
    shown, calls = parser.feed(reply)
    rest, more = parser.flush()
    return text, shown + rest, calls + more


@pytest.mark.parametrize("fmt", TABLE, ids=[f.name for f in TABLE])
def test_a_forced_call_reads_back_and_validates(tok, fmt):
    """Each tool by name, then either (`required` with two tools), a few seeds each: one call,
    read back by the format's parser, its arguments valid by the tool's schema."""
    for i, name in enumerate(("get_weather", "search", None, None)):
        text, shown, calls = forced_calls(fmt, tok, name, seed=i)
        assert shown.strip() == "" and len(calls) == 1, (fmt.name, text, shown)
        got = calls[0]["function"]
        assert name is None or got["name"] == name
        schema = SCHEMAS[got["name"]]
        jsonschema.validate(json.loads(got["arguments"]), schema)


@pytest.mark.parametrize("fmt", [f for f in TABLE if f.name != "harmony"], ids=lambda f: f.name)
def test_parallel_forced_calls_read_back(tok, fmt):
    """parallel_tool_calls: as many calls as the walk writes, each read back and valid."""
    text, shown, calls = forced_calls(fmt, tok, None, seed=7, parallel=True)
    assert shown.strip() == "" and calls, (fmt.name, text)
    for call in calls:
        schema = SCHEMAS[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_strict_calls_under_auto_need_a_tag_that_is_one_token(tok):
    """tool_choice "auto" with strict tools: free text or calls, where the call tag is one
    token of the vocabulary (Qwen2.5's <tool_call>); a tag spelled in text is refused."""
    by_name = {f.name: f for f in TABLE}
    lark = tool_grammar(by_name["qwen3-coder"], TOOLS, tok, None, required=False)
    assert "TEXT" in lark and lark.count("<[") >= 2
    with pytest.raises(ConstraintError, match="not one token"):
        tool_grammar(by_name["minimax-m2"], TOOLS, tok, None, required=False)


def _open(schema: Any) -> Any:
    """`schema` without its length bounds."""
    if isinstance(schema, dict):
        return {k: _open(v) for k, v in schema.items() if k not in ("maxLength", "maxItems")}
    return [_open(v) for v in schema] if isinstance(schema, list) else schema


OPEN_TOOLS = _open(TOOLS)
SIMPLE = [("get_weather", {"city": "Paris", "days": 3})]
LAST_A_STRING = [("lookup", {"q": "tea"})]
TWO = [
    *SIMPLE,
    (
        "search",
        {"query": "tea", "exact": True, "cursor": None, "tags": ["a"], "filter": {"lang": "fr"}},
    ),
]
# what the grammar writes differently from the template, on purpose or by the template's doing
NOT_THE_SAME = {
    "harmony": "the template renders the recipient before the channel; the grammar writes the "
    "header as gpt-oss does (channel, recipient, <|constrain|>json)",
    "command-r": "the template indents the arguments' JSON by four; forced JSON is one line",
}


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_the_templates_own_calls_are_what_the_grammar_writes(tok, name):
    """The calls a vendor's template renders (one; two where it renders two) are in the
    language of the grammar that forces calls in the format found for it, token by token as
    the engine's mask allows them and ending where the stop is allowed: the forced text is
    the model's own format, whitespace and all (so the next turn's prompt re-renders it).
    The strings here have no length bound (the forcing tests above bound theirs)."""
    template = ChatTemplate("corpus", (CORPUS / name).read_text())
    fmt, how = template_match(template)
    if name in XFAIL or fmt.name in NOT_THE_SAME:
        pytest.skip(XFAIL.get(name) or NOT_THE_SAME[fmt.name])
    if how != "exact":  # Reka's Hermes without newlines between calls, Step 3.5's likewise
        pytest.skip(f"the template spaces its calls its own way ({how} by the probe)")
    checked, stop = 0, tok.special_tokens["<|im_end|>"]
    for calls in (SIMPLE, LAST_A_STRING, TWO):
        got = reply_of(template, "", calls)  # the calls as the template renders them
        if got is None:
            continue
        turn = cut_at_turn_end(got[1]).rstrip()
        start = turn.find(fmt.open) if fmt.open else len(turn) - len(turn.lstrip())
        if start < 0 or not all(n in turn for n, _ in calls):
            continue
        lark = tool_grammar(fmt, OPEN_TOOLS, tok, None, required=True, parallel=len(calls) > 1)
        mask = constraint(
            {"type": "grammar", "grammar": lark}, tok, tok.vocab_size, [stop], special=tag_ids(tok)
        )
        history = [0]
        for token in tok.encode(turn[start:], special=True, add_bos=False, add_eos=False):
            assert mask.allowed(history)[token], (name, tok.decode(history[1:]), token)
            history.append(token)
        assert mask.allowed(history)[stop], (name, turn[start:])
        checked += 1
    if not checked:
        pytest.skip("renders no calls")
