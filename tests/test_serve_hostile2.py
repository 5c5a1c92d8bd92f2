"""`mlxlis serve` against a second round of hostile requests, on the session's tiny server
(a real process) through the official `openai` and `anthropic` clients and raw HTTP.

What these prove, each after a hostile request, that the process lives, /health is "ok" and
a plain greedy request gets exactly the answer it got before (`still_serving`):
- a reply nested deeper than Python's JSON reader goes (~1000 levels: a RecursionError), with
  tools offered, is text, not a call: before, a 500 (the whole reply lost) or, streamed, a
  connection cut with no error event and no [DONE]; the parser on its own, for every tool
  format, reads such a body as no call;
- a past call's arguments nested as deep (Chat's tool_calls, a Responses function_call) are
  the template's text as they came (a 500 before); a text part without text is named so;
- a client that leaves while sending its body is logged as having left (499), not as a 500
  with a traceback;
- a request's own text echoed in the log (a 7 MB model name in its 404) is cut there;
- HEAD is answered wherever GET is (RFC 9110; Ollama answers it on /api/tags and
  /api/version): GET's status and headers, no body — it was a 405;
- a field of several types (content: text or a list of blocks) is named where it went wrong
  (messages[1].content[0].input), not at the field (messages[1].content "should be a string");
- options that would change the answer and cannot be honoured are a 400 naming them, never
  ignored: the deprecated functions / function_call, the Responses API's
  conversation and stored prompt; an Anthropic tool_choice of "any" or "tool" without tools
  (it was ignored: the reply was free text);
- Anthropic's structured output in the beta's place (`output_format`) is enforced as
  `output_config.format` is (it was ignored), and its refusals name that field.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

from mlxlis.prompt.tool_calls import ToolCallParser
from mlxlis.prompt.tool_formats import GEMMA4, HARMONY, HERMES, for_template

import anthropic
import openai
import pytest

MODEL = "llama_long"
HELLO = [{"role": "user", "content": "Hello there"}]
DEEP = 3000  # levels: past json's recursion limit (1000) whatever the stack holds already
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def oai(tiny_server):
    return tiny_server.client()


@pytest.fixture(scope="module")
def claude(tiny_server):
    return tiny_server.anthropic_client()


@pytest.fixture(scope="module")
def still_serving(tiny_server, oai):
    """A check that the process lives, /health is ok and the greedy answer is unchanged."""

    def answer() -> str:
        r = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
        return r.choices[0].message.content

    before = answer()

    def check() -> None:
        assert tiny_server.proc.poll() is None, tiny_server.log()
        status, health = tiny_server.request("GET", "/health")
        assert status == 200 and health["status"] == "ok", health
        assert answer() == before

    return check


def test_parser_reads_a_body_nested_too_deep_as_no_call():
    """Each format's parser, and the bare-JSON reply, on a call whose arguments nest DEEP
    levels: no call, the text as it came (a RecursionError before)."""
    args = "[" * DEEP + "]" * DEEP
    bodies = {
        HERMES: f'<tool_call>{{"name": "f", "arguments": {{"a": {args}}}}}</tool_call>',
        GEMMA4: f"<|tool_call>call:f{{a:{args}}}<tool_call|>",
        HARMONY: f'{HARMONY.open}f<|message|>{{"a": {args}}}{HARMONY.close}',
        for_template("[TOOL_CALLS]"): f'[TOOL_CALLS][{{"name": "f", "arguments": {args}}}]',
        for_template(""): f'{{"name": "f", "arguments": {{"a": {args}}}}}',
    }
    for fmt, reply in bodies.items():
        parser = ToolCallParser(frozenset({"f"}), fmt)
        shown, calls = parser.feed(reply)
        rest, more = parser.flush()
        assert calls == more == [] and parser.calls == [], fmt.name
        assert shown + rest == reply, fmt.name


@pytest.mark.extended  # ~2200 constrained tokens a reply: about 4 s each here
def test_a_reply_nested_too_deep_is_text(tiny_server, oai, still_serving):
    """A reply forced (regex) into a call whose arguments nest 1100 levels, tools offered:
    whole, as text, in one reply and streamed to its [DONE]."""
    depth = 1100
    rx = r'\{"name": "f", "arguments": \{"a": ' + r"\[" * depth + r"\]" * depth + r"\}\}"
    kw = dict(
        model=MODEL,
        messages=HELLO,
        tools=TOOLS,
        max_tokens=2 * depth + 40,
        response_format={"type": "regex", "regex": rx},
    )
    r = oai.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert r.choices[0].message.tool_calls is None and text.count("[") == depth, text[:80]
    streamed = "".join(
        c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
    )  # the client raises on a stream cut short
    assert streamed == text
    still_serving()


def test_past_call_arguments_nested_too_deep_stay_text(oai, still_serving):
    """A past call's arguments string nested 1100 levels (Chat's tool_calls, the Responses
    API's function_call): the template gets the text as it came (a 500 before)."""
    args = "[" * 1100 + "]" * 1100  # past json's limit, within the context (4096)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    items = [
        {"role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": args},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    assert oai.responses.create(model=MODEL, input=items, max_output_tokens=2).output
    still_serving()


