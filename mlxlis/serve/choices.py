"""The choices of an OpenAI chat or completion request: one per sample (`n`, 1 by default).

The samples of one request run as Runs of one prompt (Service.submit_samples: the prompt read
once, its caches forked; generation/samples.py), each with a reply of its own (its text, tool
calls, logprobs and finish_reason). Streamed, their events are sent as they come, each chunk
carrying its choice's index; whole, the response lists the choices in index order. The usage
counts the prompt once and every sample's completion tokens, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from mlxlis.generation.events import Event, Usage
from mlxlis.serve.openai_format import (
    APIError,
    Head,
    chat_choice,
    completion_choice,
    sse,
    usage_dict,
)
from mlxlis.serve.reply import ChatReply, CompletionReply, finish_reason
from mlxlis.serve.service import Run, end_error

MAX_N = 16  # samples per request, and never more than the server's batch (--max-batch)


def check_n(n: int | None, batch: int) -> int:
    """The request's n (None: 1), or a 400 naming `n` outside 1..min(MAX_N, batch)."""
    limit = min(MAX_N, batch)
    if n is None:
        return 1
    if not 1 <= n <= limit:
        raise APIError(
            400,
            f"n: must be in [1, {limit}] (at most {MAX_N}, and the server's batch of {batch}), "
            f"not {n}",
            param="n",
            code="invalid_value",
        )
    return n


def check_best_of(best_of: int | None, n: int, stream: bool, batch: int) -> int:
    """How many samples a completion runs: `best_of` (None: n), or a 400 naming it outside
    n..min(MAX_N, batch), or streamed with more samples than choices (the best are known only
    at the end)."""
    if best_of is None:
        return n
    limit = min(MAX_N, batch)
    if not n <= best_of <= limit:
        raise APIError(
            400,
            f"best_of: must be in [n = {n}, {limit}] (at most {MAX_N}, and the server's batch "
            f"of {batch}), not {best_of}",
            param="best_of",
            code="invalid_value",
        )
    if stream and best_of > n:
        raise APIError(
            400, "best_of: more samples than n cannot be streamed", param="best_of", code=None
        )
    return best_of


class Score:
    """A sample's log probability per token (OpenAI's best_of ranks by it): the mean of its
    tokens' logprobs."""

    def __init__(self) -> None:
        self.total, self.tokens = 0.0, 0

    def add(self, ev: Event) -> None:
        if ev.token is not None and ev.logprob is not None:
            self.total += ev.logprob
            self.tokens += 1

    @property
    def value(self) -> float:
        return self.total / self.tokens if self.tokens else float("-inf")


