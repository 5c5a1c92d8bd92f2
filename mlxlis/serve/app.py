"""The HTTP API (FastAPI): /v1/models, /v1/chat/completions, /v1/completions, /health.

A request is read (bounded in bytes), validated (schemas.py), prepared on a worker thread
(prepare.py: template, tokens, limits) and submitted to the engine; its events become one
JSON response or a stream of server-sent events (reply.py, openai_format.py). A client that
leaves cancels its request: a task waits for the ASGI disconnect message for as long as the
request runs. Every refusal is an OpenAI-shaped error body.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from mlxlis.generation.samples import samples_of
from mlxlis.serve import anthropic, choices, embeddings, metrics, ollama, responses, transcriptions
from mlxlis.serve.listings import Listing
from mlxlis.serve.openai_format import APIError, Head, new_id
from mlxlis.serve.pool import PoolError, Served
from mlxlis.serve.prepare import prepare_chat, prepare_completion
from mlxlis.serve.reply import CompletionReply
from mlxlis.serve.schemas import ChatCompletionRequest, CompletionRequest
from mlxlis.serve.service import (
    Service,
    State,
    error_shape,
    log,
    pool_error,
    read_body,
)
from mlxlis.serve.tracing import HEADER, RequestIds, current

import mlx.core as mx
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

__all__ = ["State", "create_app", "log"]


def create_app(state: State) -> FastAPI:
    app = FastAPI(title="mlxlis", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        if e.retry_after is not None:
            headers["Retry-After"] = str(e.retry_after)
        if not e.logged:  # a request that ran was logged when it ended (Run.close)
            log.info("%s %s %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(error_shape(request.url.path, e), status_code=e.status, headers=headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        log.error("%s %s 500 %s: %s", request.method, request.url.path, type(e).__name__, e)
        err = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
        # answered outside RequestIds (by Starlette's outermost middleware): its id added here
        traced = current()
        headers = {HEADER: traced.id} if traced is not None else {}
        return JSONResponse(error_shape(request.url.path, err), status_code=500, headers=headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        err = APIError(e.status_code, str(e.detail), code=code)
        return JSONResponse(error_shape(request.url.path, err), status_code=e.status_code)

    svc = Service(state)

    async def check_key(request: Request) -> None:
        svc.check_key(request)

    auth = [Depends(check_key)]
    pool = state.pool

    def card(x: Listing) -> dict[str, Any]:
        served = pool.loaded.get(x.base or x.name)  # an adapter's: its model's
        adapter = {"parent": x.base} if x.base else {}
        return {
            "id": x.name,
            "object": "model",
            "created": state.created,
            "owned_by": "mlxlis",
            "context_length": served.target.max_context if served is not None else None,
            "family": x.family,
            "format": x.format,
            "quantization": x.quant,
            "size": x.size,
            "loaded": served is not None,
            **adapter,
        }

    @app.get("/health")
    async def health() -> Any:
        counts = [s.engine.counts for s in pool.loaded.values()]
        fatal = state.fatal  # an engine stopped on its own: nothing more is served
        body = {
            "status": "error" if fatal else "stopping" if state.stopping else "ok",
            **({"error": fatal} if fatal else {}),
            "model": pool.default,
            "running": sum(r for r, _ in counts),
            "waiting": sum(w for _, w in counts),
            "prefix_cache_bytes": sum(prefix_bytes(s) for s in pool.loaded.values()),
            "memory_bytes": mx.get_active_memory(),  # MLX's arrays now (weights included)
            "memory_budget_bytes": pool.budget,
            "loaded": {s.name: loaded_report(s) for s in pool.loaded.values()},
        }
        if len(pool.loaded) == 1:  # a server of one model: its memory at the top, as before
            body |= memory_report(next(iter(pool.loaded.values())).engine)
        return JSONResponse(body, status_code=503) if fatal else body

    @app.get("/v1/models", dependencies=auth)
    async def models(loaded: bool = False) -> dict[str, Any]:
        """Every model the server can serve (`?loaded=true`: those loaded now)."""
        shown = [x for x in pool.listings() if not loaded or (x.base or x.name) in pool.loaded]
        return {"object": "list", "data": [card(x) for x in shown]}

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def model(name: str) -> dict[str, Any]:
        try:
            return card(pool.listing(name))
        except PoolError as e:
            raise pool_error(e) from None

    @app.get("/lora-adapters", dependencies=auth)
    async def lora_adapters(model: str | None = None) -> list[dict[str, Any]]:
        """llama.cpp's list of a model's adapters (the default model's without `model`): the
        ids its requests' `lora` field names, each at scale 1 (a request sets its own)."""
        try:
            listing = pool.listing(model)
        except PoolError as e:
            raise pool_error(e) from None
        base = listing.base or listing.name
        return [
            {"id": i, "name": name, "model": f"{base}:{name}", "path": str(a.path), "scale": 1.0}
            for i, (name, a) in enumerate(pool.adapters.get(base, {}).items())
        ]

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request) -> Any:
        req = await read_body(request, ChatCompletionRequest, state.max_body)
        served = await svc.model(req.model, req.keep_alive)
        with served.held():
            n = choices.check_n(req.n, served.engine.max_active)
            prep = await svc.prepare(served, prepare_chat, req)
            head = Head(new_id("chatcmpl"), int(time.time()), served.name, served.fingerprint)
            replies = [svc.chat_reply(served, prep, bool(req.logprobs)) for _ in range(n)]
            runs = svc.submit_samples(served, samples_of(prep.gen, n), head.id, request)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return sse_response(choices.chat_stream(runs, head, replies, include_usage))
        finals = await choices.collect_all(runs, [r.feed for r in replies])
        return choices.chat_response(head, replies, finals)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Any:
        req = await read_body(request, CompletionRequest, state.max_body)
        served = await svc.model(req.model, req.keep_alive)
        with served.held():
            batch = served.engine.max_active
            n = choices.check_n(req.n, batch)
            runs_n = choices.check_best_of(req.best_of, n, req.stream, batch)
            prep = await svc.prepare(served, prepare_completion, req)
            head = Head(new_id("cmpl"), int(time.time()), served.name, served.fingerprint)
            logprobs = req.logprobs is not None
            replies = [CompletionReply(served.token_text, logprobs=logprobs) for _ in range(runs_n)]
            gen = prep.gen  # best_of ranks by logprobs: every sample reads its own
            if runs_n > n:
                gen = replace(gen, top_logprobs=gen.top_logprobs or 0)
            runs = svc.submit_samples(served, samples_of(gen, runs_n), head.id, request)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return sse_response(choices.completion_stream(runs, head, replies, include_usage))
        scores = [choices.Score() for _ in runs]
        feeds = [
            lambda ev, r=r, s=s: (r.feed(ev), s.add(ev))
            for r, s in zip(replies, scores, strict=True)
        ]
        finals = await choices.collect_all(runs, feeds)
        chosen = choices.best(scores, n) if runs_n > n else None
        return choices.completion_response(head, replies, finals, chosen)

    for api in (anthropic, responses, ollama, embeddings, transcriptions):
        app.include_router(api.router(svc, auth))
    app.include_router(metrics.router(state.metrics, auth))
    app.add_middleware(HeadAsGet)
    if state.allowed_origins:  # none by default: no CORS header at all, browsers refuse
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[HEADER],
            max_age=600,
        )
    # the outermost of ours: a CORS refusal and a HEAD get an id too, and are counted
    app.add_middleware(RequestIds, on_answer=state.metrics.answered)
    return app