def test_a_part_without_its_field_is_named(oai, still_serving):
    """A text part with no text: named as such, not "only text and image_url parts are
    supported, not 'text'"."""
    for part, param in (({"type": "text"}, "text"), ({"type": "image_url"}, "image_url")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=2
            )
        assert e.value.body["param"] == f"messages[0].content[0].{param}", e.value.body
    still_serving()


def test_a_client_leaving_mid_body_is_no_server_error(tiny_server, still_serving):
    """Half a body, then the connection closed: a 499 line in the log, no 500, no traceback."""
    skip = len(tiny_server.log().splitlines())
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            b'{"messages": [{"role": "user", "content": "Hel'
        )
        time.sleep(0.2)
    line = tiny_server.log_line(r"POST /v1/chat/completions \d+", skip=skip)
    assert " 499 " in line, line
    later = "\n".join(tiny_server.log().splitlines()[skip:])
    assert "Traceback" not in later and " 500 " not in later, later
    still_serving()


def test_a_request_cannot_fill_the_log(tiny_server, oai, still_serving):
    """A 7 MB model name, echoed in its 404: the log line is cut (it was the whole name, 7 MB
    a request)."""
    size = len(tiny_server.log())
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="m" * (7 << 20), messages=HELLO, max_tokens=2)
    assert len(tiny_server.log()) - size < 4000
    still_serving()


def test_head_is_answered_wherever_get_is(tiny_server, still_serving):
    for path in ("/health", "/v1/models", f"/v1/models/{MODEL}", "/api/tags", "/api/version"):
        got = {}
        for method in ("GET", "HEAD"):
            conn = http.client.HTTPConnection("127.0.0.1", tiny_server.port, timeout=60)
            conn.request(method, path)
            r = conn.getresponse()
            got[method] = (r.status, r.getheader("content-type"), r.read())
            conn.close()
        assert got["HEAD"][:2] == got["GET"][:2] and got["GET"][0] == 200, (path, got)
        assert got["HEAD"][2] == b"" and got["GET"][2], path
    still_serving()


def test_a_field_of_several_types_is_named_where_it_went_wrong(oai, claude, still_serving):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}],
                },
            ],
        )
    assert e.value.body["error"]["message"].startswith("messages[1].content[0].input: ")
    for body, param in (
        ({"messages": [{"role": "user", "content": ["Hi"]}]}, "messages[0].content[0]"),
        ({"messages": HELLO, "stop": [7]}, "stop[0]"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),  # no list
    ):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, max_tokens=4, **body)
        assert e.value.body["param"] == param, e.value.body
    still_serving()


def test_options_that_cannot_be_honoured_are_refused(oai, claude, still_serving):
    for extra in (
        {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
        {"function_call": {"name": "f"}},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, **extra)
        assert e.value.body["param"] == next(iter(extra)), e.value.body
        assert e.value.body["code"] == "unsupported_parameter"
    empty = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, logit_bias={})
    assert empty.choices[0].finish_reason == "length"  # an empty bias asks nothing
    for extra in ({"conversation": "conv_1"}, {"prompt": {"id": "pmpt_1"}}):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4, **extra)
        assert e.value.body["param"] == next(iter(extra)), e.value.body
    for choice in ({"type": "any"}, {"type": "tool", "name": "f"}):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tool_choice=choice)
        assert e.value.body["error"]["message"].startswith("tool_choice: "), e.value.body
    still_serving()


def test_anthropic_output_format_is_enforced(claude, still_serving):
    """The beta's `output_format`: the same constrained reply as `output_config.format`;
    a bad schema's refusal names it; both at once are refused."""
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["yes", "no"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "schema": schema}
    kw = dict(model=MODEL, max_tokens=40, messages=HELLO)
    beta = claude.messages.create(**kw, extra_body={"output_format": fmt})
    ga = claude.messages.create(**kw, output_config={"format": fmt})
    assert beta.content[0].text == ga.content[0].text
    assert json.loads(beta.content[0].text)["a"] in ("yes", "no")
    bad = {"type": "json_schema", "schema": {"type": "nope"}}
    for extra, says in (
        ({"extra_body": {"output_format": bad}}, "output_format.schema: "),
        ({"extra_body": {"output_format": fmt}, "output_config": {"format": fmt}}, "output_format"),
    ):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(**kw, **extra)
        assert e.value.body["error"]["message"].startswith(says), e.value.body
    still_serving()
