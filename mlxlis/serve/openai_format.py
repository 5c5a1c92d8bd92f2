"""The OpenAI API's shapes: errors, ids, usage, logprobs, chunks and whole responses.

Pure functions of plain values (no HTTP, no engine): app.py feeds them what the engine
produced. Field order and presence follow OpenAI's own responses, so clients that check for a
key (`usage`, `logprobs`, `system_fingerprint`) find it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxlis.generation.events import Usage

MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An answer other than 200, with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type
        self.retry_after = retry_after  # seconds, sent as Retry-After
        self.logged = False  # the server's log has a line for this request already

    def body(self) -> dict[str, Any]:
        return error_body(self.message, param=self.param, code=self.code, type=self.type)


def error_body(
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type: str = "invalid_request_error",
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: {...}` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage_dict(u: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if reasoning_tokens:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


class TokenText:
    """id -> the token's text as a client sees it, and its exact bytes (cached: top-k lists
    repeat ids). A token holding part of a UTF-8 character reads as U+FFFD; its bytes are
    the real ones, so a client can join them."""

    def __init__(self, decode: Callable[[list[int]], str], to_bytes: Callable[[int], bytes]):
        self._decode, self._to_bytes = decode, to_bytes
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def entry(self, token: int) -> tuple[str, list[int]]:
        got = self._cache.get(token)
        if got is None:
            if len(self._cache) > 65536:
                self._cache.clear()
            got = self._cache[token] = (self._decode([token]), list(self._to_bytes(token)))
        return got

    def __call__(self, token: int) -> str:
        return self.entry(token)[0]


def chat_logprob(
    text: TokenText, token: int, logprob: float, top: list[tuple[int, float]] | None
) -> dict[str, Any]:
    """One entry of choices[].logprobs.content."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        s, b = text.entry(t)
        return {"token": s, "logprob": lp, "bytes": b}

    return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top or []]}


@dataclass
class CompletionLogprobs:
    """choices[].logprobs of /v1/completions: parallel lists, top ones as {token: logprob}."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(
        self,
        text: TokenText,
        token: int,
        logprob: float,
        top: list[tuple[int, float]] | None,
        offset: int,
    ) -> None:
        self.tokens.append(text(token))
        self.token_logprobs.append(logprob)
        self.top_logprobs.append({text(t): lp for t, lp in top or []})
        self.text_offset.append(offset)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


@dataclass
class Head:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    fingerprint: str

    def chat_chunk(
        self,
        delta: dict[str, Any],
        *,
        logprobs: list | None = None,
        finish: str | None = None,
        usage: bool = False,
        index: int = 0,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": finish,
        }
        return self._chunk("chat.completion.chunk", [choice], usage)

    def completion_chunk(
        self,
        text: str,
        *,
        logprobs: CompletionLogprobs | None = None,
        finish: str | None = None,
        usage: bool = False,
        index: int = 0,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs.as_dict() if logprobs is not None else None,
            "finish_reason": finish,
        }
        return self._chunk("text_completion", [choice], usage)

    def usage_chunk(self, obj: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        out = self._chunk(obj, [], False)
        out["usage"] = usage
        return out

    def _chunk(self, obj: str, choices: list, usage: bool) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage:  # include_usage: every chunk has the key, null until the last
            out["usage"] = None
        return out

    def chat_response(
        self, message: dict[str, Any], finish: str, logprobs: list | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        return self.response("chat.completion", [chat_choice(0, message, finish, logprobs)], usage)

    def completion_response(
        self, text: str, finish: str, logprobs: CompletionLogprobs | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        choice = completion_choice(0, text, finish, logprobs)
        return self.response("text_completion", [choice], usage)

    def response(self, obj: str, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict:
        """A whole response of `choices` (index 0..n-1: OpenAI's n)."""
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": usage,
        }


def chat_choice(
    index: int, message: dict[str, Any], finish: str, logprobs: list | None
) -> dict[str, Any]:
    """One of a chat response's choices."""
    return {
        "index": index,
        "message": message,
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": finish,
    }


def completion_choice(
    index: int, text: str, finish: str, logprobs: CompletionLogprobs | None
) -> dict[str, Any]:
    """One of a completion response's choices."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs.as_dict() if logprobs is not None else None,
        "finish_reason": finish,
    }


def bad(message: str, param: str | None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
