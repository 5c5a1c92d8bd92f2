"""Tool calls read back from every chat template of llama.cpp's corpus of official templates.

For each template: render a conversation whose assistant turn makes calls (one call; two
parallel calls; text before a call) with arguments of every JSON shape (strings with quotes,
newlines and non-ASCII, a string that looks like a number, integers, floats, booleans, null,
arrays, nested objects), take the text the turn adds after the generation prompt (what a model
trained on the template writes, cut at the end-of-turn token the engine stops at), stream it in
pieces through the reasoning splitter and the call parser mlxlis picks for that template (the
format found by probing the template, the offered tools' schemas), and get the calls back
exactly: names, and arguments equal to those rendered, value for value and type for type. The
text comes from the vendors' templates, not from mlxlis' writers: a round trip through
independent text.

Templates that render no call are counted apart; templates that neither mlxlis' sandbox nor
transformers' `render_jinja_template` can render are skipped (SKIPPED says which); XFAIL lists
the formats still unread, and why. A template of a family mlxlis runs or adds is never there.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

from mlxlis.errors import TemplateError
from mlxlis.prompt.reasoning import ANSWER, REASONING, ReasoningSplitter
from mlxlis.prompt.reasoning_styles import (
    THINKING_OFF,
    THINKING_ON,
    opens_block,
    template_reasoning,
)
from mlxlis.prompt.template import END_OF_TURN_MARKERS, ChatTemplate
from mlxlis.prompt.tool_calls import ToolCallParser, tool_schemas
from mlxlis.prompt.tool_formats import template_format
from mlxlis.prompt.tool_formats.partial import streams

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from fetch_references import reference_dir  # noqa: E402
from test_reasoning_corpus import FAMILIES  # noqa: E402
from tool_pieces import check_pieces, joined  # noqa: E402

CORPUS = reference_dir() / "templates"
NAMES = sorted(p.name for p in CORPUS.glob("*.jinja")) or ["(corpus not fetched)"]

WEATHER = {"city": 'Paris "Rive Gauche"\n  naïve — ü', "days": 3}
SEARCH = {
    "query": "42",  # a string parameter that looks like a number stays a string
    "limit": 2.5,
    "exact": True,
    "cursor": None,
    "tags": ["a b", "c"],
    "filter": {"lang": "fr", "max": [1, 2], "deep": {"ok": False, "none": None}},
}
TEXT = "Let me check."


def _schema(props: dict) -> dict:
    return {
        "type": "object",
        "properties": {k: {**v, "description": f"The {k}."} for k, v in props.items()},
        "required": list(props),
    }


PARAMS = {
    "get_weather": _schema({"city": {"type": "string"}, "days": {"type": "integer"}}),
    "search": _schema(
        {
            "query": {"type": "string"},
            "limit": {"type": "number"},
            "exact": {"type": "boolean"},
            "cursor": {"type": ["integer", "null"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "filter": {"type": "object"},
        }
    ),
}


def _tools(params: dict) -> list[dict]:
    return [
        {"type": "function", "function": {"name": n, "description": f"{n}.", "parameters": p}}
        for n, p in params.items()
    ]


TOOLS = _tools(PARAMS)
# for templates whose signature printer fails on an array, an object without
# additionalProperties or a union of types (Hermes 2 Pro, Command R+: recursion, undefined):
# those parameters without their type (these are JSON formats: they read no schema)
SCALARS = ("string", "number", "integer", "boolean")
PLAIN_TOOLS = _tools(
    {
        n: {
            **p,
            "properties": {
                k: v if v.get("type") in SCALARS else {"description": v["description"]}
                for k, v in p["properties"].items()
            },
        }
        for n, p in PARAMS.items()
    }
)
SHAPES = {  # shape -> (the turn's text, its calls)
    "one call": ("", [("get_weather", WEATHER)]),
    "every type": ("", [("search", SEARCH)]),
    "two calls": ("", [("get_weather", WEATHER), ("search", SEARCH)]),
    "text first": (TEXT, [("search", SEARCH)]),
}
# what the engine stops at: the end-of-turn markers it knows and these templates' own ends
TURN_ENDS = (
    *END_OF_TURN_MARKERS,
    "<seed:eos>",  # Seed-OSS
    "[e~[",  # MiniMax
    "<｜end▁of▁sentence｜>",  # DeepSeek
    "<|end_of_msg|>",  # Kimi K3
    "<|close|>message<|sep|>",  # Kimi K3's message end, written before it
    "<|role_end|>",  # Ling
    "</assistant>",  # Laguna
    "<SPECIAL_12>",  # Nemotron Nano v2
    "<｜hy_eos:opensource｜>",  # Hy3
    "<turn|>",  # Gemma 4
    "<|tool_response>",  # Gemma 4: a call's turn ends where the response would start
    "<sep>",  # Reka
    "<end_of_sentence>",  # MiniMax-M1
    "<|START_OF_TURN_TOKEN|>",  # Command R+: a call's turn runs into the next turn's start
)
SWITCHES = ({}, *THINKING_OFF, THINKING_ON)

# Templates that render calls mlxlis does not read, and why.
XFAIL = {
    "MiniMax-M3.jinja": "writes an object or array argument as nested elements "
    "(<tags><item>a</item>…) behind a separator token before every tag, and leaves a null "
    "argument out: no row format holds it",
    "muse-glimmer.jinja": "each call is a message of its own addressed by its header "
    "(` to=NAME<|message|>` … `<|eom|><|start|>assistant`), a harmony-like routing no "
    "splitter reads yet",
    "meetkai-functionary-medium-v3.2.jinja": "its generation prompt ends inside the call "
    "header (`>>>`), a reply's first word being the recipient (`all` for text): no tag "
    "starts a call in the reply",
}
# Templates transformers' render_jinja_template cannot render either (found by the test).
SKIPPED = {
    "Kimi-K2-Instruct.jinja": "list.append, refused by every sandbox",
    "Kimi-K2-Thinking.jinja": "list.append, refused by every sandbox",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "needs `functions` and `datetime` variables",
    "llama-cpp-deepseek-r1.jinja": "JSON-encodes a generator",
}


def _message(text: str, calls: list, as_text: bool = False) -> dict:
    return {
        "role": "assistant",
        "content": text,
        "tool_calls": [
            {
                "id": f"call{i:05d}",  # 9 letters and digits: Mistral's templates want them
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(a) if as_text else a},
            }
            for i, (n, a) in enumerate(calls)
        ],
    }


def _render(
    template: ChatTemplate, messages: list, generation: bool, switches: dict, tools: list
) -> str:
    return template.render(
        messages,
        add_generation_prompt=generation,
        tools=tools,
        bos_token="<s>",
        eos_token="</s>",
        **switches,
    )


def _transformers_renders(text: str, messages: list) -> bool:
    from transformers.utils.chat_template_utils import render_jinja_template

    for tools in (TOOLS, PLAIN_TOOLS):
        try:
            render_jinja_template([messages], tools=tools, chat_template=text, bos_token="<s>")
        except Exception:  # noqa: BLE001 - any failure: it cannot render it either
            continue
        return True
    return False


@functools.lru_cache(maxsize=4)
def _tools_for(template: ChatTemplate) -> list:
    """TOOLS, or PLAIN_TOOLS for a template that renders no prompt with TOOLS."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    for tools in (TOOLS, PLAIN_TOOLS):
        for switches in SWITCHES:
            try:
                _render(template, user, True, switches, tools)
            except TemplateError:
                continue
            return tools
    return TOOLS


