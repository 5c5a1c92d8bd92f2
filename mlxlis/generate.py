"""Generation: a generator of events that both the CLI and the TUI consume.

The prompt is prefilled in chunks into a preallocated KV cache; decoding is pipelined with
`mx.async_eval` so the graph for token n+1 is built while token n is being computed.

A model pipelined across ranks (mlxlis.distributed) runs this same loop on every rank: the
last rank samples, the token comes back to all of them (`PipelineNet.share`) with rank 0's
stop flag, so all ranks feed the same tokens and end at the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .cache import snapshot
from .device import peak_memory_bytes
from .sampling import SamplingParams, apply_repetition_penalty, make_sampler


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    time_to_first_token: float = 0.0
    peak_memory: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # tokens after the first, over the time after the first
        n = self.generated_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


@dataclass
class Event:
    token: int | None  # None on the final event
    text: str  # newly completed text (never half a UTF-8 character)
    stats: Stats
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" on the final event
    fed: list[int] = field(default_factory=list)  # final event: ids appended to the cache


def prefill(
    net,
    ids: Sequence[int],
    cache: list,
    step: int = 512,
    should_stop: Callable[[], bool] | None = None,
) -> mx.array | None:
    """Run `ids` through the model into `cache`; returns (1, vocab) float32 logits of the last,
    or None when `should_stop()` turned true between chunks. Pipelined, a rank that is not the
    last returns its final send instead of logits, and `should_stop` is not asked (the ranks
    must run the same chunks)."""
    arr = mx.array(list(ids), dtype=mx.int32)[None]
    n = arr.shape[1]
    start = 0
    pipe = _pipeline(net)
    while n - start > step:
        out = net(arr[:, start : start + step], cache=cache, last_only=True)
        if pipe is None:
            mx.eval([c.state for c in cache])
        else:  # a rank's send is its output: evaluated with the caches, so it passes it on
            with pipe.ranks.waiting():
                mx.eval(out if not pipe.is_last else [], [c.state for c in cache])
        start += step
        if pipe is None and should_stop is not None and should_stop():
            return None
    logits = net(arr[:, start:], cache=cache, last_only=True)[:, -1, :].astype(mx.float32)
    snapshot(cache)  # where a later prompt sharing this one can rewind recurrent states to
    return logits


def generate(
    model,
    ids: Sequence[int],
    params: SamplingParams | None = None,
    *,
    stop_ids: set[int] | None = None,
    cache: list | None = None,
    history: Sequence[int] = (),
    prefill_step: int = 512,
    should_stop: Callable[[], bool] | None = None,
    **sampling: object,
) -> Iterator[Event]:
    """Stream tokens after `ids`, sampled as `params` says with `sampling` keywords (max_tokens,
    temperature, top_p, ...: SamplingParams' fields) applied on top; a bad value raises
    SamplingError before anything runs. With `cache`, `ids` are the tokens not yet in it and
    `history` the ones that are (for the repetition penalty).

    Pipelined across ranks, rank 0's call is the one every rank runs (mlxlis.distributed.follow:
    the other ranks receive it, whether they called generate too or follow rank 0's app), and
    a lost rank ends it with RankLostError."""
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(
            f"generate(model, ids, params): params is a SamplingParams, not {params!r}; "
            "pass max_tokens=, temperature=, ... as keywords"
        )
    params = (params or SamplingParams()).replace(**sampling)
    if not ids:
        from .errors import MlxlisError

        raise MlxlisError("empty prompt: nothing to generate from", field="prompt")
    stops = model.stop_ids() if stop_ids is None else stop_ids
    pipe = _pipeline(model.net)
    if pipe is None:
        yield from _stream(model, ids, params, stops, cache, history, prefill_step, should_stop)
        return
    from .distributed.follow import Call, align, announce

    before = cache[0].offset if cache else 0
    call = announce(pipe.ranks, Call(list(ids), params, sorted(stops),
                                     list(history)[-params.repetition_context:], before))
    if pipe.rank != 0:  # rank 0's call: this rank's caches hold what rank 0's hold
        cache = align(model, cache, call.before)
    yield from pipelined(model, call, cache, prefill_step, should_stop)


def pipelined(model, call, cache: list | None, prefill_step: int = 512,
              should_stop: Callable[[], bool] | None = None) -> Iterator[Event]:  # fmt: skip
    """One announced generation (a mlxlis.distributed.follow.Call) on this rank. When rank 0's
    consumer leaves the stream before its end, the steps already sent go on with the stop flag
    set until every rank has stopped with it."""
    pipe = model.net
    abandoned = False

    def stop_asked() -> bool:
        return abandoned or (should_stop is not None and should_stop())

    events = _stream(model, call.ids, call.params, set(call.stops), cache, call.history,
                     prefill_step, stop_asked)  # fmt: skip
    with pipe.ranks.translate():  # MLX raises a lost peer's error from any later evaluation
        try:
            # not `yield from`: it would close `events`, which must go on to the stop below
            for ev in events:  # noqa: UP028
                yield ev
        except GeneratorExit:
            abandoned = True
            for _ in events:
                pass
            raise


def _stream(
    model,
    ids: Sequence[int],
    params: SamplingParams,
    stops: set[int],
    cache: list | None,
    history: Sequence[int],
    prefill_step: int,
    should_stop: Callable[[], bool] | None,
) -> Iterator[Event]:
    from .tokenizer import StreamDecoder

    sampler = make_sampler(params)
    max_tokens = params.max_tokens
    repetition_penalty, repetition_context = params.repetition_penalty, params.repetition_context
    net = model.net
    pipe = _pipeline(net)
    cache = cache if cache is not None else model.make_cache()
    recent = list(history)[-repetition_context:] + list(ids)
    decoder = StreamDecoder(model.tokenizer)
    stats = Stats(prompt_tokens=len(ids))
    fed = list(ids)

    def pick(logits: mx.array, stop: bool = False) -> mx.array:
        if pipe is not None and not pipe.is_last:  # the token comes from the last rank
            return pipe.share(None, after=logits, stop=stop)
        if repetition_penalty != 1.0:
            logits = apply_repetition_penalty(
                logits, recent[-repetition_context:], repetition_penalty
            )
        y = sampler(logits)
        return y if pipe is None else pipe.share(y, after=logits, stop=stop)

    def step(token: mx.array, stop: bool = False) -> mx.array:
        logits = net(token[:, None], cache=cache, last_only=True)[:, -1, :]
        return pick(logits.astype(mx.float32), stop)

    def value(y: mx.array) -> tuple[int, bool]:
        """The token, and (pipelined) whether rank 0 asked every rank to stop."""
        if pipe is None:
            return int(y.item()), False
        with pipe.ranks.waiting():
            token, stop = y.tolist()
        return token, bool(stop)

    t0 = time.perf_counter()
    before = cache[0].offset if cache else 0
    logits = prefill(net, ids, cache, prefill_step, should_stop)
    if logits is None:  # stopped during a long prompt: only whole chunks reached the cache
        stats.prompt_seconds = time.perf_counter() - t0
        done = cache[0].offset - before if cache else 0
        yield Event(None, "", stats, finish_reason="cancelled", fed=list(ids[:done]))
        return
    y = pick(logits)
    mx.async_eval(y)
    reason = "length"
    t_first = None
    n = 0
    # Pipelined, rank 0's stop reaches the other ranks in the flag of the next step it starts;
    # the step in flight when it was asked goes on, its token neither shown nor counted as
    # generated (it is fed: `fed` is what the caches hold), and every rank ends together.
    cancelling = False
    while n < max_tokens:
        token, stopped = value(y)
        if stopped:  # pipelined: rank 0 asked every rank to stop
            reason = "cancelled"
            break
        if t_first is None:
            t_first = time.perf_counter()
            stats.time_to_first_token = stats.prompt_seconds = t_first - t0
        n += 1
        if cancelling:  # as the other ranks would: end here, or one more step to tell them
            if token in stops or n >= max_tokens:
                break
            fed.append(token)
            y = step(y[:1].reshape(1), stop=True)
            mx.async_eval(y)
            continue
        stats.generated_tokens = n
        if token in stops:
            reason = "stop"
            break
        recent.append(token)
        if n < max_tokens:
            fed.append(token)
            nxt = step(y[:1].reshape(1))
            mx.async_eval(nxt)
        stats.decode_seconds = time.perf_counter() - t_first
        yield Event(token, decoder.add(token), stats)
        if should_stop is not None and should_stop():
            reason = "cancelled"
            if pipe is None or n >= max_tokens:
                break
            cancelling = True
        if n < max_tokens:
            y = nxt
    stats.decode_seconds = time.perf_counter() - (t_first or t0)
    stats.peak_memory = peak_memory_bytes()
    yield Event(None, decoder.flush(), stats, finish_reason=reason, fed=fed)


def _pipeline(net):
    """The PipelineNet when the model runs pipelined across ranks, else None."""
    return net if getattr(net, "is_pipeline", False) else None
