"""The HTTP API (FastAPI): /v1/models, /v1/chat/completions, /v1/completions, /health.

A request is read (bounded in bytes), validated (schemas.py), prepared on a worker thread
(prepare.py: template, tokens, limits) and submitted to the engine; its events become one
JSON response or a stream of server-sent events (reply.py, openai_format.py). A client that
leaves cancels its request: a task waits for the ASGI disconnect message for as long as the
request runs. Every refusal is an OpenAI-shaped error body.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from mlxlis.errors import MlxlisError
from mlxlis.generation.engine import Engine, QueueFullError, Stream
from mlxlis.generation.events import Event
from mlxlis.serve.openai_format import (
    APIError,
    Head,
    TokenText,
    error_body,
    new_id,
    sse,
    usage_dict,
)
from mlxlis.serve.prepare import Prepared, Target, prepare_chat, prepare_completion
from mlxlis.serve.reply import ChatReply, CompletionReply, finish_reason
from mlxlis.serve.schemas import ChatCompletionRequest, CompletionRequest, param_path

import mlx.core as mx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("mlxlis.serve")
MAX_BODY_BYTES = 8 << 20  # a request body; 100k tokens of text are < 1 MiB
B = TypeVar("B", bound=BaseModel)


@dataclass
class State:
    """What the routes share: the model (through `target`), the engine and the settings."""

    target: Target
    engine: Engine
    model_id: str  # the name /v1/models lists and responses carry
    names: frozenset[str]  # the names a request's "model" may use
    fingerprint: str
    api_key: str | None = None
    max_body: int = MAX_BODY_BYTES
    stopping: bool = False  # set when the server shuts down: unfinished requests get 503
    created: int = field(default_factory=lambda: int(time.time()))
    # prompts are rendered and tokenized off the event loop, one at a time
    worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="mlxlis-prepare")
    )

    def __post_init__(self) -> None:
        tok = self.target.model.tokenizer
        self.token_text = TokenText(
            lambda ids: tok.decode(ids, clean_spaces=False), tok.token_bytes
        )


def validation_error(e: ValidationError) -> APIError:
    """pydantic's errors -> one 400 naming the first offending field."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {first['msg']}", code="invalid_json")
    param = param_path(first["loc"])
    if param is None:
        return APIError(400, f"the body must be a JSON object: {first['msg']}", code="invalid_json")
    msgs = list(dict.fromkeys(e["msg"] for e in errors if param_path(e["loc"]) == param))
    kind, code = first["type"], "invalid_value"
    if kind == "missing":
        code = "missing_required_parameter"
    elif kind.endswith(("_type", "_parsing")):
        code = "invalid_type"
    return APIError(400, f"{param}: {'; or '.join(msgs)}", param=param, code=code)


async def read_body(request: Request, cls: type[B], limit: int) -> B:
    too_big = APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        return cls.model_validate_json(bytes(body))
    except ValidationError as e:
        raise validation_error(e) from None


