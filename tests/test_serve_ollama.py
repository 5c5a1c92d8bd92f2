"""Ollama's API on `mlxlis serve`, the real process every API's tests share (a tiny random
Llama), driven by the official `ollama` Python client: its models parse every reply we send
(chat and generate, streamed and whole, the final counts, tags / show / ps / version), so a
client needs nothing else. The reference for the replies' content is the server's OpenAI
endpoint: the tiny model's noise is greedy noise, so the same request there gives the same
text and the same token counts (a stop string cuts at the same place); raw HTTP checks the
refusals' `{"error": ...}` shape, and a client that leaves mid-stream frees its request.
Qwen2.5-Coder (a catalog model, `extended`) makes a tool call and reads its result back
through the client.
"""

from __future__ import annotations

import json
import socket
from datetime import datetime, timedelta, timezone

import mlxlis

import jsonschema
import ollama
import pytest
from conftest import need_pulled
from serve_process import TINY_CONTEXT, TINY_TEMPLATE, ServeProcess

MODEL = "llama_long"
HELLO = [{"role": "user", "content": "Hello, world!"}]
GREEDY = {"temperature": 0, "num_predict": 12}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=120)


@pytest.fixture(scope="module")
def openai_client(server):
    return server.client()


def reference(openai_client, messages=HELLO, **kw):
    """The OpenAI endpoint's greedy reply to the same request."""
    kw.setdefault("max_tokens", GREEDY["num_predict"])
    return openai_client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, **kw
    )


def final_fields(r, tokens: int, model: str = MODEL) -> None:
    """The counts and durations of a reply's last object, as Ollama gives them, and the model
    named as the request named it."""
    assert r.done and r.eval_count == tokens and r.prompt_eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration > 0
    assert r.load_duration == 0 and r.model == model
    datetime.fromisoformat(r.created_at.replace("Z", "+00:00"))  # RFC 3339, in UTC


def test_chat_streamed_whole_and_as_the_openai_endpoint(client, openai_client):
    """/api/chat: the streamed deltas join to the whole reply, only the last object is done,
    and text, prompt tokens and reply tokens equal /v1/chat/completions' for the same
    request; "<name>:latest" is the same model."""
    whole = client.chat(model=MODEL, messages=HELLO, options=GREEDY)
    parts = list(client.chat(model=f"{MODEL}:latest", messages=HELLO, options=GREEDY, stream=True))
    assert whole.message.role == "assistant" and whole.message.content
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].message.content == "" and parts[-1].done_reason == whole.done_reason
    final_fields(whole, 12)
    final_fields(parts[-1], 12, f"{MODEL}:latest")
    ref = reference(openai_client)
    assert whole.message.content == ref.choices[0].message.content
    assert whole.done_reason == ref.choices[0].finish_reason == "length"
    assert whole.prompt_eval_count == ref.usage.prompt_tokens == parts[-1].prompt_eval_count
    assert whole.eval_count == ref.usage.completion_tokens


def test_generate_templated_and_raw(client, openai_client):
    """/api/generate renders system + prompt through the chat template (the chat endpoint's
    reply to those two turns); `raw` uses the prompt as it is, special tokens included, so the
    rendered prompt sent raw gives the same reply; an empty prompt answers "load"."""
    system = "Be brief."
    turns = [{"role": "system", "content": system}, *HELLO]
    g = client.generate(model=MODEL, prompt=HELLO[0]["content"], system=system, options=GREEDY)
    ref = reference(openai_client, turns)
    assert g.response == ref.choices[0].message.content
    assert g.prompt_eval_count == ref.usage.prompt_tokens
    final_fields(g, 12)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns)
    rendered += "<|im_start|>assistant\n"
    raw = client.generate(model=MODEL, prompt=rendered, raw=True, options=GREEDY)
    assert raw.response == g.response and raw.prompt_eval_count == g.prompt_eval_count
    parts = list(
        client.generate(model=MODEL, prompt=rendered, raw=True, options=GREEDY, stream=True)
    )
    assert "".join(p.response for p in parts) == g.response and parts[-1].done
    load = client.generate(model=MODEL)
    assert load.done and load.done_reason == "load" and load.response == ""