def best(scores: Sequence[Score], n: int) -> list[int]:
    """The indices of the `n` samples of highest log probability per token, best first (ties:
    the earlier sample)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i].value, i))[:n]


def combined(usages: Sequence[Usage]) -> Usage:
    """One usage for the samples of one prompt: the prompt (and what a cache held of it) once,
    as the first sample read it; the completion tokens of all."""
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
    )


async def merged(runs: Sequence[Run]) -> AsyncIterator[tuple[int, Event]]:
    """(index, event) of every run, as they come (a run's own in order)."""
    if len(runs) == 1:
        async for ev in runs[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, run: Run) -> None:
        try:
            async for ev in run.events():
                queue.put_nowait((i, ev))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 — raised where the events are read
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    left = len(runs)
    try:
        while left:
            i, got = await queue.get()
            if isinstance(got, BaseException):
                raise got
            if got is None:
                left -= 1
            else:
                yield i, got
    finally:
        for t in tasks:
            t.cancel()


async def collect_all(runs: Sequence[Run], feeds: Sequence[Callable[[Event], Any]]) -> list[Event]:
    """Every run's events through its feed; their last events (an error ends as an
    APIError, the other samples with it)."""
    finals: list[Event | None] = [None] * len(runs)
    try:
        async for i, ev in merged(runs):
            if ev.finish_reason == "error":
                raise end_error(runs[i].state, ev)
            feeds[i](ev)
            if ev.finish_reason is not None:
                finals[i] = ev
    finally:
        for run in runs:
            run.close()
    assert all(ev is not None and ev.usage is not None for ev in finals)
    return finals  # type: ignore[return-value]


async def chat_stream(
    runs: Sequence[Run], head: Head, replies: Sequence[ChatReply], include_usage: bool
) -> AsyncIterator[str]:
    usages: list[Usage | None] = [None] * len(runs)
    try:
        for i in range(len(runs)):
            role = {"role": "assistant", "content": ""}
            yield sse(head.chat_chunk(role, usage=include_usage, index=i))
        async for i, ev in merged(runs):
            if ev.finish_reason == "error":
                yield sse(end_error(runs[i].state, ev).body())
                break
            reply = replies[i]
            d = reply.feed(ev)
            if d:
                yield sse(
                    head.chat_chunk(
                        ChatReply.delta_dict(d),
                        usage=include_usage,
                        logprobs=d.logprobs if reply.want_logprobs else None,
                        index=i,
                    )
                )
            if ev.finish_reason is not None:
                finish = finish_reason(ev.finish_reason, bool(reply.tool_calls))
                yield sse(head.chat_chunk({}, finish=finish, usage=include_usage, index=i))
                usages[i] = ev.usage
        else:
            if include_usage and all(u is not None for u in usages):
                reasoning = sum(r.reasoning_tokens for r in replies)
                usage = usage_dict(combined(usages), reasoning)  # type: ignore[arg-type]
                yield sse(head.usage_chunk("chat.completion.chunk", usage))
        yield sse("[DONE]")
    finally:
        for run in runs:
            run.close()


async def completion_stream(
    runs: Sequence[Run], head: Head, replies: Sequence[CompletionReply], include_usage: bool
) -> AsyncIterator[str]:
    usages: list[Usage | None] = [None] * len(runs)
    try:
        async for i, ev in merged(runs):
            if ev.finish_reason == "error":
                yield sse(end_error(runs[i].state, ev).body())
                break
            text, lp = replies[i].feed(ev)
            if text or lp is not None:
                chunk = head.completion_chunk(text, logprobs=lp, usage=include_usage, index=i)
                yield sse(chunk)
            if ev.finish_reason is not None:
                end = head.completion_chunk(
                    "", finish=ev.finish_reason, usage=include_usage, index=i
                )
                yield sse(end)
                usages[i] = ev.usage
        else:
            if include_usage and all(u is not None for u in usages):
                usage = usage_dict(combined(usages))  # type: ignore[arg-type]
                yield sse(head.usage_chunk("text_completion", usage))
        yield sse("[DONE]")
    finally:
        for run in runs:
            run.close()


def chat_response(
    head: Head, replies: Sequence[ChatReply], finals: Sequence[Event]
) -> dict[str, Any]:
    """The whole response: a choice per sample, the usage combined."""
    choices = [
        chat_choice(
            i,
            r.message(),
            finish_reason(ev.finish_reason or "stop", bool(r.tool_calls)),
            r.logprobs if r.want_logprobs else None,
        )
        for i, (r, ev) in enumerate(zip(replies, finals, strict=True))
    ]
    reasoning = sum(r.reasoning_tokens for r in replies)
    usage = usage_dict(combined([ev.usage for ev in finals]), reasoning)  # type: ignore[misc]
    return head.response("chat.completion", choices, usage)


def completion_response(
    head: Head,
    replies: Sequence[CompletionReply],
    finals: Sequence[Event],
    chosen: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The whole response: a choice per sample (`chosen`: those samples only, in that order:
    best_of's), the usage combined over every sample run (OpenAI counts best_of's all)."""
    picked = list(range(len(replies))) if chosen is None else chosen
    choices = []
    for i, k in enumerate(picked):
        r, finish = replies[k], finals[k].finish_reason or "stop"
        choices.append(completion_choice(i, r.text, finish, r.logprobs))
    usage = usage_dict(combined([ev.usage for ev in finals]))  # type: ignore[misc]
    return head.response("text_completion", choices, usage)
