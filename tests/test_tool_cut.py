"""A reply cut by max_tokens inside a tool call, in every format, against the vendors' own
templates: the calls each template writes (test_tool_formats' round trip) cut at every
character, as max_tokens may cut them. No cut shows call markup as text; the calls kept are
the ones the template wrote, in order, each once it is whole, and the call the cut stopped is
dropped. The same replies not cut, and a cut JSON answer that is no call, stay as they were.
"""

from __future__ import annotations

import json
import re

from mlxlis.prompt.template import ChatTemplate
from mlxlis.prompt.tool_calls import ToolCallParser
from mlxlis.prompt.tool_formats import for_template, template_format

import pytest
from test_tool_formats import ARGS, TEMPLATES, assistant_text, template_text

NAMES = frozenset({"get_weather", "search"})


def parse(fmt, text: str, cut: bool, piece: int = 1000) -> tuple[str, list[tuple[str, dict]]]:
    parser = ToolCallParser(NAMES, fmt)
    out, calls = "", []
    for i in range(0, len(text), piece):
        t, c = parser.feed(text[i : i + piece])
        out, calls = out + t, calls + c
    t, c = parser.flush(cut=cut)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls + c]
    return out + t, got


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_cut_call_never_shows_as_text(name):
    """Cut at every character of the template's calls: no text but whitespace, the calls a
    prefix of those written (never fewer as the cut moves on), all but the last one when the
    cut falls one character into the last call, all of them uncut."""
    _, eos = TEMPLATES[name]
    template = ChatTemplate("test", template_text(name))
    fmt = template_format(template)
    single = name.startswith("meta-llama")  # Llama 3's templates take one call per message
    names = ("get_weather", "search")[: 1 if single else 2]
    sent = [
        {"id": "abcDEF123", "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in zip(names, ARGS, strict=False)
    ]
    text = assistant_text(template, sent)
    for end in ("<|eot_id|>", "<|im_end|>\n", "<|im_end|>", "<turn|>\n", eos or "\0"):
        text = text.removesuffix(end)
    text = re.sub(r"^<think>\s*</think>\s*", "", text)
    want = [(s["function"]["name"], s["function"]["arguments"]) for s in sent]
    last = max(text.rfind(fmt.open) if fmt.open else -1, text.rfind('{"name"'))
    kept = 0
    for k in range(len(text) + 1):
        out, got = parse(fmt, text[:k], cut=True, piece=3 if k % 2 else 1000)
        assert out.strip() == "", (name, k, out)
        assert got == want[: len(got)] and len(got) >= kept, (name, k, got)
        kept = len(got)
        if k == last + 1:
            assert len(got) == len(want) - 1, (name, k, got)
    assert parse(fmt, text, cut=False) == ("", want)


def test_what_is_not_a_call_is_kept_at_a_cut():
    """Cut replies keep the text before a cut call, a JSON answer that names no offered tool
    (Llama 3's calls are bare JSON), and an unclosed call stays text when nothing was cut."""
    hermes = for_template(template_text("Qwen-Qwen2.5-7B-Instruct.jinja"))
    llama = for_template(template_text("meta-llama-Llama-3.1-8B-Instruct.jinja"))
    for cut_call in ('<tool_call>\n{"name": "sea', "<tool_c"):
        assert parse(hermes, "Sure.\n" + cut_call, cut=True) == ("Sure.", [])
    for answer in ('{"answer": 4', '{"name": "Bob", "age": 4', '{"name": "searching'):
        assert parse(llama, answer, cut=True) == (answer, [])
    assert parse(llama, '{"name": "sea', cut=True) == ("", [])
    held = '<tool_call>\n{"name": "sea'
    assert parse(hermes, held, cut=False) == (held, [])
