"""The server's pure parts, without a server: tool-call parsing as text streams in, the field
names of validation errors, replies split into reasoning / content / tool calls, and the
context bound."""

from __future__ import annotations

import json

import mlxlis
from mlxlis.generation.events import Event, Usage
from mlxlis.generation.sampling import SamplingParams
from mlxlis.prompt.tool_calls import ToolCallParser
from mlxlis.serve.openai_format import APIError, TokenText
from mlxlis.serve.prepare import bound_context
from mlxlis.serve.reply import ChatReply
from mlxlis.serve.schemas import param_path

import pytest

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(parser: ToolCallParser, text: str, piece: int = 1) -> tuple[str, list[dict]]:
    """Feed `text` in pieces of `piece` characters; (all text out, all calls)."""
    out, calls = "", []
    for i in range(0, len(text), piece):
        t, c = parser.feed(text[i : i + piece])
        out, calls = out + t, calls + c
    t, c = parser.flush()
    return out + t, calls + c


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_tool_call_blocks_parse_across_pieces(piece):
    """A `<tool_call>` block split anywhere across streamed pieces becomes one call with the
    arguments as JSON text; the text before it is kept; whitespace between calls is not."""
    text, calls = run(ToolCallParser(), "Let me check." + CALL + "\n\n" + CALL + "\n", piece)
    assert text == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["type"] == "function" and calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    "reply",
    [
        "<tool_call>not json</tool_call> after",  # not JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "get_weather", "arg',  # left open
        "a <tool b < tool_call> c <tool_cal",  # tag-like text
    ],
)
def test_what_does_not_parse_is_text(reply):
    """A block that is not JSON, names no function or is left open, and text that only
    looks like the start of a tag, come back as the very text the model wrote."""
    for piece in (1, 4, 1000):
        assert run(ToolCallParser(), reply, piece) == (reply, [])


def test_bare_json_reply_names_an_offered_tool():
    """A reply that is one JSON object naming an offered tool (Llama 3's form, "parameters"
    too) is a call; one naming a tool that was not offered, or any JSON when no tools were
    offered, stays text."""
    offered = frozenset({"get_weather"})
    reply = ' {"name": "get_weather", "parameters": {"city": "Paris"}}'
    text, calls = run(ToolCallParser(offered), reply, 2)
    assert text == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    other = '{"name": "rm_rf", "arguments": {}}'
    assert run(ToolCallParser(offered), other, 2) == (other, [])
    assert run(ToolCallParser(), reply, 2) == (reply, [])


def test_param_path_names_the_field():
    """pydantic error locations become OpenAI's param paths; union member names are left
    out."""
    assert param_path(("messages", 0, "content", "list[ContentPart]", 0, "type")) == (
        "messages[0].content[0].type"
    )
    assert param_path(("stop", "str")) == "stop"
    assert param_path(("temperature",)) == "temperature"
    assert param_path(()) is None


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return mlxlis.load_tokenizer(tiny("llama")[0])


def events(tokenizer, texts: list[str]) -> list[Event]:
    u = Usage()
    evs = [Event(tokenizer.encode(t, add_bos=False)[0], t, u, logprob=-1.0) for t in texts]
    return [*evs, Event(None, "", u, finish_reason="stop")]


def test_chat_reply_splits_reasoning_content_and_calls(tokenizer):
    """A reply to a prompt that opens <think>: the text up to </think> is reasoning, the rest
    content, a tool call block a call; the deltas add up to the whole message."""
    prompt = "<|im_start|>assistant\n<think>\n"
    text = TokenText(tokenizer.decode, tokenizer.token_bytes)
    reply = ChatReply(tokenizer, text, prompt, logprobs=True, tools=frozenset({"get_weather"}))
    pieces = ["Hm", "m.", "</think>", "\n\nSure", ".", *[CALL[i : i + 5] for i in range(0, 80, 5)]]
    deltas = [reply.feed(ev) for ev in events(tokenizer, pieces)]
    assert "".join(d.reasoning for d in deltas) == "Hmm." == reply.reasoning
    assert "".join(d.content for d in deltas) == "Sure." == reply.content
    assert [c["function"]["name"] for d in deltas for c in d.tool_calls] == ["get_weather"]
    msg = reply.message()
    assert msg["reasoning_content"] == "Hmm." and msg["tool_calls"][0]["type"] == "function"
    assert "index" not in msg["tool_calls"][0] and len(reply.logprobs) == len(pieces)


def test_context_bound():
    """prompt + an explicit max_tokens over the context (when refused: --strict-context), or
    a prompt that fills it, is 400 context_length_exceeded, named by the max field the client
    set or by the prompt; a max_tokens not held to is cut to what is left."""
    p = SamplingParams(max_tokens=100)
    assert bound_context([1] * 50, p, True, 150, "prompt").max_tokens == 100
    with pytest.raises(APIError) as e:
        bound_context([1] * 51, p, True, 150, "prompt", "max_completion_tokens")
    assert e.value.code == "context_length_exceeded"
    assert e.value.param == "max_completion_tokens" and "or max_completion_tokens." in str(e.value)
    with pytest.raises(APIError) as e:
        bound_context([1] * 150, p, True, 150, "prompt")
    assert e.value.param == "prompt"
    assert bound_context([1] * 120, p, False, 150, "prompt").max_tokens == 30
    with pytest.raises(APIError):
        bound_context([1] * 150, p, False, 150, "messages")
