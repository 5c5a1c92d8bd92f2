"""XML-parameter tool calls end to end: a real `mlxlis serve` with the tiny random Llama under
official templates (Qwen3.5's `<function=…><parameter=…>` rows, GLM-4.7's `<arg_key>` rows),
and an agent session's prompts.

- A required call comes back as a structured call whose arguments validate against the
  tool's schema (jsonschema), through the official openai and anthropic clients, whole and
  streamed. The tiny model's 400-token vocabulary has none of the tags as tokens: the grammar
  writes them as text, and the format's reader reads them from text.
- A whole agent session (a forced call, the tool's result, an answer, a next question), each
  turn's prompt rendered by mlxlis from the API messages (the call's arguments as the JSON text
  the API returned), is byte-identical to transformers' `render_jinja_template` of the same
  conversation (an independent renderer, the arguments as objects); and the next prompt starts
  with the previous prompt plus the call text the model wrote, so the cached prefix is reused
  across the turn.
"""

from __future__ import annotations

import json

import mlxlis
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.core import Core
from mlxlis.generation.generate import run
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.steps import LocalSteps
from mlxlis.serve.prepare import Target, prepare_chat
from mlxlis.serve.reply import ChatReply
from mlxlis.serve.schemas import ChatCompletionRequest

import anthropic
import jsonschema
import pytest
from conftest import llama_cpp_reference
from serve_process import ServeProcess
from tool_pieces import whole_prefix

TEMPLATES = ("Qwen3.5-4B.jinja", "GLM-4.7-Flash.jinja")
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": SCHEMA},
    }
]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
THINKING_OFF = {"enable_thinking": False}  # the call is the answer, no reasoning before it


@pytest.fixture(scope="module", params=TEMPLATES)
def server(request, tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    (tmp / "llama_long").symlink_to(tiny("llama_long")[0])
    template = llama_cpp_reference(f"templates/{request.param}")
    srv = ServeProcess(tmp, "-m", str(tmp / "llama_long"), "--chat-template", str(template))
    yield srv
    assert srv.stop() == 0, srv.log()


def test_a_required_call_through_the_openai_client(server):
    client = server.client()
    kw = dict(
        model="llama_long",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
        extra_body={"chat_template_kwargs": THINKING_OFF},
    )
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    name, args = "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            name += delta.function.name or ""
            args += [delta.function.arguments] if delta.function.arguments else []
    # the same greedy reply, its three arguments streamed one at a time: at least three
    # deltas, each ending on a whole value, together the whole reply's arguments exactly
    assert name == "get_weather" and "".join(args) == call.function.arguments
    final = json.loads(call.function.arguments)
    assert len(args) >= 3 and all(
        whole_prefix("".join(args[: i + 1]), final) for i in range(len(args))
    )


def test_a_required_call_through_the_responses_api(server):
    """Responses, streamed: the call's item opens, its arguments come in deltas of whole
    arguments, and the done events and the completed response hold their concatenation,
    the arguments of the same request unstreamed."""
    client = server.client()
    kw = dict(
        model="llama_long",
        input="Weather in Paris?",
        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
        reasoning={"effort": "none"},  # the call is the answer, no reasoning before it
    )
    whole = client.responses.create(**kw)
    (item,) = whole.output
    jsonschema.validate(json.loads(item.arguments), SCHEMA)
    deltas, done, completed = [], None, None
    for ev in client.responses.create(**kw, stream=True):
        if ev.type == "response.function_call_arguments.delta":
            deltas.append(ev.delta)
        elif ev.type == "response.function_call_arguments.done":
            done = ev.arguments
        elif ev.type == "response.completed":
            completed = ev.response
    assert len(deltas) >= 3 and "".join(deltas) == done == item.arguments
    assert completed.output[0].arguments == item.arguments


def test_a_required_call_through_the_anthropic_client(server):
    client = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0
    )
    kw = dict(
        model="llama_long",
        max_tokens=200,
        messages=QUESTION,
        tools=[{"name": "get_weather", "description": "Weather.", "input_schema": SCHEMA}],
        tool_choice={"type": "any"},
        thinking={"type": "disabled"},
    )
    r = client.messages.create(**kw)
    assert [b.type for b in r.content] == ["tool_use"] and r.stop_reason == "tool_use"
    jsonschema.validate(r.content[0].input, SCHEMA)
    with client.messages.stream(**kw) as s:
        parts = [e.delta.partial_json for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    # input_json_delta by whole arguments: three or more, each ending on a whole value
    assert final.content[0].input == r.content[0].input and len(parts) >= 3
    assert all(whole_prefix("".join(parts[: i + 1]), r.content[0].input) for i in range(len(parts)))


@pytest.mark.parametrize("name", TEMPLATES)
def test_an_agent_session_renders_what_the_template_renders(tiny, name):
    from transformers.utils.chat_template_utils import render_jinja_template

    path = llama_cpp_reference(f"templates/{name}")
    text = path.read_text()
    model = mlxlis.load(tiny("llama_long")[0], "float32", chat_template=str(path))
    target = Target(model, SamplingParams(temperature=0.0, max_tokens=200), 4096, model.stop_ids())
    core = Core(model, LocalSteps(model, PrefixCache(0)))
    tok = model.tokenizer

    def turn(messages: list[dict], **kw) -> tuple[str, str, ChatReply]:
        """(the prompt, the reply's text, the reply) of one request."""
        req = ChatCompletionRequest(
            model="m", messages=messages, tools=TOOLS, chat_template_kwargs=THINKING_OFF, **kw
        )
        prep = prepare_chat(target, req)
        reply = ChatReply(
            tok,
            None,
            prep.prompt,
            logprobs=False,
            tools=prep.tools,
            tool_format=prep.tool_format,
            forced=prep.forced,
            template=model.template,
        )
        written = "".join(
            reply.feed(ev) and ev.text or ev.text for ev in run(core, core.start(prep.gen))
        )
        return prep.prompt, written, reply

    def reference(messages: list[dict]) -> str:
        """transformers' rendering, the calls' arguments as objects (its convention)."""
        plain = json.loads(json.dumps(messages))
        for m in plain:
            for c in m.get("tool_calls") or ():
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
        out, _ = render_jinja_template(
            [plain],
            tools=TOOLS,
            chat_template=text,
            add_generation_prompt=True,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            **THINKING_OFF,
        )
        return out[0]

    prompt1, written1, reply1 = turn(QUESTION, tool_choice="required")
    assert prompt1 == reference(QUESTION)
    (call,) = reply1.message()["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    session = [
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call]},  # (null is read as "")
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C, clear"},
    ]
    prompt2, written2, reply2 = turn(session, tool_choice="auto", max_tokens=12)
    assert prompt2 == reference(session)
    assert prompt2.startswith(prompt1 + written1), "the call re-rendered as the model wrote it"
    session += [
        {"role": "assistant", "content": reply2.message()["content"]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    prompt3, _, _ = turn(session, tool_choice="auto", max_tokens=4)
    assert prompt3 == reference(session)