def test_think_splits_the_reasoning(client):
    """`think` reaches the template's enable_thinking: the reply (which never closes the
    <think> block it opens) is all `thinking`, streamed or not; a level ("high") is on too;
    think=false leaves it out."""
    r = client.chat(model=MODEL, messages=HELLO, options=GREEDY, think=True)
    assert r.message.thinking and r.message.content == ""
    parts = list(
        client.chat(model=MODEL, messages=HELLO, options=GREEDY, think="high", stream=True)
    )
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    off = client.chat(model=MODEL, messages=HELLO, options=GREEDY, think=False)
    assert off.message.thinking is None and off.message.content
    g = client.generate(model=MODEL, prompt="Hello, world!", options=GREEDY, think=True)
    assert g.thinking == r.message.thinking and g.response == ""


def test_tags_show_ps_version(server, client, tiny):
    """The served model as Ollama lists it: its tag, the weights' bytes, a digest, the
    details (safetensors, llama, the parameter count); show has the template, the server's
    context and the capabilities the template gives; ps has it loaded for good;
    the version is mlxlis's, and `/` answers as Ollama's does."""
    folder, hf = tiny(MODEL)
    (m,) = client.list().models
    assert m.model == f"{MODEL}:latest" and len(m.digest) == 64
    assert m.size == sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert m.details.format == "safetensors" and m.details.family == "llama"
    assert m.details.families == ["llama"]
    assert m.details.quantization_level in ("F32", "F16", "BF16")  # the dtype it runs in
    count = sum(p.numel() for p in hf.parameters())
    assert m.details.parameter_size == (
        f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count / 1e3:.0f}K"
    )
    show = client.show(MODEL)
    assert show.template == TINY_TEMPLATE and set(show.capabilities) == {
        "completion",
        "tools",
        "thinking",
    }
    info = show.modelinfo
    assert info["general.architecture"] == "llama" and info["general.parameter_count"] == count
    assert info["llama.context_length"] == TINY_CONTEXT and "num_ctx" in show.parameters
    assert show.details.family == "llama" and str(server.model) in show.modelfile
    (p,) = client.ps().models
    assert p.name == p.model == f"{MODEL}:latest" and p.size > 0
    assert p.size_vram in (0, p.size)  # 0 on the CPU
    assert p.expires_at > datetime.now(timezone.utc) + timedelta(days=365 * 20)
    assert p.context_length == TINY_CONTEXT and p.digest == m.digest
    # the client has no version(): the CLI's `ollama -v` asks for it
    assert server.request("GET", "/api/version") == (200, {"version": mlxlis.__version__})
    for method in ("GET", "HEAD"):
        conn = server.connect()
        conn.request(method, "/")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == (
            b"Ollama is running" if method == "GET" else b""
        )
        conn.close()


