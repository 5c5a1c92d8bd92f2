"""What every API the server speaks shares: the state, bodies read and validated, the model a
request names (serve/pool.py: loaded on demand), requests prepared off the event loop and
submitted to that model's engine, the stream of a submitted one.

Each API (the OpenAI routes in app.py, anthropic.py, responses.py, ollama.py) is a thin
adapter: its body becomes the server's one chat request (schemas.ChatCompletionRequest,
prepared by prepare.py), the engine's events its reply; refusals are APIErrors, written in the
shape of the API the request came to (`error_shape`). A route holds its model
(`Served.held`) from the moment it has it until its request is submitted; the request's Run
holds it until the request ends: a held model is never unloaded.
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
from mlxlis.generation.core import Request as GenRequest
from mlxlis.generation.engine import (
    Engine,
    MemoryFullError,
    QueueFullError,
    Stream,
    TooLongForMemoryError,
)
from mlxlis.generation.events import Event, Usage
from mlxlis.generation.speculative import speculation_line
from mlxlis.serve.images import FETCHERS, SCHEMES, fetch
from mlxlis.serve.metrics import Metrics
from mlxlis.serve.openai_format import APIError
from mlxlis.serve.pool import Pool, PoolError, Served, keep_alive_seconds
from mlxlis.serve.prepare import Prepared
from mlxlis.serve.reply import ChatReply
from mlxlis.serve.schemas import (
    FIELD_NAMES,
    ChatCompletionRequest,
    _Body,
    field_names,
    offending,
    param_path,
)
from mlxlis.serve.tracing import note_model

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

log = logging.getLogger("mlxlis.serve")
MAX_BODY_BYTES = 8 << 20  # a request body; 100k tokens of text are < 1 MiB
MAX_VISION_BODY_BYTES = 64 << 20  # a model that sees: base64 images (4/3 of their bytes)
B = TypeVar("B", bound=_Body)
# a model's task -> how a refusal names its kind, and the route it answers on
TASKS = {
    "generate": ("a chat model", "/v1/chat/completions"),
    "embed": ("an embedding model", "/v1/embeddings"),
    "rerank": ("a reranking model", "/v1/rerank"),
}


@dataclass
class State:
    """What the routes share: the models (`pool`) and the server's settings."""

    pool: Pool
    api_key: str | None = None
    max_body: int = MAX_BODY_BYTES
    stopping: bool = False  # set when the server shuts down: unfinished requests get 503
    fatal: str | None = None  # why an engine stopped on its own: the server exits
    created: int = field(default_factory=lambda: int(time.time()))
    responses_store_bytes: int = 64 << 20  # /v1/responses kept for previous_response_id
    keepalive: float = 10.0  # seconds between keep-alive events of a stream that is quiet
    allow_image_urls: bool = False  # http(s) image URLs fetched (else refused)
    allowed_origins: tuple[str, ...] = ()  # --allowed-origins: browser pages' origins (CORS)
    # prompts are rendered and tokenized off the event loop, one at a time
    worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="mlxlis-prepare")
    )
    metrics: Metrics = field(init=False)  # /metrics: this server's own registry

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.pool)


def validation_error(e: ValidationError, names: frozenset[str] = FIELD_NAMES) -> APIError:
    """pydantic's errors -> one 400 naming the first offending field (schemas.offending)."""
    errors = e.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {errors[0]['msg']}", code="invalid_json")
    param, k = offending(errors, names)
    if param is None:
        return APIError(400, f"the body must be an object: {errors[0]['msg']}", code="invalid_json")
    msgs = list(dict.fromkeys(x["msg"] for x in errors if param_path(x["loc"], names) == param))
    kind, code = errors[k]["type"], "invalid_value"
    if kind == "missing":
        code = "missing_required_parameter"
    elif kind.endswith(("_type", "_parsing")):
        code = "invalid_type"
    return APIError(400, f"{param}: {'; or '.join(msgs)}", param=param, code=code)


_NAMES: dict[type, frozenset[str]] = {}


async def read_body(request: Request, cls: type[B], limit: int) -> B:
    """The body as `cls` (bounded by `limit` bytes), or a 400 / 413 naming what is wrong."""
    too_big = APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
    except ClientDisconnect:  # the client left while sending: no answer reaches it
        raise APIError(499, "the client closed the connection before its body was read") from None
    try:
        req = cls.model_validate_json(bytes(body))
    except ValidationError as e:
        names = _NAMES.setdefault(cls, field_names(cls))
        raise validation_error(e, names) from None
    if (refused := req.refused()) is not None:
        name, why = refused
        raise APIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    return req


FIRST = asyncio.FIRST_COMPLETED
RETRY_AFTER_S = 5  # a 503 for memory: about when a running request may have ended


