"""Ollama's API: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version` and `/`, so that `mlxlis serve --port 11434` is all an Ollama client needs.

A thin adapter, like anthropic.py: a chat body becomes the server's chat request (`thinking`
as reasoning_content, tool calls with object arguments, `tool_name` as the tool message's name,
`think` as the template's thinking switch, `format` as response_format, `options` as the
sampling values), prepared and generated like any other; /api/generate renders its prompt as a
user turn through the chat template, or (`raw`) tokenizes it as it is. Replies stream as
NDJSON, one object a line, the last with `done` and Ollama's counts and durations (in
nanoseconds). The runner's own options (num_gpu, num_thread, …) are accepted as no-ops, each
with its reason in fields.NO_OPS; `keep_alive` says how long the model stays loaded; `images`
(base64) become image parts; what cannot be honoured (images to a model that does not see, a
suffix, a template of the request's own, a `context` array, tfs_z) is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from mlxlis import __version__
from mlxlis.generation.events import Event
from mlxlis.runtime.device import device_name
from mlxlis.serve.listings import Listing
from mlxlis.serve.ollama_models import (
    human,
    model_info,
    parameter_count,
    parameters,
    quantization,
    tag,
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
from mlxlis.serve.openai_format import TokenText, chat_logprob, new_id
from mlxlis.serve.pool import Served
from mlxlis.serve.prepare import Prepared, prepare_chat
from mlxlis.serve.reply import Delta
from mlxlis.serve.service import Run, Service, collect, end_error, read_body

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


def loaded(model: str, body: dict[str, Any], unloaded: bool = False) -> dict[str, Any]:
    """The answer to Ollama's "load the model" (a request with nothing to answer), or to its
    "unload it" (`keep_alive: 0`)."""
    reason = "unload" if unloaded else "load"
    return {"model": model, "created_at": now(), **body, "done": True, "done_reason": reason}


def card(x: Listing, served: Served | None, fingerprint: str) -> dict[str, Any]:
    """A model as /api/tags lists it (its parameter count once it is loaded)."""
    details = {
        "parent_model": tag(x.base) if x.base else "",  # an adapter's model
        "format": x.format or "safetensors",
        "family": x.family,
        "families": [x.family] if x.family else None,
        "parameter_size": human(parameter_count(served.model.net)) if served else "",
        "quantization_level": quantization(served.model) if served else x.quant,
    }
    modified = datetime.fromtimestamp(x.path.stat().st_mtime, timezone.utc) if x.path else now()
    return {
        "name": tag(x.name),
        "model": tag(x.name),
        "modified_at": modified,
        "size": x.size or 0,
        "digest": hashlib.sha256(fingerprint.encode()).hexdigest(),
        "details": details,
    }


def router(svc: Service, auth: list) -> APIRouter:
    r = APIRouter()
    state = svc.state
    pool = state.pool

    def listed(x: Listing) -> dict[str, Any]:
        served = pool.loaded.get(x.base or x.name)  # an adapter's: its model's
        return card(x, served, served.fingerprint if served else f"{x.name}|{x.ref}|{x.size}")

    async def answer(
        served: Served, request: Request, prep: Prepared, reply: Reply, shape: Shape, stream: bool
    ) -> Any:
        run = svc.submit(served, prep, new_id("ollama"), request)
        if stream:
            return StreamingResponse(ndjson(run, reply, shape), media_type="application/x-ndjson")
        ev = await collect(run, reply.feed)
        return shape.last(
            Delta(reply.content, reply.reasoning, reply.tool_calls, reply.logprobs), ev
        )

    async def load_only(req: ChatRequest | GenerateRequest, body: dict[str, Any]) -> Any:
        """An empty request: the model loaded (or with keep_alive 0, unloaded)."""
        if req.keep_alive is not None and svc.keep_alive(req.keep_alive) == 0:
            await svc.unload(req.model)  # a model with requests in flight: once they end
            return loaded(req.model, body, unloaded=True)
        await svc.model(req.model, req.keep_alive, task=None)
        return loaded(req.model, body)

    @r.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def root() -> str:
        return "Ollama is running"  # what clients probe before anything else

    @r.post("/api/chat", dependencies=auth)
    async def chat(request: Request) -> Any:
        started = time.monotonic_ns()
        req = await read_body(request, ChatRequest, state.max_body)
        if not req.messages:
            return await load_only(req, {"message": {"role": "assistant", "content": ""}})
        served = await svc.model(req.model, req.keep_alive)
        with served.held():
            prep = await prepared(served, prepare_chat, to_chat(req, served.model))
            shape = Shape(req.model, chat_body, bool(req.logprobs), started)
            reply = svc.chat_reply(served, prep, bool(req.logprobs))
            return await answer(served, request, prep, reply, shape, req.stream)

    async def prepared(served: Served, fn: Callable[..., Prepared], body: Any) -> Prepared:
        return await svc.prepare(served, fn, body, names=NAMES)

    @r.post("/api/generate", dependencies=auth)
    async def generate(request: Request) -> Any:
        started = time.monotonic_ns()
        req = await read_body(request, GenerateRequest, state.max_body)
        check_generate(req)
        if not req.prompt and not req.images:
            return await load_only(req, {"response": ""})
        served = await svc.model(req.model, req.keep_alive)
        with served.held():
            shape = Shape(req.model, generate_body, bool(req.logprobs), started)
            reply: Reply
            if req.raw:
                prep = await prepared(served, prepare_raw, generate_raw(req))
                reply = RawReply(served.token_text, bool(req.logprobs))
            else:
                chat = generate_chat(req, served.model)
                prep = await prepared(served, prepare_chat, chat)
                reply = svc.chat_reply(served, prep, bool(req.logprobs))
            return await answer(served, request, prep, reply, shape, req.stream)

    @r.get("/api/tags", dependencies=auth)
    async def tags() -> dict[str, Any]:
        # the first time, reads each GGUF's header
        return {"models": await asyncio.to_thread(lambda: [listed(x) for x in pool.listings()])}

    @r.post("/api/show", dependencies=auth)
    async def show(request: Request) -> dict[str, Any]:
        req = await read_body(request, ShowRequest, state.max_body)
        asked = req.model or req.name
        if not asked:
            raise bad("is required", "model")
        served = await svc.model(asked, task=None)  # loaded: the template and shape are the model's
        with served.held():
            model, listing = served.model, await asyncio.to_thread(listed, served.listing)
        count = parameter_count(model.net)
        # the template is Jinja, the model's own: given in `template`, not as a TEMPLATE line
        modelfile = f"# served by mlxlis serve\nFROM {model.path}\n" + "".join(
            f"PARAMETER {row}\n" for row in parameters(served).splitlines()
        )
        return {
            "modelfile": modelfile,
            "parameters": parameters(served),
            "template": model.template.text if model.template is not None else "",
            "details": listing["details"],
            "model_info": model_info(model, served.target.max_context, count),
            "capabilities": [
                "completion",
                *(["tools"] if "tools" in model.template_variables else []),
                *(["thinking"] if model.supports_thinking else []),
            ],
            "modified_at": listing["modified_at"],
        }

    @r.get("/api/ps", dependencies=auth)
    async def ps() -> dict[str, Any]:
        out = []
        for served in list(pool.loaded.values()):
            listing = {k: v for k, v in listed(served.listing).items() if k != "modified_at"}
            size = served.reserve + served.engine.reserved()  # weights, prefix cache, caches
            expires = served.expires()
            # forever: Ollama's keep_alive -1, which `ollama ps` shows as "Forever" (over 20
            # years ahead)
            left = 365 * 100 * 86400.0 if expires is None else max(0.0, expires - time.monotonic())
            until = datetime.now(timezone.utc) + timedelta(seconds=left)
            out.append(
                {
                    **listing,
                    "size": size,
                    "size_vram": 0 if device_name() == "cpu" else size,
                    "expires_at": until.isoformat(),
                    "context_length": served.target.max_context,
                }
            )
        return {"models": out}

    @r.get("/api/version", dependencies=auth)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return r