class HeadAsGet:
    """HEAD answered wherever GET is (RFC 9110 9.3.2: GET's headers, no body; uvicorn drops
    the body of a HEAD request's answer): health checks send it, and Ollama answers it on
    /api/tags and /api/version."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}  # uvicorn keeps its own scope: still HEAD
        await self.app(scope, receive, send)


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def memory_report(engine: Any) -> dict[str, Any]:
    """/health's memory fields of a model: the KV format, bytes per token and the room for
    caches."""
    model, plan = engine.model, engine.memory
    out: dict[str, Any] = {"kv_format": str(model.kv_format or "dense")}
    if plan is not None:
        fp = plan.footprint
        out |= {
            "weights_bytes": fp.weights,
            "kv_bytes_per_token": fp.per_token,
            "kv_fixed_bytes": fp.kv_bytes(0),
            "cache_room_bytes": plan.room,
        }
    return out


def loaded_report(served: Served) -> dict[str, Any]:
    """A loaded model in /health: its requests, memory and keep-alive."""
    running, waiting = served.engine.counts
    expires = served.expires()
    return {
        "running": running,
        "waiting": waiting,
        "prefix_cache_bytes": prefix_bytes(served),
        "expires_in_s": None if expires is None else round(expires - time.monotonic(), 1),
        **memory_report(served.engine),
    }


def prefix_bytes(served: Served) -> int:
    """What its prefix cache holds (none for a model that does not generate)."""
    prefix = served.engine.prefix
    return prefix.bytes if prefix is not None else 0
