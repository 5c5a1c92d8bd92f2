"""`mlxlis serve` as a real process on a tiny random Llama, driven by the official `openai`
client (and raw HTTP where a client would refuse to send the request): response shapes,
streaming, stop strings, logprobs, usage and the prefix cache, reasoning, tools reaching the
template, every 4xx answer, and a client that leaves mid-stream.

The tiny model's replies are noise, but greedy noise: the same request gives the same tokens,
so streamed and whole replies, stopped and unstopped ones, can be compared exactly.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import mlxlis

import openai
import pytest
from serve_process import TINY_CONTEXT as CONTEXT
from serve_process import events

HELLO = [{"role": "user", "content": "Hello, world!"}]
LONG = {"ignore_eos": True, "max_tokens": CONTEXT - 64, "stream": True}  # runs until stopped


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kw):
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model="llama_long", **kw)


def test_models_and_health(server, client):
    """/v1/models lists the served model under the name it was started with (a folder: its
    last part) with its context bound; /health answers without a key and shows no work."""
    models = client.models.list().data
    assert [m.id for m in models] == ["llama_long"]
    assert models[0].model_extra["context_length"] == CONTEXT
    assert client.models.retrieve("llama_long").id == "llama_long"
    status, health = server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["running"] == 0


def test_chat_completion_shape(client):
    """A whole chat response has OpenAI's fields: chatcmpl- id, created, model, a
    system_fingerprint, one choice with the assistant message, finish_reason "length" at
    max_tokens, and usage whose completion count is max_tokens."""
    r = chat(client, max_tokens=9)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == "llama_long" and r.system_fingerprint.startswith("fp_")
    assert isinstance(r.created, int) and len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and c.message.content
    assert c.finish_reason == "length" and c.logprobs is None
    u = r.usage
    assert u.completion_tokens == 9 and u.total_tokens == u.prompt_tokens + 9
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_structured_output_through_the_openai_client(client):
    """response_format json_schema (chat, streamed and not) and json_object (completions) on
    the tiny model's noise: each reply ends "stop" and validates with jsonschema (the
    reference validator); the streamed pieces join to the whole."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "w": {"enum": ["up", "down"]},
        },
        "required": ["n", "w"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    r = chat(client, max_tokens=40, response_format=rf)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = list(chat(client, max_tokens=40, response_format=rf, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    c = client.completions.create(
        model="llama_long",
        prompt="Data:",
        max_tokens=60,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert c.choices[0].finish_reason == "stop" and isinstance(json.loads(c.choices[0].text), dict)


def test_chat_stream_equals_whole(client):
    """A streamed chat reply is the whole reply in pieces: the first delta is the assistant
    role, the deltas join to the same content, one chunk carries finish_reason, and with
    include_usage a last chunk without choices carries the usage; every chunk has the id."""
    whole = chat(client)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["length"] and finishes[-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_whole_and_token_prompt(server, client):
    """/v1/completions: a text prompt and the same prompt as token ids give the same greedy
    text, streamed or whole; the shape is text_completion with a cmpl- id."""
    r = client.completions.create(model="llama_long", prompt="The quick brown", max_tokens=10)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    stream = client.completions.create(
        model="llama_long", prompt="The quick brown", max_tokens=10, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text
    ids = mlxlis.load_tokenizer(server.model).encode("The quick brown")
    by_ids = client.completions.create(model="llama_long", prompt=ids, max_tokens=10)
    assert by_ids.choices[0].text == r.choices[0].text
    assert by_ids.usage.prompt_tokens == r.usage.prompt_tokens == len(ids)


def test_stop_strings(client):
    """A stop string ends the reply before it (matched across token boundaries, never
    emitted), streamed or not, with finish_reason "stop"; a stop string that never occurs
    changes nothing."""
    full = chat(client, max_tokens=40).choices[0].message.content
    stop = next(
        full[i : i + 2]
        for i in range(4, len(full) - 2)
        if "\ufffd" not in full[i : i + 2] and full[i : i + 2].strip()
    )
    want = full[: full.index(stop)]
    r = chat(client, max_tokens=40, stop=[stop, "never-in-noise"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(chat(client, max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    """logprobs with top_logprobs=3: one entry per generated token, each with three
    alternatives in descending order, and (greedy) the chosen token is the most likely one;
    the tokens' bytes join into the reply."""
    r = chat(client, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.logprob <= 0 and e.logprob == pytest.approx(tops[0], abs=1e-6)
    # each token's own bytes, joined, are the reply (a token may hold part of a character)
    joined = bytes(b for e in content for b in e.bytes)
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content
    chunks = [c.choices[0] for c in chat(client, logprobs=True, stream=True) if c.choices]
    streamed = [e for c in chunks for e in (c.logprobs.content if c.logprobs else [])]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_completion_logprobs(client):
    """/v1/completions logprobs=2: parallel token / logprob / top lists, one per token, and
    text offsets that never go back."""
    r = client.completions.create(model="llama_long", prompt="Hello", max_tokens=8, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_second_turn_uses_the_prefix_cache(client, server):
    """The second turn of a conversation reuses the first turn's cached prefix:
    usage.prompt_tokens_details.cached_tokens is > 0 and below the prompt's length; the
    --verbose log says, for that request, how much of its prompt a cached entry shared and
    how much was reused."""
    first = chat(client, messages=[{"role": "user", "content": "Tell me about Émile."}])
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    messages = [
        {"role": "user", "content": "Tell me about Émile."},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the fox?"},
    ]
    second = chat(client, messages=messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    n = second.usage.prompt_tokens
    server.log_line(
        rf"{second.id} reuse: prefix \d+/{n} shared with a cached entry; reused {cached}"
    )


def test_reasoning_content(client):
    """chat_template_kwargs reach the template: enable_thinking=true opens a <think> block
    in the prompt, so the reply is reasoning (message.reasoning_content, delta.reasoning_content)
    and no content; without it, the reply is content only."""
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    r = chat(client, extra_body=think)
    assert r.choices[0].message.model_extra["reasoning_content"]
    assert r.choices[0].message.content == ""
    chunks = list(chat(client, extra_body=think, stream=True))
    streamed = "".join(
        c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks
    )
    assert streamed == r.choices[0].message.model_extra["reasoning_content"]
    plain = chat(client)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    assert plain.choices[0].message.content


def test_tools_reach_the_template(client):
    """`tools` are rendered by the template (the prompt grows by the tool list); an assistant
    tool call and a `tool` result message render back through it; tool_choice "none" leaves
    the tools out."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    plain = chat(client, max_tokens=1)
    with_tools = chat(client, max_tokens=1, tools=tools)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    none = chat(client, max_tokens=1, tools=tools, tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    messages = HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert chat(client, max_tokens=1, tools=tools, messages=messages).choices[0].message


def test_no_op_and_unknown_fields_are_accepted(server):
    """A field accepted as a no-op (user: docs/api-fields.md) and one no API has (another
    server's extension) do not fail the request."""
    body = {
        "messages": HELLO,
        "max_tokens": 2,
        "user": "u1",
        "made_up_field": {"x": 1},
    }
    status, r = server.request("POST", "/v1/chat/completions", body)
    assert status == 200 and r["choices"][0]["finish_reason"] == "length"


BAD_CHAT = [  # (changes to a good chat body, the field the 400 must name)
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"n": 5}, "n"),  # past the server's batch of 4
    ({"n": 0}, "n"),
    ({"n": 10**12}, "n"),
    ({"stop": 5}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].image_url",  # the part its type needs
    ),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    (
        {"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",
    ),
    (
        {
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "tool_choice.function.name",
    ),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "array", "uniqueItems": True}},
                    },
                },
            }
        },
        "response_format.json_schema.schema.properties.a.uniqueItems",
    ),
    ({"response_format": {"type": "regex", "regex": "(ab"}}, "response_format.regex"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
]
BAD_COMPLETION = [
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"echo": True}, "echo"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.json_schema.schema",
    ),
    ({"best_of": 5}, "best_of"),  # past the server's batch of 4
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
]


@pytest.mark.parametrize(
    ("path", "changes", "param"),
    [("/v1/chat/completions", c, p) for c, p in BAD_CHAT]
    + [("/v1/completions", c, p) for c, p in BAD_COMPLETION],
)
def test_bad_values_are_400_naming_the_field(server, path, changes, param):
    """A bad value (wrong type, out of range, n past the batch, malformed message) gets a 400
    with OpenAI's error body whose `param` names the field and whose message says what a
    good value is; the server keeps serving."""
    good = {"messages": HELLO} if "chat" in path else {"prompt": "Hi"}
    status, body = server.request("POST", path, {**good, "max_tokens": 2, **changes})
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"] and "code" in err


def test_malformed_and_non_object_json_are_400(server):
    """A body that is not JSON, or JSON that is not an object, gets a 400 error body."""
    for raw in (b'{"messages": [', b"", b"[1, 2]", b'"text"'):
        status, body = server.request("POST", "/v1/chat/completions", raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", raw


def test_body_size_is_bounded_413(server):
    """A body over the server's bound (8 MiB) is refused with 413 before it is parsed."""
    big = json.dumps({"prompt": "x" * (9 << 20), "max_tokens": 1}).encode()
    status, body = server.request("POST", "/v1/completions", big)
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_unknown_model_is_404(server, client):
    """A model name the server does not run gets 404 model_not_found (chat, completions and
    /v1/models/NAME); leaving `model` out means the served one."""
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=HELLO, max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    status, _ = server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 200


def test_context_length_is_never_exceeded(server, client):
    """A prompt longer than --max-context gets 400 context_length_exceeded (never truncated);
    a max_tokens over what the context leaves is a ceiling (without --strict-context): the
    reply stops at the context's end with finish_reason "length", and the cut is logged;
    without max_tokens, a long prompt's reply is bounded by what is left of the context."""
    long_text = "naïve café 🙂 " * 1500
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llama_long", prompt=long_text, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    seen = len(server.log().splitlines())
    ids = [5 + i % 300 for i in range(CONTEXT - 6)]
    body = {"prompt": ids, "ignore_eos": True, "max_tokens": 32000}
    status, body = server.request("POST", "/v1/completions", body)
    assert status == 200 and body["usage"]["total_tokens"] == CONTEXT
    assert body["choices"][0]["finish_reason"] == "length"
    assert "max_tokens 32000 cut to 6: the context (4096 tokens) holds a prompt of 4090" in (
        server.log_line("cut to", skip=seen)
    )
    ids = [5 + i % 300 for i in range(CONTEXT - 9)]
    status, body = server.request("POST", "/v1/completions", {"prompt": ids, "ignore_eos": True})
    assert status == 200 and body["usage"]["total_tokens"] == CONTEXT
    assert body["choices"][0]["finish_reason"] == "length"


def test_client_disconnect_cancels_only_that_request(server, client):
    """A client that leaves mid-stream cancels its request within a step (logged as cancelled
    after a few tokens of thousands, and the engine holds nothing afterwards), while a
    request running beside it finishes with exactly the reply it gets alone."""
    alone = chat(client, max_tokens=30).choices[0].message.content
    conn, resp = server.open_stream("/v1/chat/completions", {"messages": HELLO, **LONG})
    it = events(resp)
    rid = next(it)["id"]
    for _ in range(5):
        next(it)
    beside = {}
    t = threading.Thread(target=lambda: beside.update(r=chat(client, max_tokens=30)))
    t.start()
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client leaves
    resp.close()
    conn.close()
    t.join(120)
    assert beside["r"].choices[0].message.content == alone
    server.wait_idle()
    line = server.log_line(rf"{rid} \w+ prompt=")  # its end line (--verbose logs its start)
    assert " cancelled " in line, line
    generated = int(line.split("generated=")[1].split()[0])
    assert generated < LONG["max_tokens"] // 2, line


def test_client_disconnect_cancels_a_whole_request(server):
    """A client that leaves while waiting for a non-streamed reply cancels it too: the
    engine lets it go long before its thousands of tokens, and logs it as cancelled."""
    seen = len(server.log().splitlines())
    conn = server.connect()
    body = {"messages": HELLO, **LONG, "stream": False}
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), server.headers())
    deadline = time.monotonic() + 60
    while server.request("GET", "/health")[1]["running"] == 0:  # until it runs
        assert time.monotonic() < deadline
        time.sleep(0.01)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    server.wait_idle()
    line = server.log_line(r"chatcmpl-\w+ cancelled ", skip=seen)
    assert int(line.split("generated=")[1].split()[0]) < LONG["max_tokens"] // 2, line
