"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A thin adapter like anthropic.py: `instructions` and the `input` items (messages,
`function_call`, `function_call_output`, `reasoning`) become the server's chat request, the
events become output items (`reasoning`, `message` with `output_text`, `function_call`),
streamed as the API's `response.*` events. Responses are kept (unless `store` is false) in a
bounded in-memory store, so that `previous_response_id` continues a conversation: its input
and output come before the new input (its instructions do not, as OpenAI does it). System
and developer items after the first message go where the template takes them
(system_turns.py). Function tools, and namespaces of them (responses_tools.py); hosted tools
(web_search, file_search, computer use…) are a 400 naming them.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from mlxlis.serve.fields import INCLUDE_LOGPROBS, INCLUDE_NO_OPS
from mlxlis.serve.openai_format import APIError, new_id
from mlxlis.serve.prepare import prepare_chat
from mlxlis.serve.reply import ChatReply
from mlxlis.serve.responses_items import Output, as_items
from mlxlis.serve.responses_schemas import Item, Part, ResponsesRequest
from mlxlis.serve.responses_tools import SEP, tool_choice, tools_of
from mlxlis.serve.schemas import ChatCompletionRequest
from mlxlis.serve.service import Run, Service, collect, end_error, read_body
from mlxlis.serve.system_turns import place_systems

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
THINKS = {"none": False, "minimal": False, "low": False, "medium": True, "high": True}