class Run:
    """One submitted request: its stream, the task that notices the client leaving, the log
    line at the end."""

    def __init__(
        self,
        state: State,
        served: Served,
        rid: str,
        stream: Stream,
        request: Request,
        n: int,
        watch: bool = True,
    ):
        self.state, self.served, self.rid, self.stream, self.prompt = state, served, rid, stream, n
        served.holds += 1  # not unloaded under it (released in close)
        self.tokens, self.final = 0, None
        self.counted = False  # told to the metrics (at its last event, or when it closes)
        # the runs of one HTTP request (its samples, OpenAI's n): the first one's watcher
        # ends them all when the client leaves
        self.group: list[Run] = [self]
        self.watcher = asyncio.create_task(self._watch(request.receive)) if watch else None
        self.closed = False

    async def _watch(self, receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        for run in self.group:
            run.stream.cancel()
            run.close()  # also where the reply never started streaming (its model released)

    async def events(self) -> AsyncIterator[Event]:
        async for ev in self.stream:
            if ev.token is not None:
                self.tokens += 1
            if ev.finish_reason is not None:
                self.final = ev
                self.count()  # before the client reads its end
            yield ev

    def count(self) -> None:
        """Its tokens and latencies told to /metrics, once."""
        if not self.counted:
            self.counted = True
            usage = self.final.usage if self.final is not None else None
            self.state.metrics.ended(self.served.name, usage, self.prompt, self.tokens)

    async def paced(self, every: float) -> AsyncIterator[Event | Usage | None]:
        """The events, with the request's Usage the moment the engine admits it (before its
        prompt is read), and None after each `every` seconds without either (a keep-alive,
        while the request waits for a place or its prompt is read)."""
        admitted = self.stream.admitted
        pending: set[asyncio.Future] = {admitted} if admitted is not None else set()
        events = aiter(self.events())
        nxt = None
        try:
            while True:
                nxt = nxt or asyncio.ensure_future(anext(events))
                done, _ = await asyncio.wait({nxt, *pending}, timeout=every, return_when=FIRST)
                if admitted in done:
                    pending.discard(admitted)
                    yield admitted.result()
                if nxt not in done:
                    if not done:
                        yield None
                    continue
                try:
                    ev = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                yield ev
        finally:
            if nxt is not None:
                nxt.cancel()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.served.release()
        watcher = self.group[0].watcher
        if watcher is not None and all(r.closed for r in self.group):
            watcher.cancel()
        self.stream.cancel()  # a no-op once it finished; otherwise the client left
        self.count()
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
        if u.reuse_note:  # --verbose: what the prefix cache gave, and why no more
            log.debug("%s reuse: %s", self.rid, u.reuse_note)
        spec = self.served.target.speculation
        if spec is not None:  # drafts kept, and why speculation rested when it did
            log.info("%s speculative %s", self.rid, speculation_line(u, spec))


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


class Service:
    """The routes' access to the state: keys and model names checked, requests prepared and
    submitted."""

    def __init__(self, state: State):
        self.state = state

    def check_key(self, request: Request) -> None:
        """--api-key: `Authorization: Bearer KEY` (OpenAI, Ollama) or `x-api-key: KEY`
        (Anthropic's clients)."""
        key = self.state.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key")
        if given is None or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(
                401,
                "a valid API key is needed: Authorization: Bearer KEY, or x-api-key: KEY",
                code="invalid_api_key",
            )

    def keep_alive(self, value: Any) -> float | None | str:
        """A request's keep_alive (Ollama's: a duration or seconds) -> seconds, None forever,
        "" unchanged (not sent); a 400 naming it when it is not one."""
        if value is None:
            return ""
        try:
            return keep_alive_seconds(value)
        except MlxlisError as e:
            raise APIError(400, f"keep_alive: {e.message}", param="keep_alive") from None

    async def model(
        self, name: str | None, keep_alive: Any = None, task: str | None = "generate"
    ) -> Served:
        """The model a request names (None: the server's default), loaded if it is not; a 404
        for a name the server does not serve, a 400 for a model too large for its memory
        even alone, a 503 while busy models hold the memory it needs, a 400 for a model of
        another `task` than the route's ("generate", "embed", "rerank"; None: any).
        `keep_alive` (Ollama's: a duration or seconds; None: unchanged) is its keep-alive
        from this request on."""
        seconds = self.keep_alive(keep_alive)
        try:
            served = await self.state.pool.use(name, seconds)
        except PoolError as e:
            raise pool_error(e) from None
        except MlxlisError as e:  # the listed model's files fail to load: not the request's
            raise APIError(
                500, f"the model {name!r} could not be loaded: {e}", type="server_error"
            ) from None
        have = served.model.task
        if task is not None and have != task:
            kind, route = TASKS.get(have, (f"a {have} model", "?"))
            raise APIError(400, f"{served.name!r} is {kind}: send it to {route}", param="model")
        note_model(served.name)  # its label in /metrics' request counts
        return served

    async def unload(self, name: str | None) -> None:
        """Unload the named model now, or, while requests are in flight on it, as soon as they
        end (its keep-alive 0: Ollama's `keep_alive: 0`)."""
        pool = self.state.pool
        try:
            listing = pool.listing(name)
        except PoolError as e:
            raise pool_error(e) from None
        name = listing.base or listing.name  # an adapter's: the model it runs on
        served = pool.loaded.get(name)
        if served is not None:
            served.keep_alive = 0.0
            del served
            await pool.unload(name)

    async def prepare(
        self,
        served: Served,
        fn: Callable[..., Prepared],
        *args: Any,
        names: dict[str, str] | None = None,
    ) -> Prepared:
        """`fn(target, *args)` on the preparing thread; a refusal names the field as the
        adapter's API does (`names`: the chat request's name -> the API's)."""
        loop = asyncio.get_running_loop()
        try:
            if self.state.allow_image_urls:  # on threads of their own, not the preparing one
                args = tuple([await fetch_images(a) for a in args])
            prep = await loop.run_in_executor(self.state.worker, partial(fn, served.target, *args))
        except APIError as e:
            moved = args[0]._renames if args and isinstance(args[0], ChatCompletionRequest) else {}
            raise renamed(e, {**moved, **(names or {})}) from None
        if prep.asked is not None:  # a ceiling, not a wish (--strict-context refuses instead)
            max_tokens = (names or {}).get("max_tokens", "max_tokens")
            log.info(
                "%s %d cut to %d: the context (%d tokens) holds a prompt of %d",
                max_tokens,
                prep.asked,
                prep.gen.params.max_tokens,
                served.target.max_context,
                len(prep.gen.prompt),
            )
        return prep

    def chat_reply(self, served: Served, prep: Prepared, logprobs: bool = False) -> ChatReply:
        """The reply to a prepared chat request, built from its events."""
        assert prep.prompt is not None
        return ChatReply(
            served.model.tokenizer,
            served.token_text,
            prep.prompt,
            logprobs=logprobs,
            tools=prep.tools,
            tool_format=prep.tool_format,
            forced=prep.forced,
            template=served.model.template,
        )

    def submit(self, served: Served, prep: Prepared, rid: str, request: Request) -> Run:
        return self.submit_samples(served, [prep.gen], rid, request)[0]

    def submit_samples(
        self, served: Served, gens: list[GenRequest], rid: str, request: Request
    ) -> list[Run]:
        """Samples of one prompt (OpenAI's n; Engine.submit_samples), a Run each: the first's
        watcher ends them all when the client leaves."""
        state = self.state
        assert isinstance(served.engine, Engine)  # a chat route's model (Service.model's task)
        try:
            streams = served.engine.submit_samples(gens, loop=asyncio.get_running_loop())
        except QueueFullError as e:
            raise APIError(
                429,
                f"too many requests waiting, retry later ({e})",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            ) from None
        except MemoryFullError as e:
            raise APIError(
                503,
                f"not enough memory now, retry later: {e}",
                type="server_error",
                code="memory_full",
                retry_after=RETRY_AFTER_S,
            ) from None
        except TooLongForMemoryError as e:
            raise APIError(
                400,
                f"this request does not fit the server's memory: {e}",
                param="max_tokens",
                code="context_length_exceeded",
            ) from None
        except MlxlisError as e:
            if state.stopping:
                raise APIError(
                    503, str(e), type="server_error", code="server_shutting_down"
                ) from None
            raise APIError(400, str(e), param=getattr(e, "field", None)) from None
        n = len(gens[0].prompt)
        log.debug("%s %s prompt=%d n=%d %s", rid, request.url.path, n, len(gens), gens[0].params)
        runs = [
            Run(state, served, rid, stream, request, n, watch=i == 0)
            for i, stream in enumerate(streams)
        ]
        for run in runs:
            run.group = runs
        return runs


def pool_error(e: PoolError) -> APIError:
    return APIError(
        e.status,
        e.message,
        param="model",
        code=e.code,
        type="server_error" if e.status >= 500 else "invalid_request_error",
        retry_after=RETRY_AFTER_S if e.status == 503 else None,
    )


async def fetch_images(body: Any) -> Any:
    """A chat request's http(s) image URLs fetched (serve/images.py), as data: URLs."""
    if not isinstance(body, ChatCompletionRequest):
        return body
    loop = asyncio.get_running_loop()
    jobs = []
    for i, m in enumerate(body.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            url = part.image_url.url if part.image_url is not None else ""
            if url.startswith(SCHEMES):
                where = f"messages[{i}].content[{j}].image_url.url"
                jobs.append((part.image_url, loop.run_in_executor(FETCHERS, fetch, url, where)))
    for target, job in jobs:
        target.url = await job
    return body


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """A refusal of the chat request with another API's names for its parameters (the first
    of `names` the parameter starts with)."""
    for ours, theirs in names.items():
        if e.param is not None and e.param.startswith(ours) and e.param[len(ours) :][:1] in ".[":
            e.message = e.message.replace(ours, theirs, 1)
            e.param = theirs + e.param[len(ours) :]
            break
    return e


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_shape(path: str, e: APIError) -> dict[str, Any]:
    """`e` as the API at `path` writes errors: Anthropic's `{"type": "error", "error": {type,
    message}}`, Ollama's `{"error": message}`, else OpenAI's."""
    if path.startswith("/v1/messages"):
        kind = ANTHROPIC_TYPES.get(e.status, "api_error" if e.status >= 500 else e.type)
        return {"type": "error", "error": {"type": kind, "message": e.message}}
    if path.startswith("/api/"):
        return {"error": e.message}
    return e.body()
