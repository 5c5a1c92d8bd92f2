"""Ollama's API: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version` and `/`, so that `mlxlis serve --port 11434` is all an Ollama client needs.

A thin adapter, like anthropic.py: a chat body becomes the server's chat request (`thinking`
as reasoning_content, tool calls with object arguments, `tool_name` as the tool message's name,
`think` as the template's thinking switch, `format` as response_format, `options` as the
sampling values), prepared and generated like any other; /api/generate renders its prompt as a
user turn through the chat template, or (`raw`) tokenizes it as it is. Replies stream as
NDJSON, one object a line, the last with `done` and Ollama's counts and durations (in
nanoseconds). Options a local engine has no use for (num_ctx, num_gpu, mirostat, …) and
`keep_alive` are accepted and ignored; `images` (base64) become image parts; what cannot be
honoured (images to a model that does not see, a suffix, a template of the request's own, a
`context` array) is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import cache
from typing import Any, Protocol

from mlxlis import __version__
from mlxlis.generation.events import Event
from mlxlis.runtime.device import device_name
from mlxlis.serve.ollama_models import (
    human,
    model_info,
    parameter_count,
    parameters,
    quantization,
    tag,
    weights_bytes,
)
from mlxlis.serve.ollama_requests import (
    NAMES,
    ChatRequest,
    GenerateRequest,
    ShowRequest,
    bad,
    check_generate,
    generate_chat,
    generate_raw,
    prepare_raw,
    to_chat,
)
from mlxlis.serve.openai_format import APIError, TokenText, chat_logprob, new_id
from mlxlis.serve.prepare import Prepared, prepare_chat
from mlxlis.serve.reply import Delta
from mlxlis.serve.service import Run, Service, collect, end_error, read_body

import mlx.core as mx
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse


class Reply(Protocol):
    content: str
    reasoning: str
    tool_calls: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]

    def feed(self, ev: Event) -> Delta: ...


class RawReply:
    """A raw prompt's reply: the text as it comes (no reasoning split, no tool calls)."""

    def __init__(self, token_text: TokenText, logprobs: bool):
        self.token_text, self.want_logprobs = token_text, logprobs
        self.content, self.reasoning = "", ""
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []

    def feed(self, ev: Event) -> Delta:
        d = Delta(content=ev.text)
        if self.want_logprobs and ev.token is not None and ev.logprob is not None:
            d.logprobs.append(chat_logprob(self.token_text, ev.token, ev.logprob, ev.top_logprobs))
        self.content += d.content
        self.logprobs += d.logprobs
        return d


def tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """One of the reply's calls as Ollama writes it: the arguments as an object."""
    args = call["function"]["arguments"]
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        parsed = {}
    fn = {"index": call.get("index", 0), "name": call["function"]["name"]}
    return {"id": call["id"], "function": {**fn, "arguments": parsed}}


def chat_body(d: Delta) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": d.content}
    if d.reasoning:
        msg["thinking"] = d.reasoning
    if d.tool_calls:
        msg["tool_calls"] = [tool_call(c) for c in d.tool_calls]
    return {"message": msg}


def generate_body(d: Delta) -> dict[str, Any]:
    return {"response": d.content, **({"thinking": d.reasoning} if d.reasoning else {})}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass
class Shape:
    """The objects of one reply: the model's name as asked, the body of a delta (a chat
    message or a generate response), logprobs when asked, the counts at the end."""

    model: str
    body: Callable[[Delta], dict[str, Any]]
    logprobs: bool
    started: int  # time.monotonic_ns() when the request came

    def part(self, d: Delta) -> dict[str, Any]:
        out = {"model": self.model, "created_at": now(), **self.body(d)}
        if self.logprobs and d.logprobs:
            out["logprobs"] = d.logprobs
        return {**out, "done": False}

    def last(self, d: Delta, ev: Event) -> dict[str, Any]:
        u = ev.usage
        return {
            **self.part(d),
            "done": True,
            "done_reason": ev.finish_reason,
            "total_duration": time.monotonic_ns() - self.started,
            "load_duration": 0,  # the model was loaded when the server started
            "prompt_eval_count": u.prompt_tokens,
            "prompt_eval_duration": ns(u.time_to_first_token),
            "eval_count": u.completion_tokens,
            "eval_duration": ns(u.decode_seconds),
        }


def line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def ndjson(run: Run, reply: Reply, shape: Shape) -> AsyncIterator[str]:
    try:
        async for ev in run.events():
            if ev.finish_reason == "error":
                yield line({"error": end_error(run.state, ev).message})
                return
            d = reply.feed(ev)
            if d:
                yield line(shape.part(d))
            if ev.finish_reason is not None:
                yield line(shape.last(Delta(), ev))
    finally:
        run.close()


