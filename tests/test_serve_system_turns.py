"""System turns after the first message (Claude Code's `messages: [user, system]`, Codex's
developer items), on `mlxlis serve` with the tiny random Llama (greedy: the same request
gives the same tokens), driven by the official clients with their own param types. The
reference is the server's Chat Completions with the conversation the template should get:
the system turn in its place on a template that renders one anywhere (the shared server's
ChatML), joined to the system prompt on llama.cpp's copy of Qwen3.5's official template,
which raises on a system turn that is not first.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from anthropic.types import MessageParam, SystemMessageParam
from conftest import llama_cpp_reference
from serve_process import ServeProcess

MODEL = "llama_long"
BRIEF_FRENCH = "Be brief.\n\nAnswer in French."


@pytest.fixture(scope="module")
def client(tiny_server):
    return tiny_server.anthropic_client()


@pytest.fixture(scope="module")
def oai(tiny_server):
    return tiny_server.client()


def create(client, **kw):
    kw.setdefault("max_tokens", 12)
    return client.messages.create(model=MODEL, **kw)


def test_system_turns_inside_messages(client, oai):
    """`messages` holding a system turn after the user's (Claude Code's first request, typed
    with the client's own MessageParam / SystemMessageParam, text blocks too): on a template
    that renders a system turn anywhere (ChatML's), it is rendered in its place: the prompt
    and reply of the same messages through Chat Completions; count_tokens agrees. One with
    an image block is a 400 naming the block."""
    system: SystemMessageParam = {
        "role": "system",
        "content": [{"type": "text", "text": "Answer in French."}],
    }
    messages: list[MessageParam] = [{"role": "user", "content": "Hello, world!"}, system]
    r = create(client, system="Be brief.", messages=messages)
    o = oai.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello, world!"},
            {"role": "system", "content": "Answer in French."},
        ],
    )
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == o.usage.prompt_tokens
    assert r.content[0].text == o.choices[0].message.content
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    assert counted.input_tokens == o.usage.prompt_tokens
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as e:  # a system turn is text only
        create(client, messages=[messages[0], {"role": "system", "content": [image]}])
    assert e.value.body["error"]["message"].startswith("messages[1].content[0].type")


def test_system_turns_joined_where_the_template_takes_one_only(tiny, tmp_path):
    """On Qwen3.5's official template, which raises on a system turn after the first message
    (Chat Completions' [user, system] is refused: the premise), Messages' `messages` system
    turns and the Responses API's developer items after the user's are joined to the system
    prompt, in order: the prompt and reply of Chat Completions' one leading system turn
    (made when there is no system prompt). Thinking off in each API: the replies are text."""
    template = llama_cpp_reference("templates/Qwen3.5-4B.jinja")
    (tmp_path / MODEL).symlink_to(tiny(MODEL)[0])
    srv = ServeProcess(tmp_path, "-m", str(tmp_path / MODEL), "--chat-template", str(template))
    try:
        oai = srv.client()
        client = srv.anthropic_client()
        user: MessageParam = {"role": "user", "content": "Hello, world!"}
        late: SystemMessageParam = {"role": "system", "content": "Answer in French."}
        with pytest.raises(openai.BadRequestError, match="System message must be at the"):
            oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[user, late])
        for system, joined in ((None, "Answer in French."), ("Be brief.", BRIEF_FRENCH)):
            lead = {"system": system} if system else {}
            r = create(client, messages=[user, late], thinking={"type": "disabled"}, **lead)
            o = oai.chat.completions.create(
                model=MODEL,
                max_tokens=12,
                messages=[{"role": "system", "content": joined}, user],
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            assert r.usage.input_tokens + r.usage.cache_read_input_tokens == (o.usage.prompt_tokens)
            assert r.content[0].text == o.choices[0].message.content
        dev = {"type": "message", "role": "developer", "content": "Answer in French."}
        resp = oai.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input=[user, dev],
            max_output_tokens=12,
            reasoning={"effort": "low"},  # thinking off, as above
        )
        assert resp.usage.input_tokens == o.usage.prompt_tokens
        assert resp.output_text == o.choices[0].message.content
    finally:
        assert srv.stop() == 0, srv.log()