class Run:
    """One submitted request: its stream, the task that notices the client leaving, the log
    line at the end."""

    def __init__(self, state: State, rid: str, stream: Stream, request: Request, prompt: int):
        self.state, self.rid, self.stream, self.prompt = state, rid, stream, prompt
        self.tokens, self.final = 0, None
        self.watcher = asyncio.create_task(self._watch(request.receive))
        self.closed = False

    async def _watch(self, receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.stream.cancel()

    async def events(self) -> AsyncIterator[Event]:
        async for ev in self.stream:
            if ev.token is not None:
                self.tokens += 1
            if ev.finish_reason is not None:
                self.final = ev
            yield ev

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.watcher.cancel()
        self.stream.cancel()  # a no-op once it finished; otherwise the client left
        ev = self.final
        if ev is None or ev.usage is None:
            log.info("%s cancelled prompt=%d generated=%d", self.rid, self.prompt, self.tokens)
            return
        u = ev.usage
        tps = (u.completion_tokens - 1) / u.decode_seconds if u.decode_seconds > 0 else 0.0
        log.info(
            "%s %s prompt=%d cached=%d generated=%d ttft=%.3fs %.1f tok/s%s",
            self.rid,
            ev.finish_reason,
            u.prompt_tokens,
            u.cached_tokens,
            u.completion_tokens,
            u.time_to_first_token,
            tps,
            f" error={ev.error}" if ev.error else "",
        )


def end_error(state: State, ev: Event) -> APIError:
    """The answer to a request the engine ended with an error (already logged)."""
    if state.stopping:
        e = APIError(
            503,
            ev.error or "the server is shutting down",
            type="server_error",
            code="server_shutting_down",
        )
    else:
        e = APIError(500, ev.error or "generation failed", type="server_error")
    e.logged = True
    return e


async def chat_stream(
    run: Run, head: Head, reply: ChatReply, include_usage: bool
) -> AsyncIterator[str]:
    try:
        yield sse(head.chat_chunk({"role": "assistant", "content": ""}, usage=include_usage))
        async for ev in run.events():
            if ev.finish_reason == "error":
                yield sse(end_error(run.state, ev).body())
                break
            d = reply.feed(ev)
            if d:
                yield sse(
                    head.chat_chunk(
                        ChatReply.delta_dict(d),
                        usage=include_usage,
                        logprobs=d.logprobs if reply.want_logprobs else None,
                    )
                )
            if ev.finish_reason is not None:
                finish = finish_reason(ev.finish_reason, bool(reply.tool_calls))
                yield sse(head.chat_chunk({}, finish=finish, usage=include_usage))
                if include_usage and ev.usage is not None:
                    usage = usage_dict(ev.usage, reply.reasoning_tokens)
                    yield sse(head.usage_chunk("chat.completion.chunk", usage))
        yield sse("[DONE]")
    finally:
        run.close()


async def completion_stream(
    run: Run, head: Head, reply: CompletionReply, include_usage: bool
) -> AsyncIterator[str]:
    try:
        async for ev in run.events():
            if ev.finish_reason == "error":
                yield sse(end_error(run.state, ev).body())
                break
            text, lp = reply.feed(ev)
            if text or lp is not None:
                yield sse(head.completion_chunk(text, logprobs=lp, usage=include_usage))
            if ev.finish_reason is not None:
                yield sse(head.completion_chunk("", finish=ev.finish_reason, usage=include_usage))
                if include_usage and ev.usage is not None:
                    yield sse(head.usage_chunk("text_completion", usage_dict(ev.usage)))
        yield sse("[DONE]")
    finally:
        run.close()


async def collect(run: Run, feed: Callable[[Event], Any]) -> Event:
    """Every event through `feed`; the last one (an error ends as an APIError)."""
    try:
        async for ev in run.events():
            if ev.finish_reason == "error":
                raise end_error(run.state, ev)
            feed(ev)
    finally:
        run.close()
    assert run.final is not None
    return run.final


def create_app(state: State) -> FastAPI:
    app = FastAPI(title="mlxlis", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        if not e.logged:  # a request that ran was logged when it ended (Run.close)
            log.info("%s %s %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        log.error("%s %s 500 %s: %s", request.method, request.url.path, type(e).__name__, e)
        body = error_body(f"internal error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(body, status_code=500)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(error_body(str(e.detail), code=code), status_code=e.status_code)

    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), state.api_key.encode()
        ):
            raise APIError(
                401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key"
            )

    auth = [Depends(check_key)]

    def check_model(name: str | None) -> None:
        if name is not None and name not in state.names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server runs {state.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def card() -> dict[str, Any]:
        return {
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "mlxlis",
            "context_length": state.target.max_context,
        }

    async def prepare(fn: Callable[..., Prepared], req: BaseModel) -> Prepared:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(state.worker, partial(fn, state.target, req))

    def submit(prep: Prepared, rid: str, request: Request) -> Run:
        try:
            stream = state.engine.submit(prep.gen, loop=asyncio.get_running_loop())
        except QueueFullError as e:
            raise APIError(
                429,
                f"too many requests waiting, retry later ({e})",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            ) from None
        except MlxlisError as e:
            if state.stopping:
                raise APIError(
                    503, str(e), type="server_error", code="server_shutting_down"
                ) from None
            raise APIError(400, str(e), param=getattr(e, "field", None)) from None
        n = len(prep.gen.prompt)
        log.debug("%s %s prompt=%d %s", rid, request.url.path, n, prep.gen.params)
        return Run(state, rid, stream, request, n)

    def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = state.engine.counts
        return {
            "status": "stopping" if state.stopping else "ok",
            "model": state.model_id,
            "running": running,
            "waiting": waiting,
            "prefix_cache_bytes": state.engine.prefix.bytes,
            "memory_bytes": mx.get_active_memory(),  # MLX's arrays now (weights included)
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return card()

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request) -> Any:
        req = await read_body(request, ChatCompletionRequest, state.max_body)
        check_model(req.model)
        prep = await prepare(prepare_chat, req)
        head = Head(new_id("chatcmpl"), int(time.time()), state.model_id, state.fingerprint)
        assert prep.prompt is not None
        reply = ChatReply(
            state.target.model.tokenizer,
            state.token_text,
            prep.prompt,
            logprobs=bool(req.logprobs),
            tools=prep.tools,
            tool_format=prep.tool_format,
            forced=prep.forced,
        )
        run = submit(prep, head.id, request)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return sse_response(chat_stream(run, head, reply, include_usage))
        ev = await collect(run, reply.feed)
        assert ev.usage is not None
        return head.chat_response(
            reply.message(),
            finish_reason(ev.finish_reason, bool(reply.tool_calls)),
            reply.logprobs if reply.want_logprobs else None,
            usage_dict(ev.usage, reply.reasoning_tokens),
        )

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Any:
        req = await read_body(request, CompletionRequest, state.max_body)
        check_model(req.model)
        prep = await prepare(prepare_completion, req)
        head = Head(new_id("cmpl"), int(time.time()), state.model_id, state.fingerprint)
        reply = CompletionReply(state.token_text, logprobs=req.logprobs is not None)
        run = submit(prep, head.id, request)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return sse_response(completion_stream(run, head, reply, include_usage))
        ev = await collect(run, reply.feed)
        assert ev.usage is not None and ev.finish_reason is not None
        return head.completion_response(
            reply.text, ev.finish_reason, reply.logprobs, usage_dict(ev.usage)
        )

    return app
