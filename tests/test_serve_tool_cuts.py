"""Forced parallel tool calls cut by max_tokens, on `mlxlis serve` (the tiny random Llama,
greedy: the same request gives the same tokens), through the official clients of the three
APIs that share the server's tool-call parser: Messages (`anthropic`), Chat Completions and
Responses (`openai`). The reference is the same request with room to finish: a cut reply is
its calls up to the one the cut stopped, which is dropped, never shown as its markup in a
text block, content or message item; the stop reason says the reply was cut.
"""

from __future__ import annotations

import pytest

MODEL = "llama_long"
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 3}},
    "required": ["city"],
    "additionalProperties": False,
}
# a tool and a user turn whose greedy reply, with calls forced and parallel calls allowed,
# is three calls (the tiny model's noise; most prompts give one call, then the end)
NAME = "read_file"
THREE_CALLS = "had by word but"


@pytest.fixture(scope="module")
def client(tiny_server):
    return tiny_server.anthropic_client()


@pytest.fixture(scope="module")
def oai(tiny_server):
    return tiny_server.client()


def test_messages_cut_keeps_the_whole_tool_use_blocks(client):
    """Messages: the reply cut at two places of the last call (its arguments, its closing
    tag) is the uncut reply's tool_use blocks up to the one the cut stopped, which is dropped
    (never its markup as a text block), stop_reason "max_tokens". Streamed (the helper's final
    message), no text delta either; the cut call's block was open before the cut (its input
    streams argument by argument), so it is there, with whole arguments only: the uncut
    call's arguments that came before the cut."""
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": THREE_CALLS}],
        "tools": [{"name": NAME, "input_schema": PARAMS}],
        "tool_choice": {"type": "any"},  # parallel calls allowed
    }
    full = client.messages.create(max_tokens=300, **kw)
    inputs = [b.input for b in full.content if b.type == "tool_use"]
    assert len(inputs) >= 2 and full.stop_reason == "tool_use", full.content  # the premise
    dropped = False
    for back in (40, 3):
        n = full.usage.output_tokens - back
        cut = client.messages.create(max_tokens=n, **kw)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == n
        assert [b.type for b in cut.content] == ["tool_use"] * len(cut.content), cut.content
        got = [b.input for b in cut.content]
        assert len(got) >= len(inputs) - 1 and got == inputs[: len(got)], (n, got)
        dropped |= len(got) == len(inputs) - 1
    assert dropped  # some cut fell inside the last call
    with client.messages.stream(max_tokens=full.usage.output_tokens - 40, **kw) as s:
        kinds = {e.type if e.type != "content_block_delta" else e.delta.type for e in s}
        final = s.get_final_message()
    assert "text_delta" not in kinds and final.stop_reason == "max_tokens"
    assert [b.type for b in final.content] == ["tool_use"] * len(final.content)
    assert [b.input for b in final.content[: len(inputs) - 1]] == inputs[:-1]
    assert len(final.content) in (len(inputs) - 1, len(inputs))
    if len(final.content) == len(inputs):  # the cut call: a prefix of its whole arguments
        cut_input, whole = final.content[-1].input, inputs[-1]
        assert list(cut_input.items()) == list(whole.items())[: len(cut_input)]


def test_chat_and_responses_cuts_keep_the_whole_calls(oai):
    """Chat Completions and Responses, cut inside the last call: the uncut reply's calls but
    the last, no text where its markup would be (content None, no message item);
    finish_reason "length", status "incomplete"."""
    tool = {"type": "function", "function": {"name": NAME, "parameters": PARAMS}}
    kw = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": True}
    said = [{"role": "user", "content": THREE_CALLS}]
    full = oai.chat.completions.create(model=MODEL, messages=said, max_tokens=300, **kw)
    calls = [c.function.arguments for c in full.choices[0].message.tool_calls]
    assert len(calls) >= 2 and full.choices[0].finish_reason == "tool_calls"  # the premise
    n = full.usage.completion_tokens - 40
    cut = oai.chat.completions.create(model=MODEL, messages=said, max_tokens=n, **kw)
    msg = cut.choices[0].message
    assert cut.choices[0].finish_reason == "length" and msg.content is None
    assert [c.function.arguments for c in msg.tool_calls] == calls[:-1]
    r = oai.responses.create(
        model=MODEL,
        input=THREE_CALLS,
        tools=[{"type": "function", "name": NAME, "parameters": PARAMS}],
        tool_choice="required",
        parallel_tool_calls=True,
        max_output_tokens=n,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.arguments) for o in r.output] == [("function_call", a) for a in calls[:-1]]
