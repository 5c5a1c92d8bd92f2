"""A Messages API reply as Anthropic writes it: content blocks (thinking, text, tool_use),
stop reasons, usage with the cached prompt tokens apart, and the stream's events
(`message_stream`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from mlxlis.generation.events import Usage
from mlxlis.serve.reply import ChatReply, Delta
from mlxlis.serve.service import Run, end_error


def usage(u: Any, output: bool = True) -> dict[str, Any]:
    """Anthropic counts the cached prompt tokens apart from the others."""
    out = {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    }
    if output:
        out["output_tokens"] = u.completion_tokens
    return out


def stop_reason(finish: str, tool_calls: bool, stop_sequence: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_block(call: dict[str, Any]) -> dict[str, Any]:
    args = call["function"]["arguments"]
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        parsed = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": parsed}


def content(reply: ChatReply) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reply.reasoning:
        out.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        out.append({"type": "text", "text": reply.content})
    out += [tool_block(c) for c in reply.tool_calls]
    return out


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class Blocks:
    """The streamed content blocks: a delta of another kind closes the open block and opens
    one of its own; each tool call is a block of its own, its input sent argument by argument
    as the call streams."""

    def __init__(self) -> None:
        self.index, self.open = -1, None

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = kind
        return [*out, event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, d: Delta) -> list[str]:
        out: list[str] = []
        if d.reasoning:
            if self.open != "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
                out += self._start("thinking", block)
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        for piece in d.call_pieces:  # a call's first piece opens its block (tool_calls.py)
            fn = piece["function"]
            if "id" in piece:
                block = {"type": "tool_use", "id": piece["id"], "name": fn["name"], "input": {}}
                out += self._start("tool_use", block)
            if fn["arguments"]:
                delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                out.append(self._delta(delta))
        return out


async def message_stream(
    run: Run, reply: ChatReply, message: dict[str, Any], keepalive: float
) -> AsyncIterator[str]:
    """Anthropic's event sequence. `message_start` goes out when the engine admits the request
    (its usage then has the reused prompt tokens), or after `keepalive` seconds in the queue
    (its usage then counts the whole prompt as input; `message_delta` gives the true split);
    a `ping` follows, and another after each `keepalive` seconds of a long prompt's reading."""
    blocks, started = Blocks(), False

    def start(u: Usage) -> list[str]:
        msg = {**message, "usage": {**usage(u, False), "output_tokens": 0}}
        return [event("message_start", {"message": msg}), event("ping", {})]

    try:
        async for ev in run.paced(keepalive):
            if ev is None or isinstance(ev, Usage):
                if started and ev is None:
                    yield event("ping", {})
                elif not started:
                    started = True
                    for out in start(ev or Usage(prompt_tokens=run.prompt)):
                        yield out
                continue
            if ev.finish_reason == "error":  # before message_start or after: the stream ends
                e = end_error(run.state, ev)
                kind = "overloaded_error" if e.status == 503 else "api_error"
                yield event("error", {"error": {"type": kind, "message": e.message}})
                return
            if not started:
                started = True
                for out in start(ev.usage):
                    yield out
            for out in blocks.feed(reply.feed(ev)):
                yield out
            if ev.finish_reason is not None:
                for out in blocks.stop():
                    yield out
                reason = stop_reason(ev.finish_reason, bool(reply.tool_calls), ev.stop_sequence)
                delta = {"stop_reason": reason, "stop_sequence": ev.stop_sequence}
                yield event("message_delta", {"delta": delta, "usage": usage(ev.usage)})
                yield event("message_stop", {})
    finally:
        run.close()