def bad(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, p in enumerate(content):
        if p.type not in TEXT_PARTS or p.text is None:
            raise bad(
                f"only text, input_image and input_audio parts are supported, not {p.type!r}",
                f"{where}[{j}].type",
            )
        out.append(p.text)
    return "".join(out)


def _content(content: str | list[Part] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or (with an input_image or input_audio) its parts in
    order, each image or audio part carrying `_from`, its place (for the names of
    refusals)."""
    media = ("input_image", "input_audio")
    if not isinstance(content, list) or not any(p.type in media for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        if p.type == "input_audio":
            if p.input_audio is None:
                raise bad("an input_audio part needs input_audio", f"{where}[{j}].input_audio")
            parts.append(
                {"type": "input_audio", "input_audio": p.input_audio, "_from": f"{where}[{j}]"}
            )
        elif p.type == "input_image":
            if p.image_url is None:
                raise bad(
                    "an input_image needs image_url (file_id is not supported)",
                    f"{where}[{j}].image_url",
                )
            parts.append(
                {"type": "image_url", "image_url": {"url": p.image_url}, "_from": f"{where}[{j}]"}
            )
        else:
            parts.append({"type": "text", "text": _text([p], f"{where}[{j}]")})
    return parts


def _renames(messages: list[dict[str, Any]]) -> dict[str, str]:
    """Where each image or audio part came from (ours -> the input's), an image's URL
    first."""
    out = {}
    for k, m in enumerate(messages):
        for n, part in enumerate(m["content"] if isinstance(m["content"], list) else []):
            if "_from" in part:
                src = part.pop("_from")
                if part["type"] == "image_url":
                    out[f"messages[{k}].content[{n}].image_url.url"] = f"{src}.image_url"
                out[f"messages[{k}].content[{n}]"] = src
    return out


def to_messages(items: list[Item], where: str = "input") -> list[dict[str, Any]]:
    """Input items as a chat template's messages: a function call joins the assistant turn
    before it (a new one when there is none), its output is a tool message, a reasoning item
    is the reasoning of the assistant turn that follows it."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, it in enumerate(items):
        at = f"{where}[{i}]"
        if it.type == "message":
            if it.role not in ("user", "assistant", "system", "developer"):
                raise bad(f"unknown role {it.role!r}", f"{at}.role")
            msg = {
                "role": "system" if it.role == "developer" else it.role,
                "content": _content(it.content, f"{at}.content"),
            }
            if it.role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif it.type == "function_call":
            if it.call_id is None or it.name is None:
                raise bad("a function_call needs call_id and name", f"{at}.call_id")
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            name = f"{it.namespace}{SEP}{it.name}" if it.namespace else it.name
            fn = {"name": name, "arguments": it.arguments or "{}"}
            last.setdefault("tool_calls", []).append(
                {"id": it.call_id, "type": "function", "function": fn}
            )
        elif it.type == "function_call_output":
            if it.call_id is None:
                raise bad("a function_call_output needs call_id", f"{at}.call_id")
            out.append(
                {"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output, at)}
            )
        elif it.type == "reasoning":
            reasoning = "".join(p.text or "" for p in it.summary or []) + _text(it.content, at)
        else:
            raise bad(f"input items of type {it.type!r} are not supported", f"{at}.type")
    return out


def _format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad(f"unknown format {kind!r}", "text.format.type")


def to_chat(
    req: ResponsesRequest, history: list[Item], model: Any = None
) -> tuple[ChatCompletionRequest, list[Item], dict[str, tuple[str, str]]]:
    """The chat request for `req` after the stored conversation `history`, the whole
    conversation's input items (what a later response continues) and the namespaced names
    offered (`namespace.name` -> (namespace, name)). `model`: whose template places the
    system turns after the first (system_turns.py) and has the thinking switch
    `reasoning.effort` sets."""
    items = [Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    conversation = [*history, *items]
    messages = to_messages(conversation)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    messages = place_systems(messages, model)
    body: dict[str, Any] = {"messages": messages}
    for ours, theirs in (
        ("max_tokens", "max_output_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("kv_bits", "kv_bits"),
        ("kv_group_size", "kv_group_size"),
    ):
        if (v := getattr(req, theirs)) is not None:
            body[ours] = v
    tools = tools_of(req.tools or [])
    if tools.chat:
        body["tools"] = tools.chat
    if req.tool_choice is not None:
        body["tool_choice"] = tool_choice(req.tool_choice, tools)
    if req.text and req.text.format and (fmt := _format(req.text.format)) is not None:
        body["response_format"] = fmt
    include = set(req.include or ())
    if unknown := sorted(include - INCLUDE_NO_OPS - {INCLUDE_LOGPROBS}):
        raise bad(f"{unknown[0]!r} is not a value this server knows", "include")
    if INCLUDE_LOGPROBS in include or req.top_logprobs is not None:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    effort = req.reasoning.effort if req.reasoning else None
    if effort in THINKS and model is not None and (switch := model.thinking_vars(THINKS[effort])):
        body["chat_template_kwargs"] = switch  # the template's own spelling
    renames = {**_renames(messages), **tools.renames}  # what a refusal names
    chat = ChatCompletionRequest.model_validate(body)
    chat._renames = renames
    return chat, conversation, tools.spaces


NAMES = {
    "tool_choice.function.name": "tool_choice.name",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


class Store:
    """Responses kept for GET and previous_response_id: LRU, at most `max_bytes` of JSON."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[dict, list[Item], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[Item]) -> None:
        size = len(json.dumps(response)) + sum(len(i.model_dump_json()) for i in conversation)
        if size > self.max_bytes:
            return
        with self._lock:
            self._items[response["id"]] = (response, conversation, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, _, old) = self._items.popitem(last=False)
                self._bytes -= old

    def get(self, rid: str) -> tuple[dict, list[Item]] | None:
        with self._lock:
            got = self._items.get(rid)
            if got is None:
                return None
            self._items.move_to_end(rid)
            return got[0], got[1]

    def delete(self, rid: str) -> bool:
        with self._lock:
            got = self._items.pop(rid, None)
            if got is not None:
                self._bytes -= got[2]
            return got is not None


def not_found(rid: str) -> APIError:
    return APIError(404, f"no response with id {rid!r}", param="response_id", code="not_found")


def router(svc: Service, auth: list) -> APIRouter:
    r = APIRouter()
    state = svc.state
    store = Store(state.responses_store_bytes)

    def response(
        rid: str, req: ResponsesRequest, status: str, output: list, usage: Any, reasoning: int
    ) -> dict[str, Any]:
        """`req.model` is the name of the model that answers (set by `create`)."""
        out = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": req.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": bool(req.parallel_tool_calls),
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "store": req.store,
            "metadata": {},
            "usage": None,
        }
        if usage is not None:
            out["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            }
        return out

    async def stream(
        run: Run,
        reply: ChatReply,
        rid: str,
        req: ResponsesRequest,
        conversation: list[Item],
        spaces: dict[str, tuple[str, str]],
    ) -> AsyncIterator[str]:
        out, seq = Output(spaces, streaming=True), 0

        def emit(ev: dict[str, Any]) -> str:
            nonlocal seq
            ev["sequence_number"] = seq
            seq += 1
            return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"

        try:
            head = response(rid, req, "in_progress", [], None, 0)
            yield emit({"type": "response.created", "response": head})
            yield emit({"type": "response.in_progress", "response": head})
            async for ev in run.events():
                if ev.finish_reason == "error":
                    e = end_error(run.state, ev)
                    failed = response(rid, req, "failed", out.items, None, 0)
                    failed["error"] = {"code": "server_error", "message": e.message}
                    yield emit({"type": "response.failed", "response": failed})
                    return
                for item in out.feed(reply.feed(ev)):
                    yield emit(item)
                if ev.finish_reason is not None:
                    for item in out.stop():
                        yield emit(item)
                    status = "incomplete" if ev.finish_reason == "length" else "completed"
                    done = response(rid, req, status, out.items, ev.usage, reply.reasoning_tokens)
                    if req.store:
                        store.put(done, [*conversation, *as_items(out.items)])
                    kind = "response.completed" if status == "completed" else "response.incomplete"
                    yield emit({"type": kind, "response": done})
        finally:
            run.close()

    @r.post("/v1/responses", dependencies=auth)
    async def create(request: Request) -> Any:
        req = await read_body(request, ResponsesRequest, state.max_body)
        served = await svc.model(req.model, req.keep_alive)
        req.model = served.name  # what each response says answered
        history: list[Item] = []
        if req.previous_response_id is not None:
            got = store.get(req.previous_response_id)
            if got is None:
                e = not_found(req.previous_response_id)
                e.param = "previous_response_id"
                raise e
            history = got[1]
        with served.held():
            chat, conversation, spaces = to_chat(req, history, served.model)
            prep = await svc.prepare(served, prepare_chat, chat, names=NAMES)
            rid = new_id("resp").replace("-", "_")
            reply = svc.chat_reply(served, prep, bool(chat.logprobs))
            run = svc.submit(served, prep, rid, request)
        if req.stream:
            return StreamingResponse(
                stream(run, reply, rid, req, conversation, spaces),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        out = Output(spaces)
        ev = await collect(run, lambda ev: out.feed(reply.feed(ev)))
        out.stop()
        status = "incomplete" if ev.finish_reason == "length" else "completed"
        done = response(rid, req, status, out.items, ev.usage, reply.reasoning_tokens)
        if req.store:
            store.put(done, [*conversation, *as_items(out.items)])
        return done

    @r.get("/v1/responses/{rid}", dependencies=auth)
    async def get(rid: str) -> dict[str, Any]:
        got = store.get(rid)
        if got is None:
            raise not_found(rid)
        return got[0]

    @r.delete("/v1/responses/{rid}", dependencies=auth)
    async def delete(rid: str) -> dict[str, Any]:
        if not store.delete(rid):
            raise not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    return r
