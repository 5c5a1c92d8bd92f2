"""Tool-call formats, proven against the vendors' own chat templates (llama.cpp's copies).

What a template renders for an assistant message's `tool_calls` is the text the model was
trained to write; each test renders a conversation with calls through the real template, takes
the assistant's part, streams it through the parser in small pieces and gets the same calls
back (names, arguments as objects). This is a round trip through independent text (the
templates), not the parser checked against itself. It also checks the format each template
is matched to, the ids Mistral's templates accept, and what `tool_choice` prefixes render to.
"""

from __future__ import annotations

import json
import re

from mlxlis.prompt.template import ChatTemplate
from mlxlis.prompt.tool_calls import ToolCallParser
from mlxlis.prompt.tool_formats import for_template, parse_gemma4, template_format

import pytest
from conftest import llama_cpp_reference

ARGS = [  # nested values exercise Gemma 4's own argument syntax
    {"city": "Paris", "days": 3},
    {
        "query": 'a "quoted", {braced} text: yes',
        "limit": 2.5,
        "flags": [True, False, None],
        "opts": {"units": ["c", "f"], "hourly": True},
    },
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": n,
            "description": "d",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "x"}},
                "required": ["city"],
            },
        },
    }
    for n in ("get_weather", "search")
]

TEMPLATES = {  # template file -> (format, the eos the engine stops at, so not in the reply)
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", None),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", None),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("json", None),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": ("json", None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral-call-id", "</s>"),
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": ("mistral-args", "</s>"),
    "unsloth-mistral-Devstral-Small-2507.jinja": ("mistral-args", "</s>"),
    "google-gemma-4-31B-it.jinja": ("gemma4", "<|tool_response>"),
    "transformers:llama4": ("json", "<|eot|>"),  # Llama4Processor's own template
}


def template_text(name: str) -> str:
    """A template by its name in TEMPLATES: llama.cpp's copy, or one transformers ships."""
    if name == "transformers:llama4":
        from transformers.models.llama4.processing_llama4 import chat_template

        return chat_template
    return llama_cpp_reference(f"templates/{name}").read_text()


def assistant_text(template: ChatTemplate, calls: list[dict]) -> str:
    """The text the template writes for an assistant turn that makes `calls`."""
    user = [{"role": "user", "content": "Weather?"}]
    # thinking on: Gemma 4 renders an empty thought channel after a prompt, not in the history
    kw = {"bos_token": "<s>", "eos_token": "</s>", "tools": TOOLS, "enable_thinking": True}
    head = template.render(user, add_generation_prompt=True, **kw)
    whole = template.render(
        user + [{"role": "assistant", "content": "", "tool_calls": calls}],
        add_generation_prompt=False,
        **kw,
    )
    assert whole.startswith(head), "the assistant turn does not extend the generation prompt"
    return whole[len(head) :]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_calls_parse_back(name):
    fmt_name, eos = TEMPLATES[name]
    template = ChatTemplate("test", template_text(name))
    fmt = template_format(template)
    assert fmt.name == fmt_name
    single = name.startswith("meta-llama")  # Llama 3's templates take one call per message
    sent = [
        {"id": "abcDEF123", "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in zip(
            ("get_weather", "search")[: len(ARGS) - single], ARGS[: 2 - single], strict=True
        )
    ]
    text = assistant_text(template, sent)
    for end in ("<|eot_id|>", "<|im_end|>\n", "<|im_end|>", "<turn|>\n", eos or "\0"):
        text = text.removesuffix(end)  # the engine stops at the end-of-turn token
    text = re.sub(r"^<think>\s*</think>\s*", "", text)  # reasoning: not the parser's part
    assert fmt.open in text
    for piece in (1, 3, 7):
        parser = ToolCallParser(frozenset({"get_weather", "search"}), fmt)
        out, calls = "", []
        for i in range(0, len(text), piece):
            t, c = parser.feed(text[i : i + piece])
            out, calls = out + t, calls + c
        t, c = parser.flush()
        out, calls = out + t, calls + c
        assert out.strip() == "", (name, out)
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        assert got == [(s["function"]["name"], s["function"]["arguments"]) for s in sent]
        if fmt_name.startswith("mistral"):  # its templates accept only 9 letters/digits as ids
            assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
            again = [{**s, "id": c["id"]} for s, c in zip(sent, calls, strict=True)]
            assistant_text(template, again)  # the ids we give render back without a raise


