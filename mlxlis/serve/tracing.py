"""A request's id and what it was answered with, at the one ASGI seam every request crosses.

Every response carries `x-request-id`: the client's own when it sent one that is safe to echo
and log (1 to MAX_ID_CHARS visible ASCII characters), else one made here (a client's unsafe id
is replaced, never echoed). The id lives in a context variable for as long as the request runs
(its route, its stream, the task that watches for the client leaving), so every log line
written for the request carries it (`RequestIdFilter`). When the answer starts (before the
client can read it), its status, the API its path belongs to and the model it ran on
(`note_model`) are told to `on_answer` (serve/metrics.py counts them there).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

HEADER = "x-request-id"
MAX_ID_CHARS = 128  # longer than any tracing id in use (a UUID: 36, a W3C traceparent: 55)


@dataclass
class Traced:
    """What is known of the request now running: its id, and the model it ran on once the
    route has it (a mutable holder: set deep in a route, read where the answer starts)."""

    id: str
    model: str = ""


_current: ContextVar[Traced | None] = ContextVar("mlxlis_request", default=None)


def current() -> Traced | None:
    return _current.get()


def note_model(name: str) -> None:
    """The model the running request is served by (its label in the request counter)."""
    traced = _current.get()
    if traced is not None:
        traced.model = name


def request_id(sent: bytes | None) -> str:
    """The client's id when it is 1 to MAX_ID_CHARS visible ASCII characters (no spaces or
    control characters, which would forge or split a log line), else a new one."""
    if sent is not None and 0 < len(sent) <= MAX_ID_CHARS and all(0x21 <= b <= 0x7E for b in sent):
        return sent.decode("ascii")
    return uuid.uuid4().hex


def api_of(path: str) -> str:
    """Which of the server's APIs a path belongs to (a bounded label, whatever the path)."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/responses"):
        return "responses"
    if path.startswith("/api/") or path == "/api":
        return "ollama"
    if path.startswith("/v1/"):
        return "openai"
    return "server"  # /health, /metrics, /lora-adapters, Ollama's / and unknown paths


Answer = Callable[[str, str, int | None], None]  # (api, model, status; None: no answer sent)


class RequestIds:
    """ASGI middleware: the request's id set for its run and sent back on its response; its
    answer told to `on_answer`."""

    def __init__(self, app: Any, on_answer: Answer):
        self.app, self.on_answer = app, on_answer

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(HEADER.encode())
        traced = Traced(request_id(sent))
        # set, never reset: the value lives in this request's own task (uvicorn runs each
        # request in one), where the 500 handler outside this middleware still reads it
        _current.set(traced)
        told = False

        def tell(status: int | None) -> None:
            nonlocal told
            if not told:
                told = True
                self.on_answer(api_of(scope["path"]), traced.model, status)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != HEADER.encode()]
                headers.append((HEADER.encode(), traced.id.encode()))
                message = {**message, "headers": headers}
                tell(message["status"])  # before the client can read a byte of it
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            tell(500)  # the server's error handler answers it (app._bug)
            raise
        finally:
            tell(None)  # nothing was sent: the client left first


class RequestIdFilter(logging.Filter):
    """Puts the running request's id in front of a log record's message (`request_tag`:
    "[ID] ", or "" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        traced = _current.get()
        record.request_tag = f"[{traced.id}] " if traced is not None else ""
        return True
