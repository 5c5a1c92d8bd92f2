"""Anthropic's Messages API on `mlxlis serve`, driven by the official `anthropic` client (its
types parse every response and stream event) and raw HTTP where the client would not send
the request. On the tiny random Llama (replies are greedy noise: the same request gives the
same tokens), so what is proved is the adapter, against the server's Chat Completions as the
reference: the same conversation (tool calls and results included) gives the same prompt and
the same tokens through both; blocks, stop reasons and usage follow Anthropic's rules; the
stream's events come in Anthropic's order and the client's helpers rebuild the whole message;
a reasoning budget ends the reasoning where the unbudgeted reply's reasoning goes on;
refusals are 4xx in Anthropic's error shape, naming the field as this API calls it.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

MODEL = "llama_long"
HELLO = [{"role": "user", "content": "Hello, world!"}]
# a 1 x 1 PNG (made by Pillow)
PNG_SOURCE = {
    "type": "base64",
    "media_type": "image/png",
    "data": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLv"
    "AAAAAElFTkSuQmCC",
}
WEATHER = {
    "name": "get_weather",
    "description": "Get the weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 3}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(tiny_server):
    return tiny_server.anthropic_client()


@pytest.fixture(scope="module")
def oai(tiny_server):
    return tiny_server.client()


def create(client, **kw):
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 12)
    return client.messages.create(model=MODEL, **kw)


def sse(resp) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of an Anthropic stream."""
    out, name = [], None
    while line := resp.readline():
        line = line.decode().strip()
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
    return out


def test_same_prompt_tokens_and_counts_as_chat_completions(client, oai):
    """A system prompt and a user turn: the text equals /v1/chat/completions' for the same
    messages, stop_reason is its finish_reason in Anthropic's words, input plus cache-read
    tokens is its prompt count (count_tokens too), output tokens its completion count."""
    r = create(client, system="Be brief.", max_tokens=10)
    o = oai.chat.completions.create(
        model=MODEL, max_tokens=10, messages=[{"role": "system", "content": "Be brief."}, *HELLO]
    )
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == MODEL and [b.type for b in r.content] == ["text"]
    assert r.content[0].text == o.choices[0].message.content
    reason = o.choices[0].finish_reason
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reason]
    assert r.stop_sequence is None
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == o.usage.prompt_tokens
    assert u.output_tokens == o.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=HELLO)
    assert counted.input_tokens == o.usage.prompt_tokens