def loaded(model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer to Ollama's "load the model" (a request with nothing to answer): the one
    model is loaded while the server runs, and stays loaded (keep_alive 0 unloads nothing)."""
    return {"model": model, "created_at": now(), **body, "done": True, "done_reason": "load"}


def router(svc: Service, auth: list) -> APIRouter:
    r = APIRouter()
    state = svc.state
    name = tag(state.model_id)
    known = state.names | {tag(n) for n in state.names}

    def check(model: str) -> None:
        if model not in known:
            raise APIError(404, f"model '{model}' not found", param="model")

    @cache
    def count() -> int:
        return parameter_count(state.target.model.net)

    @cache
    def card() -> dict[str, Any]:
        model = state.target.model
        details = {
            "parent_model": "",
            "format": "gguf" if model.format == "gguf" else "safetensors",
            "family": model.config.family,
            "families": [model.config.family],
            "parameter_size": human(count()),
            "quantization_level": quantization(model),
        }
        return {
            "name": name,
            "model": name,
            "modified_at": datetime.fromtimestamp(model.path.stat().st_mtime, timezone.utc),
            "size": weights_bytes(model.path),
            "digest": hashlib.sha256(state.fingerprint.encode()).hexdigest(),
            "details": details,
        }

    async def listed() -> dict[str, Any]:
        return await asyncio.to_thread(card)  # the first time, reads a GGUF's header

    async def prepared(fn: Callable[..., Prepared], body: Any) -> Prepared:
        return await svc.prepare(fn, body, names=NAMES)

    async def answer(
        request: Request, prep: Prepared, reply: Reply, shape: Shape, stream: bool
    ) -> Any:
        run = svc.submit(prep, new_id("ollama"), request)
        if stream:
            return StreamingResponse(ndjson(run, reply, shape), media_type="application/x-ndjson")
        ev = await collect(run, reply.feed)
        return shape.last(
            Delta(reply.content, reply.reasoning, reply.tool_calls, reply.logprobs), ev
        )

    @r.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def root() -> str:
        return "Ollama is running"  # what clients probe before anything else

    @r.post("/api/chat", dependencies=auth)
    async def chat(request: Request) -> Any:
        started = time.monotonic_ns()
        req = await read_body(request, ChatRequest, state.max_body)
        check(req.model)
        if not req.messages:
            return loaded(req.model, {"message": {"role": "assistant", "content": ""}})
        prep = await prepared(prepare_chat, to_chat(req, state.target.model))
        shape = Shape(req.model, chat_body, bool(req.logprobs), started)
        return await answer(
            request, prep, svc.chat_reply(prep, bool(req.logprobs)), shape, req.stream
        )

    @r.post("/api/generate", dependencies=auth)
    async def generate(request: Request) -> Any:
        started = time.monotonic_ns()
        req = await read_body(request, GenerateRequest, state.max_body)
        check(req.model)
        check_generate(req)
        if not req.prompt and not req.images:
            return loaded(req.model, {"response": ""})
        shape = Shape(req.model, generate_body, bool(req.logprobs), started)
        reply: Reply
        if req.raw:
            prep = await prepared(prepare_raw, generate_raw(req))
            reply = RawReply(state.token_text, bool(req.logprobs))
        else:
            chat = generate_chat(req, state.target.model)
            prep = await prepared(prepare_chat, chat)
            reply = svc.chat_reply(prep, bool(req.logprobs))
        return await answer(request, prep, reply, shape, req.stream)

    @r.get("/api/tags", dependencies=auth)
    async def tags() -> dict[str, Any]:
        return {"models": [await listed()]}

    @r.post("/api/show", dependencies=auth)
    async def show(request: Request) -> dict[str, Any]:
        req = await read_body(request, ShowRequest, state.max_body)
        asked = req.model or req.name
        if not asked:
            raise bad("is required", "model")
        check(asked)
        model, listing = state.target.model, await listed()
        # the template is Jinja, the model's own: given in `template`, not as a TEMPLATE line
        modelfile = f"# served by mlxlis serve\nFROM {model.path}\n" + "".join(
            f"PARAMETER {row}\n" for row in parameters(state).splitlines()
        )
        return {
            "modelfile": modelfile,
            "parameters": parameters(state),
            "template": model.template.text if model.template is not None else "",
            "details": listing["details"],
            "model_info": model_info(model, state.target.max_context, count()),
            "capabilities": [
                "completion",
                *(["tools"] if "tools" in model.template_variables else []),
                *(["thinking"] if model.supports_thinking else []),
            ],
            "modified_at": listing["modified_at"],
        }

    @r.get("/api/ps", dependencies=auth)
    async def ps() -> dict[str, Any]:
        listing = {k: v for k, v in (await listed()).items() if k != "modified_at"}
        size = mx.get_active_memory()  # MLX's arrays now, the weights included
        # loaded for as long as the server runs: Ollama's keep_alive -1, which `ollama ps`
        # shows as "Forever" (over 20 years ahead)
        expires = datetime.now(timezone.utc) + timedelta(days=365 * 100)
        return {
            "models": [
                {
                    **listing,
                    "size": size,
                    "size_vram": 0 if device_name() == "cpu" else size,
                    "expires_at": expires.isoformat(),
                    "context_length": state.target.max_context,
                }
            ]
        }

    @r.get("/api/version", dependencies=auth)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return r