def reply_of(template: ChatTemplate, text: str, calls: list) -> tuple[str, str, list] | None:
    """(the generation prompt, what the model writes after it for this turn, the tools it
    was rendered with), or None when the template refuses the conversation. Thinking switches
    are tried until the turn extends the generation prompt; where none does (the prompt opens
    a block the history leaves out), the turn is taken from where it parts from the prompt at
    a tag's or a line's end, after the reasoning's close tag when the prompt left the
    reasoning open. Text arguments only where objects do not render (functionary v3.2)."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    rendered = []
    tools = _tools_for(template)
    for as_text in (False, True):
        message = _message(text, calls, as_text)
        for switches in SWITCHES:
            try:
                head = _render(template, user, True, switches, tools)
                whole = _render(template, [*user, message], False, switches, tools)
            except TemplateError:
                continue
            if whole.startswith(head):
                return head, whole[len(head) :], tools
            rendered.append((head, whole))
        if rendered:
            break
    if not rendered:
        return None
    head, whole = rendered[0]
    at = len(os.path.commonprefix([head, whole]))
    while at and head[at - 1] not in ">\n":
        at -= 1
    reply = whole[at:]
    # a generation prompt that adds a turn first (Command R+'s closing instructions): the
    # reply follows the assistant's header, the prompt's text after its last turn's end
    ends = [head.rfind(e) + len(e) for e in END_OF_TURN_MARKERS if e in head]
    header = head[max(ends) :] if ends else ""
    found = whole.find(header, max(0, at - len(header))) if header.strip() else -1
    if found >= 0:
        reply = whole[found + len(header) :]
    found = template_reasoning(template)
    if found is not None and opens_block(head, found.style) and found.style.close not in reply:
        reply = found.style.close + "\n\n" + reply
    return head, reply, tools


def cut_at_turn_end(reply: str) -> str:
    ends = [reply.find(e) for e in TURN_ENDS if e in reply]
    return reply[: min(ends)] if ends else reply


def read_back(template: ChatTemplate, head: str, reply: str, tools: list, piece: int):
    """(content, reasoning, calls) as the server reads `reply`, streamed `piece` at a time;
    the calls' stream checked on the way (tool_pieces.py), and, in a format that streams,
    each call with two arguments or more begun and its first argument sent before the reply
    ended, in pieces of whole arguments."""
    splitter = ReasoningSplitter.for_prompt(None, head, template)
    fmt = template_format(template)
    parser = ToolCallParser(frozenset(PARAMS), fmt, tool_schemas(tools))
    content, reasoning, calls, pieces, early = "", "", [], [], set()
    chunks = [reply[i : i + piece] for i in range(0, len(reply), piece)]
    for chunk in chunks:
        for kind, text in splitter.feed(chunk):
            if kind == REASONING:
                reasoning += text
            elif kind == ANSWER:
                shown, new = parser.feed(text)
                content, calls = content + shown, calls + new
        taken = parser.take_pieces()
        early |= {p["index"] for p in taken if p["function"]["arguments"]}
        pieces += taken
    for kind, text in splitter.flush():
        if kind == REASONING:
            reasoning += text
        elif kind == ANSWER:
            shown, new = parser.feed(text)
            content, calls = content + shown, calls + new
    shown, new = parser.flush()
    calls += new
    pieces += parser.take_pieces()
    check_pieces(pieces, calls)
    if streams(fmt) and piece < len(reply):
        for i, c in enumerate(calls):
            if len(json.loads(c["function"]["arguments"])) >= 2:
                assert i in early, (fmt.name, i, pieces)
                # a character at a time, each argument in a piece of its own (in larger
                # pieces two may end in one: LFM2's string ends where the next key is seen)
                assert piece > 1 or len(joined(pieces)[i]) >= 3, (fmt.name, i, pieces)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return (content + shown).strip(), reasoning.strip(), got


def _types(value):
    """`value` with each leaf's type beside it: 1 and 1.0 and True compare apart."""
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_types(v) for v in value]
    return (type(value).__name__, value)


