"""`mlxlis serve` on catalog models, through the official `openai` client: SmolLM2 answers a
question through its own template, streamed and whole alike, and reuses the prefix cache on
the second turn; Qwen2.5-Coder's template takes `tools` and its call comes back as
message.tool_calls (whole) and delta.tool_calls (streamed)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import need_pulled
from serve_process import ServeProcess

pytestmark = pytest.mark.real

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
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


def serve(name: str, tmp_path_factory):
    need_pulled(name)
    srv = ServeProcess(tmp_path_factory.mktemp(name), "-m", name)
    return srv, srv.client()


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    srv, client = serve("smollm2-135m", tmp_path_factory)
    yield client
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    srv, client = serve("qwen2.5-coder-0.5b", tmp_path_factory)
    yield client
    assert srv.stop() == 0, srv.log()


def test_smollm_knows_paris_streamed_or_not(smollm):
    """SmolLM2 (ChatML template from its GGUF) answers "What is the capital of France?" with
    Paris; the streamed reply is the same text (greedy), ending with finish_reason "stop"."""
    r = smollm.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=40)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].finish_reason == "stop"
    chunks = list(
        smollm.chat.completions.create(
            model="smollm2-135m", messages=QUESTION, max_tokens=40, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_smollm_second_turn_is_cached(smollm):
    """A second turn that repeats the first turn's conversation reports cached prompt tokens
    (the prefix cache): at least the whole first prompt."""
    first = smollm.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=40)
    messages = [
        *QUESTION,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = smollm.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=20)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


def anthropic_client(client):
    import anthropic

    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.extended  # the adapter is proved on the tiny model in make test
def test_smollm_through_anthropic_messages(smollm):
    """Anthropic's client on SmolLM2: the same greedy answer (Paris) as Chat Completions,
    whole and streamed."""
    client = anthropic_client(smollm)
    r = client.messages.create(model="smollm2-135m", messages=QUESTION, max_tokens=40)
    o = smollm.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=40)
    assert r.content[0].text == o.choices[0].message.content and "Paris" in r.content[0].text
    with client.messages.stream(model="smollm2-135m", messages=QUESTION, max_tokens=40) as s:
        assert s.get_final_message().content[0].text == r.content[0].text


@pytest.mark.extended  # the adapter is proved on the tiny model in make test
def test_qwen_tool_round_trip_through_anthropic_messages(qwen):
    """Anthropic's client on Qwen2.5-Coder, the conversation of test_qwen_tool_call: a
    tool_use block get_weather({"city": "Paris"}) ending the turn with "tool_use"; its
    tool_result sent back is answered with the same text as Chat Completions gives the same
    conversation, ending the turn."""
    client = anthropic_client(qwen)
    tool = WEATHER[0]["function"]
    tools = [{"name": tool["name"], "description": tool["description"], "input_schema": PARAMS}]
    ask = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    r = client.messages.create(model="qwen2.5-coder-0.5b", messages=ask, tools=tools, max_tokens=60)
    assert r.stop_reason == "tool_use", r.content
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"sky": "sunny"}'}
    answer = client.messages.create(
        model="qwen2.5-coder-0.5b",
        messages=[
            *ask,
            {"role": "assistant", "content": r.content},
            {"role": "user", "content": [result]},
        ],
        tools=tools,
        max_tokens=40,
    )
    call = {
        "id": use.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    same = qwen.chat.completions.create(
        model="qwen2.5-coder-0.5b",
        messages=[
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": use.id, "content": '{"sky": "sunny"}'},
        ],
        tools=WEATHER,
        max_tokens=40,
    )
    assert answer.stop_reason == "end_turn" and answer.content[0].type == "text", answer
    assert answer.content[0].text == same.choices[0].message.content


def test_smollm_template_without_tools_refuses_them(smollm):
    """SmolLM2's template has no place for tools: a request with tools gets a 400 naming
    `tools` instead of a prompt that silently leaves them out."""
    with pytest.raises(openai.BadRequestError) as e:
        smollm.chat.completions.create(
            model="smollm2-135m", messages=QUESTION, tools=WEATHER, max_tokens=5
        )
    assert e.value.body["param"] == "tools", e.value.body


@pytest.mark.extended  # `make test-all`: the forced call's grammar is proved on tiny models
def test_qwen_tool_choice_forces_a_call(qwen):
    """tool_choice "required" and a named function make Qwen2.5-Coder call the tool even for
    a message that asks for none: the reply is a parsed call of the offered tool."""
    ask = [{"role": "user", "content": "Say hello."}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = qwen.chat.completions.create(
            model="qwen2.5-coder-0.5b",
            messages=ask,
            tools=WEATHER,
            tool_choice=choice,
            max_tokens=40,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (choice, c.message)
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS)


STRICT = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Rome", "Oslo"]},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.mark.extended  # `make test-all`: strict grammars compile and run on tiny models
def test_qwen_strict_tool_arguments_follow_the_schema(qwen):
    """A strict tool under tool_choice "auto": Qwen2.5-Coder's call (in its own Hermes syntax,
    the tags its single special tokens) has arguments that validate with jsonschema against
    `parameters` (a required unit of an enum the request does not mention)."""
    ask = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    r = qwen.chat.completions.create(
        model="qwen2.5-coder-0.5b", messages=ask, tools=STRICT, max_tokens=60
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), STRICT[0]["function"]["parameters"])


@pytest.mark.extended  # `make test-all`: calls parse and render back on tiny templates too
def test_qwen_tool_call(qwen):
    """Qwen2.5-Coder gets the tool list through its own template and asks for
    get_weather(city="Paris"): message.tool_calls with finish_reason "tool_calls", the same
    call streamed as delta.tool_calls; the tool's result renders back through the template
    and the model answers in text."""
    ask = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    r = qwen.chat.completions.create(
        model="qwen2.5-coder-0.5b", messages=ask, tools=WEATHER, max_tokens=60
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(
        qwen.chat.completions.create(
            model="qwen2.5-coder-0.5b", messages=ask, tools=WEATHER, max_tokens=60, stream=True
        )
    )
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = [
        *ask,
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    answer = qwen.chat.completions.create(
        model="qwen2.5-coder-0.5b", messages=follow, tools=WEATHER, max_tokens=40
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "stop"


@pytest.mark.extended
@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("templates/meta-llama-Llama-3.1-8B-Instruct.jinja", "json"),
        ("templates/mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
        ("templates/openai-gpt-oss-120b.jinja", "harmony"),
    ],
)
def test_required_calls_in_each_format(tmp_path_factory, template, fmt):
    """tool_choice "required" through the official client, with Qwen2.5-Coder served under
    another family's official template: the call comes in that template's syntax (Llama 3's
    bare JSON object, Mistral's [TOOL_CALLS] list, gpt-oss's harmony message to
    functions.NAME), parsed, its arguments valid."""
    from mlxlis.prompt.tool_formats import for_template

    from conftest import llama_cpp_reference

    path = llama_cpp_reference(template)
    assert for_template(path.read_text()).name == fmt
    need_pulled("qwen2.5-coder-0.5b")
    srv = ServeProcess(
        tmp_path_factory.mktemp(fmt), "-m", "qwen2.5-coder-0.5b", "--chat-template", str(path)
    )
    try:
        # the arguments closed to other keys: in Mistral v3's JSON list, greedy Qwen2.5-Coder
        # 0.5B goes on writing `"type": "string"` pairs into an object its schema leaves open
        fn = {**WEATHER[0]["function"], "parameters": {**PARAMS, "additionalProperties": False}}
        r = srv.client().chat.completions.create(
            model="qwen2.5-coder-0.5b",
            messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
            tools=[{"type": "function", "function": fn}],
            tool_choice="required",
            max_tokens=60,
        )
    finally:
        assert srv.stop() == 0, srv.log()
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
