"""No field of the four APIs is silently ignored. The official clients' request types
(openai's CompletionCreateParams, ChatCompletionCreateParams and ResponseCreateParams,
anthropic's MessageCreateParams, ollama's ChatRequest, GenerateRequest and Options) are the
reference: each of their fields is used (a field of the server's request model that is not
refused), a documented no-op (mlxlis/serve/fields.py, and docs/api-fields.md says why) or
refused when set (the request model's REFUSED). Then, on the real server: the new refusals
name their field in the API's shape, the allowed values of a refused field pass, Responses'
logprobs equal the chat endpoint's, and reasoning_effort sets the template's switch."""

from __future__ import annotations

from pathlib import Path

from mlxlis.serve.anthropic import MessagesRequest
from mlxlis.serve.fields import NO_OPS
from mlxlis.serve.ollama_requests import ChatRequest, GenerateRequest, Options
from mlxlis.serve.responses_schemas import ResponsesRequest
from mlxlis.serve.schemas import ChatCompletionRequest, CompletionRequest

import ollama._types
import openai
import pytest

MODEL = "llama_long"
HELLO = [{"role": "user", "content": "Hello, world!"}]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "api-fields.md"


def typed_dict_keys(*types) -> set[str]:
    return {k for t in types for k in (*t.__required_keys__, *t.__optional_keys__)}


def client_fields() -> dict[str, tuple[set[str], list[type]]]:
    """API -> (the official client's request fields, our request models for it)."""
    from anthropic.types import message_create_params as am
    from openai.types import completion_create_params as oc
    from openai.types.chat import completion_create_params as occ
    from openai.types.responses import response_create_params as orc

    def both(m):
        return typed_dict_keys(
            m.CompletionCreateParamsStreaming, m.CompletionCreateParamsNonStreaming
        )

    return {
        "chat": (both(occ), [ChatCompletionRequest]),
        "completions": (both(oc), [CompletionRequest]),
        "responses": (
            typed_dict_keys(
                orc.ResponseCreateParamsStreaming, orc.ResponseCreateParamsNonStreaming
            ),
            [ResponsesRequest],
        ),
        "anthropic": (
            typed_dict_keys(am.MessageCreateParamsStreaming, am.MessageCreateParamsNonStreaming),
            [MessagesRequest],
        ),
        "ollama": (
            set(ollama._types.ChatRequest.model_fields)
            | set(ollama._types.GenerateRequest.model_fields)
            | set(ollama.Options.model_fields),
            [ChatRequest, GenerateRequest, Options],
        ),
    }


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "anthropic", "ollama"])
def test_every_client_field_is_used_a_no_op_or_refused(api):
    """Every field of the official client's request type is held by our request model (used
    or REFUSED, both read: extra fields are dropped unread) or listed as a no-op with its
    reason, and is in one list only; each no-op is in docs/api-fields.md under its API."""
    theirs, models = client_fields()[api]
    held = {f.alias or name for m in models for name, f in m.model_fields.items()}
    refused = {name for m in models for name in m.REFUSED}
    no_ops = set(NO_OPS.get(api, {}))
    assert theirs, api
    nowhere = sorted(theirs - held - no_ops)
    assert not nowhere, f"{api}: fields in none of used / no-op / refused: {nowhere}"
    assert not (no_ops & refused), no_ops & refused
    if api != "ollama":  # Ollama's runner options are in Options (typed), and no-ops
        assert not (no_ops & held), no_ops & held
    doc = DOCS.read_text()
    section = doc.split(f"## {api}\n", 1)[1].split("\n## ", 1)[0]
    for name in no_ops:
        assert f"`{name}`" in section, f"{api}: {name} is not in docs/api-fields.md"
    for name in refused & theirs:
        assert f"`{name}`" in section, f"{api}: refused {name} is not in docs/api-fields.md"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, None),  # empty: asks nothing
        ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
        ({"moderation": {"model": "omni"}}, "moderation"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"modalities": ["text"], "verbosity": "medium", "user": "u", "store": True}, None),
    ],
)
def test_chat_fields_refused_or_accepted(server, extra, param):
    """A refused chat field is a 400 in OpenAI's shape naming it; its allowed values
    (["text"], "medium") and the no-ops pass."""
    oai = server.client()
    if param is None:
        r = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body=extra)
        assert r.choices[0].finish_reason == "length"
        return
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"].startswith(f"{param}:"), e.value.body


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"include": ["no.such.thing"]}, "include"),
        ({"top_logprobs": 50}, "top_logprobs"),
        ({"truncation": "disabled", "include": ["reasoning.encrypted_content"]}, None),
        ({"service_tier": "auto", "safety_identifier": "x", "metadata": {"a": "b"}}, None),
    ],
)
def test_responses_fields_refused_or_accepted(server, extra, param):
    """A refused Responses field is a 400 naming it; "disabled" truncation, an include value
    naming output never made here and the no-ops pass."""
    oai = server.client()
    if param is None:
        r = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2, extra_body=extra)
        assert r.status == "incomplete"
        return
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_anthropic_no_ops_pass(server):
    """Anthropic's no-op fields (metadata, service_tier, speed, inference_geo, …) leave the
    request working; the reply equals the one without them."""
    claude = server.anthropic_client()
    plain = claude.messages.create(model=MODEL, max_tokens=4, messages=HELLO)  # greedy
    extra = {
        "metadata": {"user_id": "u"},
        "service_tier": "auto",
        "speed": "standard",
        "inference_geo": "us",
        "cache_control": {"type": "ephemeral"},
    }
    got = claude.messages.create(model=MODEL, max_tokens=4, messages=HELLO, extra_body=extra)
    assert [b.text for b in got.content] == [b.text for b in plain.content]


def test_responses_logprobs_as_the_chat_endpoint(server):
    """include ["message.output_text.logprobs"] with top_logprobs 3: the output_text part's
    logprobs (tokens, logprobs, top 3) equal the chat endpoint's for the same greedy request,
    whole and streamed."""
    oai = server.client()
    chat = oai.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    want = [
        (c.token, round(c.logprob, 4), [(t.token, round(t.logprob, 4)) for t in c.top_logprobs])
        for c in chat.choices[0].logprobs.content
    ]
    r = oai.responses.create(
        model=MODEL,
        input=HELLO,
        max_output_tokens=6,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=3,
    )
    part = r.output[-1].content[0]
    got = [
        (c.token, round(c.logprob, 4), [(t.token, round(t.logprob, 4)) for t in c.top_logprobs])
        for c in part.logprobs
    ]
    assert got == want and len(want) == 6
    with oai.responses.stream(
        model=MODEL,
        input=HELLO,
        max_output_tokens=6,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=3,
    ) as s:
        deltas = [
            lp.token for ev in s if ev.type == "response.output_text.delta" for lp in ev.logprobs
        ]
    assert deltas == [w[0] for w in want]


def test_reasoning_effort_sets_the_thinking_switch(server):
    """reasoning_effort "high" renders the prompt as enable_thinking true does (same greedy
    reply, its reasoning split off), "low" as false does."""
    oai = server.client()

    def reply(**kw):
        m = (
            oai.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=6, temperature=0, **kw
            )
            .choices[0]
            .message
        )
        return m.content, getattr(m, "reasoning_content", None)

    on = reply(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = reply(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on != off
    assert reply(reasoning_effort="high") == on
    assert reply(reasoning_effort="low") == off