def test_format_json_and_schema(client, openai_client):
    """`format`: a schema gives a reply that validates with jsonschema, streamed or not, ending
    "stop"; "json" a JSON object, the same as /v1/completions' json_object on the same prompt
    (raw: a prompt as /v1/completions reads it)."""
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "w": {"enum": ["up", "down"]},
        },
        "required": ["n", "w"],
        "additionalProperties": False,
    }
    opts = {"temperature": 0, "num_predict": 40}
    r = client.chat(model=MODEL, messages=HELLO, options=opts, format=schema)
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)
    parts = list(client.chat(model=MODEL, messages=HELLO, options=opts, format=schema, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    opts = {"temperature": 0, "num_predict": 60}
    g = client.generate(model=MODEL, prompt="Data:", raw=True, options=opts, format="json")
    assert g.done_reason == "stop" and isinstance(json.loads(g.response), dict)
    ref = openai_client.completions.create(
        model=MODEL,
        prompt="Data:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert g.response == ref.choices[0].text and g.prompt_eval_count == ref.usage.prompt_tokens


def test_stop_cuts_as_the_openai_endpoint_does(client, openai_client):
    """options.stop ends the reply before the stop string exactly where /v1/chat/completions'
    stop does, streamed or not, with done_reason "stop"."""
    opts = {"temperature": 0, "num_predict": 40}
    full = client.chat(model=MODEL, messages=HELLO, options=opts).message.content
    stop = next(
        full[i : i + 2]
        for i in range(4, len(full) - 2)
        if "\ufffd" not in full[i : i + 2] and full[i : i + 2].strip()
    )
    want = reference(openai_client, max_tokens=40, stop=[stop]).choices[0].message.content
    assert want == full[: full.index(stop)]
    r = client.chat(model=MODEL, messages=HELLO, options={**opts, "stop": [stop]})
    assert r.message.content == want and r.done_reason == "stop"
    parts = list(
        client.chat(model=MODEL, messages=HELLO, options={**opts, "stop": [stop]}, stream=True)
    )
    assert "".join(p.message.content for p in parts) == want


def test_tools_reach_the_template(client):
    """`tools` are rendered by the template (the prompt grows by the tool list), and a past
    call with object arguments and its `tool` result render back through it."""
    plain = client.chat(model=MODEL, messages=HELLO, options={"num_predict": 1})
    with_tools = client.chat(model=MODEL, messages=HELLO, tools=WEATHER, options={"num_predict": 1})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [
        *HELLO,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "18 C", "tool_name": "get_weather"},
    ]
    r = client.chat(model=MODEL, messages=history, tools=WEATHER, options={"num_predict": 1})
    assert r.prompt_eval_count > with_tools.prompt_eval_count


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/api/chat", {"options": {"temperature": "hot"}}, "options.temperature"),
        ("/api/chat", {"options": {"top_p": 2.0}}, "options.top_p"),
        ("/api/chat", {"options": {"num_predict": 0}}, "options.num_predict"),
        ("/api/chat", {"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
        ("/api/chat", {"options": {"stop": "x"}}, "options.stop"),
        ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/api/chat", {"messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
        ("/api/chat", {"think": "maybe"}, "think"),
        ("/api/chat", {"format": "xml"}, "format"),
        ("/api/chat", {"stream": "yes"}, "stream"),
        ("/api/chat", {"tools": [{"type": "function"}]}, "tools[0].function"),
        ("/api/generate", {"suffix": "return x"}, "suffix"),
        ("/api/generate", {"template": "{{ .Prompt }}"}, "template"),
        ("/api/generate", {"context": [1, 2, 3]}, "context"),
        ("/api/generate", {"images": ["aGVsbG8="]}, "images[0]"),  # a text-only model
        ("/api/generate", {"raw": True, "system": "x"}, "system"),
    ],
)
def test_refusals_name_the_field_in_ollamas_shape(server, path, body, param):
    """A body Ollama would refuse, or one asking for what this server cannot do: a 400 whose
    only field is `error`, starting with the field's name as Ollama calls it."""
    base = (
        {"model": MODEL, "messages": HELLO}
        if path == "/api/chat"
        else {"model": MODEL, "prompt": "Hi"}
    )
    status, got = server.request("POST", path, {**base, "stream": False, **body})
    assert status == 400 and set(got) == {"error"}, got
    assert got["error"].startswith(f"{param}:"), got


def test_logprobs_as_the_openai_endpoint(client, openai_client):
    """logprobs with top_logprobs=3: one entry per reply token with three alternatives, the
    same tokens and values as /v1/chat/completions' logprobs, streamed or not; raw generate
    gives them too."""
    r = client.chat(model=MODEL, messages=HELLO, options=GREEDY, logprobs=True, top_logprobs=3)
    ref = reference(openai_client, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert [e.token for e in r.logprobs] == [e.token for e in ref]
    assert [e.logprob for e in r.logprobs] == pytest.approx([e.logprob for e in ref], abs=1e-5)
    assert all(len(e.top_logprobs) == 3 for e in r.logprobs) and len(r.logprobs) == 12
    parts = client.chat(
        model=MODEL, messages=HELLO, options=GREEDY, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [e for p in parts for e in p.logprobs or []]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in r.logprobs], abs=1e-5)
    g = client.generate(
        model=MODEL, prompt="The quick brown", raw=True, options=GREEDY, logprobs=True
    )
    assert len(g.logprobs) == 12 and "".join(e.token for e in g.logprobs) == g.response


def test_images_and_unknown_models_through_the_client(client):
    """The client's errors: images on a message are a 400 naming messages[0].images[0] (a text
    model); an unknown model is a 404 worded as Ollama words it."""
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{**HELLO[0], "images": ["aGVsbG8="]}])
    assert e.value.status_code == 400 and e.value.error.startswith("messages[0].images[0]:")
    for call in (
        lambda: client.chat(model="nope", messages=HELLO),
        lambda: client.generate(model="nope", prompt="Hi"),
        lambda: client.show("nope"),
    ):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"