@pytest.mark.parametrize("name", NAMES)
def test_calls_read_back_from_the_template(name):
    if name not in {p.name for p in CORPUS.glob("*.jinja")}:
        pytest.skip("llama.cpp's templates not fetched (scripts/fetch_references.py)")
    assert name not in XFAIL or name not in FAMILIES, "a family mlxlis runs must read back"
    template = ChatTemplate("corpus", (CORPUS / name).read_text())
    checked, refused = 0, 0
    for shape, (text, calls) in SHAPES.items():
        got = reply_of(template, text, calls)
        if got is None:  # refused (Llama 3 takes one call a turn): transformers must too
            user = [{"role": "user", "content": "Weather in Paris?"}]
            messages = [*user, _message(text, calls)]
            assert not _transformers_renders(template.text, messages), (name, shape)
            refused += 1
            continue
        head, reply, tools = got
        if shape == "one call" and "get_weather" not in reply:
            pytest.skip("renders no tool calls")
        turn = cut_at_turn_end(reply)
        # shapes a template cannot write in one reply: a second call it drops, text it
        # drops beside calls or puts in a message of its own (its end before the calls)
        if not all(n in turn for n, _ in calls) or text not in turn:
            continue
        if name in XFAIL:
            pytest.xfail(XFAIL[name])
        for piece in (len(turn) or 1, 1, 4):
            content, reasoning, back = read_back(template, head, turn, tools, piece)
            assert [(n, _types(a)) for n, a in back] == [(n, _types(a)) for n, a in calls], (
                name,
                shape,
                piece,
                turn,
            )
            # the text comes back as content, or as reasoning where the template renders it
            # in the reasoning's channel (gpt-oss's analysis)
            assert content == text or (content == "" and reasoning == text), (name, shape, turn)
        checked += 1
    if not checked and refused == len(SHAPES):
        assert name in SKIPPED, f"{name}: neither renders it; add it to SKIPPED"
        pytest.skip(f"neither mlxlis nor transformers renders it: {SKIPPED[name]}")
    assert checked, f"{name}: no shape could be checked"
