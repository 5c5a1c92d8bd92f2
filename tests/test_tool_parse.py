"""The streaming tool-call parser's rules in every format of the table (tools.py,
tool_formats/): only a possible start of a call tag is held back; a call the model broke is
returned as the text it was, with a log line, never dropped; an argument written as text is
read by its tool's schema (a string stays the exact text); the format a template renders is
found by a probe render, not by the model's name. The formats themselves are proven against
the vendors' templates in test_tool_corpus.py."""

from __future__ import annotations

import json
import logging

from mlxlis.prompt.template import ChatTemplate
from mlxlis.prompt.tool_calls import ToolCallParser
from mlxlis.prompt.tool_formats import TABLE, template_format
from mlxlis.prompt.tool_formats.values import read_value, types_of

import pytest
from conftest import llama_cpp_reference

TAGGED = [f for f in TABLE if f.open]
SCHEMAS = {
    "f": {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "s": {"type": "string"},
            "u": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "r": {"$ref": "#/$defs/word"},
        },
        "$defs": {"word": {"type": "string"}},
    }
}


def run(parser: ToolCallParser, text: str, piece: int = 1) -> tuple[str, list]:
    out, calls = "", []
    for i in range(0, len(text), piece):
        shown, new = parser.feed(text[i : i + piece])
        out, calls = out + shown, calls + new
    shown, new = parser.flush()
    return out + shown, calls + new


@pytest.mark.parametrize("fmt", TAGGED, ids=[f.name for f in TAGGED])
def test_only_a_possible_start_of_a_call_tag_is_held(fmt):
    """Text streams out as it comes but for what may still become the call tag; a tag's
    start that turns out to be text comes out whole, in order."""
    parser = ToolCallParser(frozenset({"f"}), fmt)
    shown, _ = parser.feed("Hello, " + fmt.open[:-1])
    assert shown == "Hello,"  # the space waits for what follows it; the partial tag is held
    shown, _ = parser.feed("\x00 more")
    assert shown == " " + fmt.open[:-1] + "\x00 more"
    assert parser.flush() == ("", [])


@pytest.mark.parametrize("fmt", TAGGED, ids=[f.name for f in TAGGED])
def test_a_broken_call_is_text_and_logged(fmt, caplog):
    """A call the model broke (its name left out) comes back as exactly the text it was,
    with a warning on mlxlis.serve, in every format that closes its calls."""
    if fmt.close is None:
        pytest.skip("its calls run to the end of the reply: an unparsed one is text there")
    whole, broken = fmt.write([("f", {"n": 1})]), fmt.write([("", {"n": 1})])
    assert run(ToolCallParser(frozenset({"f"}), fmt), whole)[1]
    with caplog.at_level(logging.WARNING, logger="mlxlis.serve"):
        text, calls = run(ToolCallParser(frozenset({"f"}), fmt), "Hi " + broken, 3)
    assert (text, calls) == ("Hi " + broken, [])
    assert any(fmt.name in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fmt", TAGGED, ids=[f.name for f in TAGGED])
def test_each_format_reads_back_what_it_writes(fmt):
    """The writer (what the probe recognises a template by) and the reader agree on two
    calls with every kind of value, streamed a character at a time."""
    calls = [("f", {"n": -7, "s": "3", "u": None, "r": "a <b> & c"}), ("f", {"s": 'x "y"'})]
    text, got = run(ToolCallParser(frozenset({"f"}), fmt, SCHEMAS), fmt.write(calls))
    assert text == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


def test_values_follow_the_schema():
    """A value written as text is read by its property's type: a string keeps its exact
    text (a number's look, its whitespace), integers and nulls become values, a union tries
    the non-string types first, a local $ref is followed, no schema reads JSON or else text."""
    params = SCHEMAS["f"]
    prop = params["properties"]
    assert read_value(" 42 ", prop["s"], params) == " 42 "
    assert read_value("42", prop["n"], params) == 42
    assert read_value("4.5", prop["n"], params) == "4.5"  # no integer: the text as written
    assert read_value("None", prop["u"], params) is None
    assert read_value("7", prop["u"], params) == 7
    assert read_value("007", prop["r"], params) == "007"
    assert types_of(prop["r"], params) == {"string"}
    assert read_value('{"a": [1, true]}', None) == {"a": [1, True]}
    assert read_value("{'a': [1, True]}", {"type": "object"}) == {"a": [1, True]}
    assert read_value("not json", None) == "not json"
    assert read_value("<![CDATA[a\nb]]>", {"type": "string"}) == "a\nb"


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("Qwen3.5-4B.jinja", "qwen3-coder"),  # <tool_call> like Hermes, XML inside
        ("Qwen-Qwen3-0.6B.jinja", "hermes"),
        ("GLM-4.7-Flash.jinja", "glm-4.7"),
        ("MiniMax-M2.jinja", "minimax-m2"),
        ("deepseek-ai-DeepSeek-V3.2.jinja", "dsml-function_calls"),
        ("openai-gpt-oss-120b.jinja", "harmony"),  # read through its reasoning splitter
    ],
)
def test_the_probe_finds_the_format_a_template_renders(name, fmt):
    template = ChatTemplate("test", llama_cpp_reference(f"templates/{name}").read_text())
    assert template_format(template).name == fmt


def test_past_calls_go_back_as_each_template_takes_them():
    """A past call's arguments reach a template as an object (transformers' convention)
    unless only text renders: of the corpus, functionary v3.2 alone concatenates them to its
    text; message_dict hands it the JSON text and the others the object, and the turn renders
    what the template renders for text arguments (transformers refuses objects there)."""
    from mlxlis.prompt.tool_formats import call_arguments
    from mlxlis.serve.chat_messages import message_dict
    from mlxlis.serve.schemas import ChatMessage

    from test_tool_corpus import CORPUS
    from transformers.utils.chat_template_utils import render_jinja_template

    texts = {
        p.name
        for p in CORPUS.glob("*.jinja")
        if call_arguments(ChatTemplate("c", p.read_text())) == "text"
    }
    assert texts == {"meetkai-functionary-medium-v3.2.jinja"}
    source = (CORPUS / "meetkai-functionary-medium-v3.2.jinja").read_text()
    args = '{"city": "Paris", "days": 3}'
    msg = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
            ],
        }
    )

    class Model:  # what message_dict reads of a model: its template
        template = ChatTemplate("c", source)
        vision = None

    sent = message_dict(msg, 0, Model())
    assert sent["tool_calls"][0]["function"]["arguments"] == args
    assert message_dict(msg, 0)["tool_calls"][0]["function"]["arguments"] == json.loads(args)
    user = {"role": "user", "content": "Weather?"}
    ours = Model.template.render([user, sent], add_generation_prompt=False, bos_token="<s>")
    theirs, _ = render_jinja_template(
        [[user, {**sent, "content": ""}]], chat_template=source, bos_token="<s>"
    )
    assert ours == theirs[0] and ">>>f\n" + args in ours
