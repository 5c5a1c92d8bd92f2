"""Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`.

A thin adapter: the body becomes the server's chat request (system and messages as a chat
template takes them, system turns inside `messages` where the template takes them
(system_turns.py), `tool_use` blocks as tool calls, `tool_result` blocks as tool messages,
`thinking` as the template's own thinking switch, `image` blocks as image parts), prepared and
generated like any other; the events become content blocks (`thinking`, `text`, `tool_use`),
streamed as Anthropic's event sequence. Fields that cannot change the reply here (`metadata`,
`cache_control`, `service_tier`, `speed`, `container`, …) are accepted as no-ops, each with
its reason in fields.NO_OPS (docs/api-fields.md); what cannot be honoured (an
Anthropic-defined tool, an image to a model that does not see) is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from mlxlis.generation.processors import ReasoningBudget
from mlxlis.prompt.reasoning import ReasoningSplitter
from mlxlis.serve.anthropic_blocks import content, message_stream, stop_reason, usage
from mlxlis.serve.images import data_url
from mlxlis.serve.openai_format import APIError, new_id
from mlxlis.serve.pool import Served
from mlxlis.serve.prepare import Prepared, prepare_chat
from mlxlis.serve.schemas import ChatCompletionRequest, _Body
from mlxlis.serve.service import Service, collect, read_body
from mlxlis.serve.system_turns import place_systems

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

EFFORT_THINKS = {"low": False, "medium": True, "high": True, "max": True}
# the chat request's parameter names as this API calls them (in refusals)
NAMES = {
    "stop": "stop_sequences",
    "tool_choice.function.name": "tool_choice.name",
}


class Block(_Body):
    """One content block; which fields count depends on `type` (checked in `_blocks`)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    source: dict[str, Any] | None = None  # an image's: base64 (media_type, data) or a url


class Message(_Body):
    role: Literal["user", "assistant", "system"]  # system: anywhere (system_turns.py)
    content: str | list[Block]


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or none; Anthropic's own tools (bash_…) are refused
    strict: bool | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None


class CountTokensRequest(_Body):
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # output_config.format's place in its beta


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None  # older clients still send these; honoured when present
    top_p: float | None = None
    top_k: int | None = None
    kv_bits: int | None = None  # mlxlis' extension: this request's KV cache format
    kv_group_size: int | None = None
    # mlxlis' extension, as Ollama's: how long the model stays loaded once idle (a duration,
    # seconds, -1 forever, 0 at once)
    keep_alive: float | str | None = None


def bad(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _text(blocks: str | list[Block] | None, where: str) -> str:
    """A tool result's or the system prompt's text: a string, or text blocks joined."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    out = []
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise bad(f"only text blocks are supported here, not {b.type!r}", f"{where}[{j}].type")
        out.append(b.text)
    return "\n".join(out)


def _user(blocks: list[Block], i: int) -> list[dict[str, Any]]:
    """A user turn: each tool_result a tool message, in order, then its text and images (if
    any); an image part carries `_from`, its place (for the names of refusals)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if b.type == "text" and b.text is not None:
            parts.append({"type": "text", "text": b.text})
        elif b.type == "tool_result" and b.tool_use_id is not None:
            result = _text(b.content, f"{where}.content")
            # a chat template has no error flag: the model reads it in the result
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b.tool_use_id,
                    "content": f"Error: {result}" if b.is_error else result,
                }
            )
        elif b.type == "image":
            url, field = _image_url(b.source, f"{where}.source")
            parts.append({"type": "image_url", "image_url": {"url": url}, "_from": (where, field)})
        else:
            raise bad(f"a user turn's block cannot be {b.type!r} here", f"{where}.type")
    if any(p["type"] == "image_url" for p in parts):
        out.append({"role": "user", "content": parts})
    elif parts or not out:
        out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
    return out


def _image_url(source: dict[str, Any] | None, where: str) -> tuple[str, str]:
    """An image block's source as an image_url part's URL, and the source field a refusal of
    it names."""
    kind = (source or {}).get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not media.startswith("image/"):
            raise bad("expected an image media type (image/png, ...)", f"{where}.media_type")
        if not isinstance(data, str):
            raise bad("expected the image's base64 data", f"{where}.data")
        return data_url(media, data), f"{where}.data"  # decoded when prepared, off the loop
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"], f"{where}.url"
    raise bad("expected a base64 or url image source", f"{where}.type")