def test_a_client_that_leaves_frees_its_request(server):
    """A client that leaves mid-stream (NDJSON, one object a line) cancels its request: the
    log has it cancelled after a few tokens of thousands, and the engine holds nothing."""
    seen = len(server.log().splitlines())
    body = {"model": MODEL, "messages": HELLO, "options": {"num_predict": TINY_CONTEXT - 64}}
    conn, resp = server.open_stream("/api/chat", body)
    assert resp.getheader("content-type") == "application/x-ndjson"
    for _ in range(5):
        assert json.loads(resp.readline())["done"] is False
    conn.sock.shutdown(socket.SHUT_RDWR)
    resp.close()
    conn.close()
    server.wait_idle()
    line = server.log_line(r"ollama-\w+ cancelled ", skip=seen)
    assert int(line.split("generated=")[1].split()[0]) < TINY_CONTEXT // 2, line


@pytest.mark.real
@pytest.mark.extended
def test_qwen_tool_round_trip(tmp_path_factory):
    """Qwen2.5-Coder through the client: listed as Ollama lists a GGUF (630.17M parameters with
    its untied head, Q4_K_M, qwen2); asked for the weather with get_weather offered, it
    calls it (arguments as an object), streamed or not; given the tool's result after its
    call, it answers with the result (a 0.5B model echoes it rather than phrasing it)."""
    name = "qwen2.5-coder-0.5b"
    need_pulled(name)
    srv = ServeProcess(tmp_path_factory.mktemp("qwen_ollama"), "-m", name)
    try:
        client = ollama.Client(host=f"http://127.0.0.1:{srv.port}", timeout=300)
        (m,) = client.list().models
        assert m.model == f"{name}:latest" and m.size == need_pulled(name).stat().st_size
        assert (m.details.format, m.details.family) == ("gguf", "qwen2")
        assert (m.details.parameter_size, m.details.quantization_level) == ("630.17M", "Q4_K_M")
        assert "tools" in client.show(name).capabilities
        opts = {"temperature": 0, "num_predict": 60}
        ask = [
            {"role": "user", "content": "What's the weather in Paris? Use the get_weather tool."}
        ]
        r = client.chat(model=name, messages=ask, tools=WEATHER, options=opts)
        (call,) = r.message.tool_calls
        assert call.function.name == "get_weather" and r.done_reason == "stop"
        assert call.function.arguments["city"].lower().startswith("paris")
        parts = list(
            client.chat(model=name, messages=ask, tools=WEATHER, options=opts, stream=True)
        )
        assert [c.function for p in parts for c in p.message.tool_calls or []] == [call.function]
        result = {
            "role": "tool",
            "content": json.dumps({"celsius": 18}),
            "tool_name": "get_weather",
        }
        r2 = client.chat(
            model=name, messages=[*ask, r.message, result], tools=WEATHER, options=opts
        )
        assert r2.done_reason == "stop" and "18" in r2.message.content
        assert r2.prompt_eval_count > r.prompt_eval_count
    finally:
        assert srv.stop() == 0, srv.log()