def test_stream_events_in_order_and_the_helpers_rebuild_the_message(client, tiny_server):
    """Raw events: message_start, ping, then blocks (start, deltas, stop, consecutive
    indexes), message_delta with the stop reason and usage, message_stop, each data's type its
    event's name. The client's stream helpers give the text and final message of `create`."""
    whole = create(client, max_tokens=16)
    body = {"model": MODEL, "max_tokens": 16, "messages": HELLO, "stream": True}
    conn, resp = tiny_server.open_stream("/v1/messages", body)
    got = sse(resp)
    conn.close()
    assert all(data["type"] == name for name, data in got)
    names = [name for name, _ in got]
    assert names[:2] == ["message_start", "ping"]
    got = [got[0], *(e for e in got[1:] if e[0] != "ping")]  # keep-alives may come anywhere
    names = [name for name, _ in got]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    # admitted at once: message_start already has the final split of the prompt's tokens
    start, end = got[0][1]["message"]["usage"], got[-2][1]["usage"]
    for k in ("input_tokens", "cache_read_input_tokens"):
        assert start[k] == end[k]
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert start["input_tokens"] + start["cache_read_input_tokens"] == prompt
    assert start["cache_read_input_tokens"] > 0  # `whole`'s prompt is cached: it counts
    assert got[0][1]["message"]["content"] == [] and got[0][1]["message"]["stop_reason"] is None
    starts = [d["index"] for n, d in got if n == "content_block_start"]
    assert starts == list(range(len(starts)))
    assert got[-2][1]["delta"]["stop_reason"] == whole.stop_reason
    assert got[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(model=MODEL, max_tokens=16, messages=HELLO) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequence_cuts_where_it_first_appears(client):
    """stop_sequences: the reply is the unstopped one cut before the first occurrence,
    stop_reason "stop_sequence" naming the string that matched."""
    full = create(client, max_tokens=24).content[0].text
    at = next(i for i in range(4, len(full) - 2) if full.index(full[i : i + 2]) == i)
    stop = full[at : at + 2]
    r = create(client, max_tokens=24, stop_sequences=["\x00never", stop])
    assert r.content[0].text == full[:at]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop


def test_thinking_switch_and_budget(client):
    """thinking enabled reaches the template's enable_thinking (the prompt ends inside
    `<think>`, the reply is a thinking block); disabled leaves it out (fewer prompt tokens, a
    text block). budget_tokens: the reasoning is the unbudgeted one's first tokens, then
    closed, and the reply goes on as text."""
    on = create(client, max_tokens=30, thinking={"type": "enabled", "budget_tokens": 29})
    off = create(client, max_tokens=30, thinking={"type": "disabled"})
    assert [b.type for b in on.content] == ["thinking"] and on.content[0].thinking
    assert [b.type for b in off.content] == ["text"]
    assert on.usage.input_tokens + on.usage.cache_read_input_tokens > (
        off.usage.input_tokens + off.usage.cache_read_input_tokens
    )
    short = create(client, max_tokens=30, thinking={"type": "enabled", "budget_tokens": 5})
    assert [b.type for b in short.content] == ["thinking", "text"], short.content
    cut = short.content[0].thinking
    assert cut and len(cut) < len(on.content[0].thinking)
    assert on.content[0].thinking.startswith(cut)
    assert short.usage.output_tokens == 30 and short.stop_reason == "max_tokens"


def test_tool_use_and_results_give_the_chat_completions_prompt(client, oai):
    """A past tool_use block and its tool_result become the assistant's tool call and a tool
    message: the same prompt tokens and reply as the OpenAI-shaped conversation."""
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    r = create(client, messages=turns, tools=[WEATHER], tool_choice={"type": "none"})
    call = {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    o = oai.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        tools=[
            {"type": "function", "function": {**WEATHER, "parameters": WEATHER["input_schema"]}}
        ],
        tool_choice="none",
        messages=[
            turns[0],
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [{"id": "toolu_1", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
            {"role": "user", "content": "Thanks!"},
        ],
    )
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == o.usage.prompt_tokens
    assert r.content[0].text == o.choices[0].message.content


def test_forced_tool_is_a_tool_use_block_and_json_output_validates(client):
    """tool_choice {"type": "tool"}: the reply is one tool_use block whose input follows the
    tool's schema (jsonschema, the reference validator), stop_reason "tool_use", streamed as
    an input_json_delta the client's helper parses to the same input; output_config.format's
    schema is enforced the same way."""
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    r = create(client, max_tokens=150, tools=[WEATHER], tool_choice=choice)
    assert [b.type for b in r.content] == ["tool_use"] and r.stop_reason == "tool_use"
    block = r.content[0]
    assert block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER["input_schema"])
    with client.messages.stream(
        model=MODEL, max_tokens=150, messages=HELLO, tools=[WEATHER], tool_choice=choice
    ) as s:
        final = s.get_final_message()
    assert final.content[0].input == block.input and final.stop_reason == "tool_use"
    n = {"type": "integer", "minimum": 0, "maximum": 99}  # bounded: noise ends the number
    schema = {
        "type": "object",
        "properties": {"n": n},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = create(
        client, max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema}}
    )
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), schema)


def claude_code_tools(n: int = 15) -> list[dict]:
    """Tools shaped like Claude Code's: JSON Schema draft 7 with nested objects, arrays and
    enums, additionalProperties false, some with cache_control."""
    tools = []
    for i in range(n):
        schema = {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "An absolute path"},
                "edits": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "old": {"type": "string"},
                            "new": {"type": "string"},
                            "mode": {"type": "string", "enum": ["replace", "insert"]},
                        },
                        "required": ["old", "new"],
                        "additionalProperties": False,
                    },
                },
                "limit": {"type": "number", "minimum": 1},
            },
            "required": ["path"],
            "additionalProperties": False,
        }
        tool = {"name": f"Tool{i}", "description": f"Does thing {i}.", "input_schema": schema}
        if i == n - 1:
            tool["cache_control"] = {"type": "ephemeral"}
        tools.append(tool)
    return tools


