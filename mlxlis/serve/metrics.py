"""`GET /metrics`: what an operator watches, in Prometheus' text format (prometheus_client).

Each server has a registry of its own (never the process-wide default one), so that two apps
in one process count apart. Everything is counted where it already flows, once for every API:
requests where their answer starts (serve/tracing.py's middleware), tokens and latencies where
a generation request ends (service.Run.close, from the engine's Usage: the numbers the client
got back in its usage), and the state of each loaded model (its running sequences, its queue,
its prefix cache, its memory against the budget) read from the pool at each scrape.

Series, `model` being the served name (an adapter's BASE:NAME included):
  mlxlis_requests_total{api,model,status}   answers, by API (openai, anthropic, responses,
                                            ollama, server), model ("" before one was named)
                                            and HTTP status
  mlxlis_prompt_tokens_total{model}         prompt tokens of ended requests, cached ones in
  mlxlis_prompt_cached_tokens_total{model}  of which the prefix cache held
  mlxlis_generated_tokens_total{model}      tokens generated (a stop token included)
  mlxlis_prefill_tokens_total{model}        prompt tokens the model read (not those a cache
                                            held, nor those the samples of one prompt share)
  mlxlis_prefix_cache_hit_ratio{model}      cached / prompt tokens so far
  mlxlis_time_to_first_token_seconds{model}                 histogram, one per request
  mlxlis_request_time_per_output_token_seconds{model}       histogram: each request's mean
                                            seconds per token after its first
  mlxlis_sequences_running{model}, mlxlis_requests_waiting{model}
  mlxlis_prefix_cache_bytes{model}, mlxlis_model_memory_bytes{model} (its weights, its prefix
                                            cache's bound and its requests' caches, as the
                                            budget counts them), mlxlis_memory_held_bytes,
                                            mlxlis_memory_budget_bytes, mlxlis_memory_active_bytes
                                            (MLX's arrays now), mlxlis_models_loaded
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mlxlis.generation.events import Usage
from mlxlis.serve.pool import Pool

import mlx.core as mx
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

# seconds: a cached prompt's first token on a GPU (10 ms) to a long prompt read on a CPU
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# seconds per token: a small model on a GPU (1 ms) to a large one on a CPU (a few s)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)


@dataclass
class Tokens:
    """A model's token counts over the requests that ended."""

    prompt: int = 0
    cached: int = 0
    generated: int = 0


class Metrics:
    """The server's series (one registry per server)."""

    def __init__(self, pool: Pool):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlxlis_requests",
            "HTTP requests answered, by API, model (empty until one is named) and status",
            ["api", "model", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "mlxlis_time_to_first_token_seconds",
            "Seconds from a request's submission to its first generated token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "mlxlis_request_time_per_output_token_seconds",
            "Each request's mean seconds per generated token after its first",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.tokens: dict[str, Tokens] = {}
        self.registry.register(Live(pool, self.tokens))

    def answered(self, api: str, model: str, status: int | None) -> None:
        """A request's answer started (tracing.RequestIds): `status` None when none was sent
        (the client left first)."""
        self.requests.labels(api, model, "none" if status is None else str(status)).inc()

    def ended(self, model: str, usage: Usage | None, prompt: int, generated: int) -> None:
        """A generation request ended (service.Run.close): its Usage, or None when the client
        left before its last event (then its `prompt` and the `generated` tokens it got)."""
        t = self.tokens.setdefault(model, Tokens())
        if usage is None:
            t.prompt += prompt
            t.generated += generated
            return
        t.prompt += usage.prompt_tokens
        t.cached += usage.cached_tokens
        t.generated += usage.completion_tokens
        if usage.completion_tokens >= 1:
            self.ttft.labels(model).observe(usage.time_to_first_token)
        if usage.completion_tokens >= 2:  # decode_seconds runs from the first token on
            self.tpot.labels(model).observe(usage.decode_seconds / (usage.completion_tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Live(Collector):
    """The series read at each scrape: the token counts and each loaded model's state."""

    def __init__(self, pool: Pool, tokens: dict[str, Tokens]):
        self.pool, self.tokens = pool, tokens

    def collect(self) -> Iterator[Metric]:
        prompt = CounterMetricFamily(
            "mlxlis_prompt_tokens", "Prompt tokens of ended requests", labels=["model"]
        )
        cached = CounterMetricFamily(
            "mlxlis_prompt_cached_tokens",
            "Prompt tokens of ended requests the prefix cache held (not prefilled)",
            labels=["model"],
        )
        generated = CounterMetricFamily(
            "mlxlis_generated_tokens", "Tokens generated, a stop token included", labels=["model"]
        )
        ratio = GaugeMetricFamily(
            "mlxlis_prefix_cache_hit_ratio",
            "Share of ended requests' prompt tokens the prefix cache held",
            labels=["model"],
        )
        for model, t in self.tokens.items():
            prompt.add_metric([model], t.prompt)
            cached.add_metric([model], t.cached)
            generated.add_metric([model], t.generated)
            if t.prompt:
                ratio.add_metric([model], t.cached / t.prompt)
        yield from (prompt, cached, generated, ratio)
        yield from self.loaded()

    def loaded(self) -> Iterator[Metric]:
        pool = self.pool
        running = GaugeMetricFamily(
            "mlxlis_sequences_running", "Sequences generating now", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            "mlxlis_requests_waiting", "Requests queued for a place", labels=["model"]
        )
        prefix = GaugeMetricFamily(
            "mlxlis_prefix_cache_bytes", "Bytes the prefix cache holds", labels=["model"]
        )
        memory = GaugeMetricFamily(
            "mlxlis_model_memory_bytes",
            "Bytes a loaded model holds against the budget: its weights, its prefix cache's "
            "bound, its requests' caches",
            labels=["model"],
        )
        prefilled = CounterMetricFamily(
            "mlxlis_prefill_tokens",
            "Prompt tokens the model read into caches (a cached prefix and a fork are not)",
            labels=["model"],
        )
        for name, served in pool.loaded.items():
            prefilled.add_metric([name], served.engine.prefilled)
            r, w = served.engine.counts
            running.add_metric([name], r)
            waiting.add_metric([name], w)
            cache = served.engine.prefix
            prefix.add_metric([name], cache.bytes if cache is not None else 0)
            memory.add_metric([name], served.reserve + served.engine.reserved())
        yield from (running, waiting, prefix, memory, prefilled)
        yield GaugeMetricFamily(
            "mlxlis_memory_held_bytes",
            "Bytes the loaded models hold against the budget",
            pool.held_bytes(),
        )
        yield GaugeMetricFamily(
            "mlxlis_memory_budget_bytes", "The memory budget of the models", pool.budget
        )
        yield GaugeMetricFamily(
            "mlxlis_memory_active_bytes", "Bytes of MLX's arrays now", mx.get_active_memory()
        )
        yield GaugeMetricFamily("mlxlis_models_loaded", "Models loaded", len(pool.loaded))


def router(metrics: Metrics, auth: list) -> APIRouter:
    r = APIRouter()

    @r.get("/metrics", dependencies=auth)
    async def scrape() -> Response:
        """Prometheus' text format (scraped on the event loop: the pool is read unlocked)."""
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return r
