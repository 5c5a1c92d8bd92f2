"""OpenAI's Responses API on `mlxlis serve`, driven by the official `openai` client (its types
parse every response and stream event), on the tiny random Llama (greedy noise: the same
request gives the same tokens). The reference is the server's Chat Completions: the same
conversation (instructions, a stored previous response, function calls and their outputs)
gives the same prompt and tokens; the stream's events come in the API's order with
consecutive sequence numbers and the client's helper rebuilds the response; the store
answers GET / DELETE and previous_response_id; namespace tools are offered by a name that
maps back, their calls returned with `namespace` apart; refusals name the field. Last, one
conversation through all four APIs gives the same tokens.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import ollama
import openai
import pytest
from openai.types.responses import ResponseFunctionToolCall

MODEL = "llama_long"
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 3}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS}


@pytest.fixture(scope="module")
def client(tiny_server):
    return tiny_server.client()


def prompt_tokens(client, messages, **kw) -> tuple[int, str]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **kw)
    return r.usage.prompt_tokens, r.choices[0].message.content or ""


def test_same_prompt_and_tokens_as_chat_completions(client):
    """instructions + a string input: the text and prompt count of the same system + user
    messages through Chat Completions; output_tokens the completion count; a reply cut at
    max_output_tokens is "incomplete" with that reason."""
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hello, world!", max_output_tokens=10
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world!"},
    ]
    n, text = prompt_tokens(client, messages)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == text and r.usage.input_tokens == n
    assert r.usage.output_tokens == 10 and r.usage.total_tokens == n + 10
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text"


def test_stream_events_and_the_helper(client):
    """Streamed: response.created, response.in_progress, then the message item (added, part
    added, text deltas, text done, part done, item done) and response.incomplete, sequence
    numbers 0, 1, 2, …; the deltas join to the whole response's text; the client's stream
    helper ends with the same response."""
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=12)
    events = list(
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=12, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    final_kind = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final_kind,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=12) as s:
        last = list(s)[-1]  # (get_final_response wants "completed": this one is cut)
    assert last.type == final_kind and last.response.output_text == whole.output_text


def test_previous_response_id_store_get_and_delete(client, tiny_server):
    """previous_response_id continues a stored conversation: the prompt is that of the whole
    conversation sent to Chat Completions; GET returns the stored response, DELETE removes
    it (then GET and previous_response_id are 404); store=false keeps nothing."""
    first = client.responses.create(model=MODEL, input="Hello, world!", max_output_tokens=8)
    second = client.responses.create(
        model=MODEL, input="And again?", previous_response_id=first.id, max_output_tokens=10
    )
    messages = [
        {"role": "user", "content": "Hello, world!"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And again?"},
    ]
    n, text = prompt_tokens(client, messages)
    assert second.usage.input_tokens == n and second.output_text == text
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    for call in (
        lambda: client.responses.retrieve(second.id),
        lambda: client.responses.create(model=MODEL, input="x", previous_response_id=second.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_call_round_trip(client):
    """A forced function tool: one function_call item (arguments valid for the schema,
    jsonschema), streamed as arguments deltas; its function_call_output sent back with
    previous_response_id gives the prompt of the same conversation in Chat Completions."""
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(
        model=MODEL, input="Weather?", tools=[TOOL], tool_choice=choice, max_output_tokens=150
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
    follow = client.responses.create(
        model=MODEL, input=[out], previous_response_id=r.id, tools=[TOOL], max_output_tokens=10
    )
    fn = {"name": "get_weather", "arguments": call.arguments}
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call.call_id, "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    n, _ = prompt_tokens(client, messages, tools=[chat_tool])
    assert follow.usage.input_tokens == n
    streamed = list(
        client.responses.create(
            model=MODEL,
            input="Weather?",
            tools=[TOOL],
            tool_choice=choice,
            max_output_tokens=150,
            stream=True,
        )
    )
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments


SPAWN = {
    "type": "function",
    "name": "spawn_agent",
    "description": "Spawns an agent",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"message": {"type": "string", "maxLength": 4}},
        "required": ["message"],
        "additionalProperties": False,
    },
}
AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Agents working beside you",
    "tools": [SPAWN, {**SPAWN, "name": "wait", "description": "Waits for agents"}],
}


def test_namespace_tools_are_offered_and_their_calls_come_back_named_apart(client):
    """A namespace of function tools beside plain ones (Codex's request: tools[4] is its
    multi_agent_v1 namespace) is taken: a call forced to its function comes back as the
    client's ResponseFunctionToolCall with `name` and `namespace` apart, streamed the same
    (the items' events, the arguments' done event named as the item); the call sent back
    with its namespace (stored, or as an input item) gives the prompt of Chat Completions
    with the function offered and called as `multi_agent_v1.spawn_agent`."""
    tools = [{**TOOL, "name": f"tool{i}"} for i in range(4)] + [AGENTS]
    choice = {"type": "function", "name": "spawn_agent"}  # the function's own name
    kw = {"tools": tools, "tool_choice": choice, "max_output_tokens": 150}
    r = client.responses.create(model=MODEL, input="Delegate.", **kw)
    (call,) = r.output
    assert isinstance(call, ResponseFunctionToolCall) and call.type == "function_call"
    assert (call.namespace, call.name) == ("multi_agent_v1", "spawn_agent")
    jsonschema.validate(json.loads(call.arguments), SPAWN["parameters"])
    events = list(client.responses.create(model=MODEL, input="Delegate.", stream=True, **kw))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.namespace, i.name, i.arguments) for i in done] == [
        ("multi_agent_v1", "spawn_agent", call.arguments)
    ]
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args_done.name == "spawn_agent" and args_done.arguments == call.arguments
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "started"}
    follow = client.responses.create(
        model=MODEL, input=[out], previous_response_id=r.id, tools=tools, max_output_tokens=4
    )
    spaced = "multi_agent_v1.spawn_agent"
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in tools[:4]
    ] + [
        {
            "type": "function",
            "function": {
                **{k: v for k, v in t.items() if k != "type"},
                "name": f"multi_agent_v1.{t['name']}",
                "description": f"{AGENTS['description']}\n\n{t['description']}",
            },
        }
        for t in AGENTS["tools"]
    ]
    fn = {"name": spaced, "arguments": call.arguments}
    messages = [
        {"role": "user", "content": "Delegate."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call.call_id, "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "started"},
    ]
    n, _ = prompt_tokens(client, messages, tools=chat_tools)
    assert follow.usage.input_tokens == n
    sent = client.responses.create(  # the whole conversation sent back, as Codex does
        model=MODEL,
        input=[{"role": "user", "content": "Delegate."}, call.model_dump(exclude_none=True), out],
        tools=tools,
        max_output_tokens=4,
        store=False,
    )
    assert sent.usage.input_tokens == n


def test_a_codex_shaped_request_is_answered(client):
    """Instructions, developer and user message items with input_text parts, function tools
    with strict false, reasoning effort and summary, store false, include, prompt_cache_key
    and text verbosity: a streamed response that completes."""
    events = list(
        client.responses.create(
            model=MODEL,
            instructions="You are a coding agent running in a terminal.",
            input=[
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "Sandbox: read-only."}],
                },
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "List the files."}],
                },
            ],
            tools=[
                {
                    "type": "function",
                    "name": "shell",
                    "description": "Runs a shell command",
                    "strict": False,
                    "parameters": {
                        "type": "object",
                        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                        "required": ["command"],
                        "additionalProperties": False,
                    },
                }
            ],
            tool_choice="auto",
            parallel_tool_calls=False,
            reasoning={"effort": "medium", "summary": "auto"},
            store=False,
            stream=True,
            include=["reasoning.encrypted_content"],
            prompt_cache_key="session-1",
            max_output_tokens=16,
            extra_body={"text": {"verbosity": "medium"}},
        )
    )
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_refusals_name_the_field(client, tiny_server):
    """A hosted tool, an image part, a wrong type, a bad tool_choice (one naming no offered
    function, or none), two tools offered under one name and a namespace's custom tool are
    400s naming the field (this API's name for it) in OpenAI's error shape; text.format's
    schema is enforced (the reply validates)."""
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",  # a text-only model
        ),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"tool_choice": {"type": "file_search"}, "tools": [TOOL]}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]},
            "tool_choice.name",
        ),
        ({"tool_choice": {"type": "function"}, "tools": [TOOL]}, "tool_choice.name"),
        (  # two tools offered to the model under one name: no way back to one
            {"tools": [{**TOOL, "name": "multi_agent_v1.wait"}, AGENTS]},
            "tools[1].tools[1].name",
        ),
        (
            {"tools": [{**AGENTS, "tools": [{"type": "custom", "name": "x"}]}]},
            "tools[0].tools[0].type",
        ),
    ]
    for change, field in cases:
        status, err = tiny_server.request(
            "POST", "/v1/responses", {"model": MODEL, "input": "Hi", **change}
        )
        assert status == 400 and err["error"]["param"] == field, (change, err)
    n = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {
        "type": "object",
        "properties": {"n": n},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="A number",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)


def test_the_four_apis_give_the_same_tokens(client, tiny_server):
    """One conversation (a system prompt, a user turn) through Chat Completions, Messages,
    Responses and Ollama's /api/chat: the same greedy text."""
    system, user = "Be brief.", "Hello, world!"
    chat = (
        client.chat.completions.create(
            model=MODEL,
            max_tokens=12,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        )
        .choices[0]
        .message.content
    )
    url = f"http://127.0.0.1:{tiny_server.port}"
    msg = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
        model=MODEL, max_tokens=12, system=system, messages=[{"role": "user", "content": user}]
    )
    resp = client.responses.create(
        model=MODEL, instructions=system, input=user, max_output_tokens=12
    )
    oll = ollama.Client(host=url).chat(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        options={"num_predict": 12, "temperature": 0},
    )
    assert chat == msg.content[0].text == resp.output_text == oll.message.content


def test_reasoning_effort_switches_thinking(client):
    """reasoning.effort reaches the template's enable_thinking: "high" opens the reasoning in
    the prompt (a reasoning item, its text streamed as reasoning_text deltas; usage counts its
    tokens), "low" leaves it out (fewer prompt tokens, a message item)."""
    high = client.responses.create(
        model=MODEL, input="Hi", reasoning={"effort": "high"}, max_output_tokens=10
    )
    low = client.responses.create(
        model=MODEL, input="Hi", reasoning={"effort": "low"}, max_output_tokens=10
    )
    assert [o.type for o in high.output] == ["reasoning"] and high.output[0].content[0].text
    assert high.usage.output_tokens_details.reasoning_tokens == 10
    assert [o.type for o in low.output] == ["message"]
    assert high.usage.input_tokens > low.usage.input_tokens
    events = list(
        client.responses.create(
            model=MODEL, input="Hi", reasoning={"effort": "high"}, max_output_tokens=10, stream=True
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == high.output[0].content[0].text