def test_broken_calls_stay_text():
    """A call that does not parse in each format comes back as the text it was."""
    for name, bad in [
        ("google-gemma-4-31B-it.jinja", '<|tool_call>call:get_weather{city:<|"|>Par<tool_call|>'),
        ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "[TOOL_CALLS]get weather[ARGS]{oops"),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", '[TOOL_CALLS][{"name": 3}]'),
    ]:
        fmt = for_template(llama_cpp_reference(f"templates/{name}").read_text())
        parser = ToolCallParser(frozenset({"get_weather"}), fmt)
        t1, c1 = parser.feed("Sure. " + bad)
        t2, c2 = parser.flush()
        assert (t1 + t2, c1 + c2) == ("Sure. " + bad, []), name


def test_gemma4_values():
    """Gemma 4's argument syntax: quoted and bare keys, strings holding its delimiters'
    neighbours, numbers, booleans, null, nested lists and objects."""
    q = '<|"|>'
    body = f"call:f{{a:{q}x, y: {{z}}{q},b:-1.5e3,c:[true,false,null],d:{{{q}k{q}:[1,{q}2{q}]}}}}"
    ((name, args, _),) = parse_gemma4(body)
    assert name == "f" and json.loads(args) == {
        "a": "x, y: {z}",
        "b": -1500.0,
        "c": [True, False, None],
        "d": {"k": [1, "2"]},
    }
    assert parse_gemma4("call:f{a:nope}") is None and parse_gemma4("call:f{a:1} junk") is None


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_forced_prefix_is_a_call_start(name):
    """tool_choice: the text that opens a call of a named tool, completed with the arguments
    and the format's end as the template would write them, parses to that call."""
    template = ChatTemplate("test", template_text(name))
    fmt = template_format(template)
    prefix = fmt.forced("search")
    rest = {
        "hermes": '"q": 1}}\n</tool_call>',
        "json": '"q": 1}}',
        "gemma4": "q:1}<tool_call|>",
    }.get(fmt.name)
    if fmt.name.startswith("mistral"):
        rest = '"q": 1}' + ("}]" if prefix.startswith("[TOOL_CALLS][") else "")
    parser = ToolCallParser(frozenset({"search"}), fmt)
    assert parser.feed(prefix) == ("", [])
    t1, c1 = parser.feed(rest)
    t2, c2 = parser.flush()
    assert t1 + t2 == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in c1 + c2] == [
        ("search", {"q": 1})
    ]


def test_required_prefix_leaves_the_name_to_the_model():
    """tool_choice "required" opens a call and its name; the model's name completes it."""
    for name in ("Qwen-Qwen2.5-7B-Instruct.jinja", "mistralai-Mistral-Nemo-Instruct-2407.jinja"):
        fmt = for_template(llama_cpp_reference(f"templates/{name}").read_text())
        parser = ToolCallParser(frozenset({"search"}), fmt)
        end = "\n</tool_call>" if fmt.name == "hermes" else "]"
        assert parser.feed(fmt.forced(None)) == ("", [])
        t1, c1 = parser.feed('search", "arguments": {"q": 1}}' + end)
        t2, c2 = parser.flush()
        assert t1 + t2 == "" and [c["function"]["name"] for c in c1 + c2] == ["search"]


def test_llama4_text_between_its_tags_is_content():
    """Llama 4's template puts the turn's text between <|python_start|> and <|python_end|>,
    the calls after: the text comes back as content, the calls as calls."""
    from transformers.models.llama4.processing_llama4 import chat_template

    fmt = for_template(chat_template)
    call = '{"name": "search", "parameters": {"q": 1}}'
    for reply in (f"<|python_start|>Let me look.<|python_end|>{call}", f"<|python_start|>{call}"):
        parser = ToolCallParser(frozenset({"search"}), fmt)
        out, calls = "", []
        for i in range(0, len(reply), 4):
            t, c = parser.feed(reply[i : i + 4])
            out, calls = out + t, calls + c
        t, c = parser.flush()
        out, calls = out + t, calls + c
        assert out == ("Let me look." if "Let" in reply else "")
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"q": 1}]