def _assistant(blocks: list[Block], i: int) -> dict[str, Any]:
    """A past assistant turn: its text, its reasoning and its tool calls."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    calls = []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if b.type == "text" and b.text is not None:
            msg["content"] += b.text
        elif b.type == "thinking" and b.thinking is not None:
            msg["reasoning_content"] = msg.get("reasoning_content", "") + b.thinking
        elif b.type == "redacted_thinking":
            continue  # reasoning encrypted by another model: nothing this one can read
        elif b.type == "tool_use" and b.id is not None and b.name is not None:
            fn = {"name": b.name, "arguments": b.input or {}}
            calls.append({"id": b.id, "type": "function", "function": fn})
        else:
            raise bad(f"an assistant turn's block cannot be {b.type!r} here", f"{where}.type")
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(tools: list[Tool]) -> list[dict[str, Any]]:
    out = []
    for k, t in enumerate(tools):
        if t.type not in (None, "custom") or t.input_schema is None:
            raise bad(
                f"{t.type or t.name!r}: only custom tools with an input_schema can run here",
                f"tools[{k}].type" if t.type else f"tools[{k}].input_schema",
            )
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        if t.strict is not None:
            fn["strict"] = t.strict
        out.append({"type": "function", "function": fn})
    return out


def to_chat(req: CountTokensRequest, model: Any = None) -> ChatCompletionRequest:
    """The server's chat request for `req` (`model`: whose template places the system turns
    of `messages`, system_turns.py, and has the thinking switch `thinking` sets)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        if m.role == "system":
            messages.append(
                {"role": "system", "content": _text(m.content, f"messages[{i}].content")}
            )
        elif isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages += _user(m.content, i)
        else:
            messages.append(_assistant(m.content, i))
    messages = place_systems(messages, model)
    renames = _image_renames(messages)
    body: dict[str, Any] = {"messages": messages}
    thinking = req.thinking.type if req.thinking else None
    effort = req.output_config.effort if req.output_config else None
    on = None
    if thinking in ("enabled", "disabled"):
        on = thinking == "enabled"
    elif thinking is None and effort is not None:
        on = EFFORT_THINKS[effort]
    if on is not None and model is not None and (switch := model.thinking_vars(on)):
        body["chat_template_kwargs"] = switch  # the template's own spelling
    choice = req.tool_choice
    if req.tools:
        body["tools"] = _tools(req.tools)
        for k in range(len(req.tools)):  # what a refusal of a tool's schema names
            renames[f"tools[{k}].function.parameters"] = f"tools[{k}].input_schema"
        body["parallel_tool_calls"] = not (choice and choice.disable_parallel_tool_use)
    if choice is not None:  # without tools, "any" and "tool" are refused, never ignored
        if choice.type == "tool":
            if choice.name is None:
                raise bad('a "tool" choice needs the tool\'s name', "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    fmt, place = req.output_config and req.output_config.format, "output_config.format"
    if req.output_format is not None:  # where the structured outputs beta had it
        if fmt:
            raise bad("output_config.format is given too", "output_format")
        fmt, place = req.output_format, "output_format"
    renames |= {"response_format.json_schema.schema": f"{place}.schema", "response_format": place}
    if fmt:
        schema = fmt.schema_
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": True},
        }
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k", "kv_bits", "kv_group_size"):
            if (v := getattr(req, name)) is not None:
                body[name] = v
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    chat = ChatCompletionRequest.model_validate(body)
    chat._renames = renames
    return chat


def _image_renames(messages: list[dict[str, Any]]) -> dict[str, str]:
    """Where each image part of the converted `messages` came from (its block, and the
    source field a refusal of its URL names): what a refusal of it names."""
    out = {}
    for k, m in enumerate(messages):
        for n, part in enumerate(m["content"] if isinstance(m["content"], list) else []):
            if "_from" in part:
                block, field = part.pop("_from")
                out[f"messages[{k}].content[{n}].image_url.url"] = field
                out[f"messages[{k}].content[{n}]"] = block
    return out


def _budget(req: MessagesRequest) -> int | None:
    t = req.thinking
    if t is None or t.type != "enabled":
        return None
    if t.budget_tokens is None:
        raise bad("thinking of type enabled needs budget_tokens", "thinking.budget_tokens")
    if not 1 <= t.budget_tokens < req.max_tokens:
        raise bad(
            f"must be at least 1 and less than max_tokens ({req.max_tokens}), not "
            f"{t.budget_tokens}",
            "thinking.budget_tokens",
        )
    return t.budget_tokens


def with_budget(prep: Prepared, model: Any, budget: int) -> Prepared:
    """`prep` with its reasoning closed after `budget` tokens (a model that does not reason
    answers as it would)."""
    assert prep.prompt is not None
    splitter = ReasoningSplitter.for_prompt(model.tokenizer, prep.prompt)

    def ids(tag: str) -> list[int]:
        return model.tokenizer.encode(tag, special=True, add_bos=False, add_eos=False)

    limit = ReasoningBudget(
        budget,
        len(prep.gen.prompt),
        ids(splitter.open_tag),
        ids(splitter.close_tag),
        splitter.in_reasoning,
        [ids(tag) for tag in splitter.end_tags],
    )
    prep.gen = replace(prep.gen, processors=(*prep.gen.processors, limit))
    return prep


def router(svc: Service, auth: list) -> APIRouter:
    r = APIRouter()
    state = svc.state

    async def prepared(served: Served, req: CountTokensRequest) -> Prepared:
        chat = to_chat(req, served.model)
        return await svc.prepare(served, prepare_chat, chat, names=NAMES)

    @r.post("/v1/messages/count_tokens", dependencies=auth)
    async def count_tokens(request: Request) -> dict[str, Any]:
        req = await read_body(request, CountTokensRequest, state.max_body)
        served = await svc.model(req.model)
        with served.held():
            return {"input_tokens": len((await prepared(served, req)).gen.prompt)}

    @r.post("/v1/messages", dependencies=auth)
    async def messages(request: Request) -> Any:
        req = await read_body(request, MessagesRequest, state.max_body)
        budget = _budget(req)
        served = await svc.model(req.model, req.keep_alive)
        with served.held():
            prep = await prepared(served, req)
            if budget is not None:
                prep = with_budget(prep, served.model, budget)
            rid = new_id("msg").replace("-", "_")
            reply = svc.chat_reply(served, prep)
            run = svc.submit(served, prep, rid, request)
        head = {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": served.name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
        }
        if req.stream:
            return StreamingResponse(
                message_stream(run, reply, head, state.keepalive),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        ev = await collect(run, reply.feed)
        reason = stop_reason(ev.finish_reason or "stop", bool(reply.tool_calls), ev.stop_sequence)
        return {
            **head,
            "content": content(reply),
            "stop_reason": reason,
            "stop_sequence": ev.stop_sequence,
            "usage": usage(ev.usage),
        }

    return r