def test_a_claude_code_shaped_request_is_answered(tiny_server):
    """System blocks with cache_control, 15 tools, metadata, thinking with a budget, past
    tool_use / tool_result turns and fields mlxlis has no use for (speed, service_tier,
    context_management…): a 200 stream that ends with message_stop."""
    body = {
        "model": MODEL,
        "max_tokens": 24,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Work in /tmp."},
        ],
        "tools": claude_code_tools(),
        "metadata": {"user_id": "user_abc_account__session_1"},
        "thinking": {"type": "enabled", "budget_tokens": 8},
        "speed": "fast",
        "service_tier": "auto",
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look first.", "signature": "sig"},
                    {"type": "tool_use", "id": "toolu_9", "name": "Tool3", "input": {"path": "/a"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_9",
                        "content": [{"type": "text", "text": "file contents"}],
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking"}
    conn = tiny_server.connect()
    conn.request("POST", "/v1/messages", json.dumps(body).encode(), tiny_server.headers() | headers)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    got = sse(resp)
    conn.close()
    assert got[-1][0] == "message_stop" and got[-2][1]["delta"]["stop_reason"]


def test_refusals_name_the_field_in_anthropic_error_shape(client, tiny_server):
    """A wrong type, a missing max_tokens, a bad image block, an image to a text-only model,
    an Anthropic-defined tool, a budget over max_tokens and a tool_choice naming no offered
    tool are 400 invalid_request_error naming the field (this API's name); an unknown model is
    404 not_found_error; all in `{"type": "error", "error": {type, message}}`."""
    cases = [
        ({"max_tokens": "12"}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].source.type",
        ),
        (  # a well-formed image to a text-only model
            {"messages": [{"role": "user", "content": [{"type": "image", "source": PNG_SOURCE}]}]},
            "messages[0].content[0]",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 50}}, "thinking.budget_tokens"),
        ({"stop_sequences": [f"s{i}" for i in range(17)]}, "stop_sequences"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ]
    for change, field in cases:
        body = {"model": MODEL, "max_tokens": 12, "messages": HELLO, **change}
        body = {k: v for k, v in body.items() if v is not None}
        status, err = tiny_server.request("POST", "/v1/messages", body)
        assert status == 400 and err["type"] == "error", (change, err)
        assert err["error"]["type"] == "invalid_request_error", err
        assert err["error"]["message"].startswith(field), (field, err)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-9", max_tokens=5, messages=HELLO)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_a_queued_stream_starts_at_once_and_pings_until_it_runs(client, tiny_server):
    """While the batch is full (4 places, 4 endless completions), a streamed message gets
    message_start at once (usage: the whole prompt as input, nothing yet known to be cached)
    and a ping after each keep-alive interval (0.05 s here) of waiting; once a place frees, it
    streams its blocks and message_delta gives the prompt's true split, input plus cache-read
    equal to count_tokens."""
    long = {"prompt": "Hi", "ignore_eos": True, "max_tokens": 4000, "stream": True}
    holders = [tiny_server.open_stream("/v1/completions", long) for _ in range(4)]
    for _, resp in holders:
        resp.readline()  # its first event: it holds a place
    body = {"model": MODEL, "max_tokens": 8, "messages": HELLO, "stream": True}
    conn, resp = tiny_server.open_stream("/v1/messages", body)
    names, first = [], None
    while len(names) < 4:  # the waiting request's events, the batch still full
        line = resp.readline().decode().strip()
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            names.append(name)
            first = first or json.loads(line[6:])
    assert names == ["message_start", "ping", "ping", "ping"]
    assert tiny_server.request("GET", "/health")[1]["waiting"] == 1
    for c, _ in holders:
        c.close()
    rest = sse(resp)
    conn.close()
    prompt = client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens
    assert first["message"]["usage"]["input_tokens"] == prompt
    assert first["message"]["usage"]["cache_read_input_tokens"] == 0
    kinds = [n for n, _ in rest if n != "ping"]
    assert kinds[0] == "content_block_start" and kinds[-2:] == ["message_delta", "message_stop"]
    u = rest[-2][1]["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == prompt
    tiny_server.wait_idle()


def test_a_client_leaving_mid_stream_frees_its_request(tiny_server):
    """A streamed /v1/messages request abandoned after its first events: the engine lets it
    go (nothing runs or waits afterwards)."""
    body = {"model": MODEL, "max_tokens": 3000, "messages": HELLO, "stream": True}
    conn, resp = tiny_server.open_stream("/v1/messages", body)
    for _ in range(6):
        resp.readline()
    conn.close()
    tiny_server.wait_idle()
