"""`mlxlis serve`: the engine and the HTTP API on uvicorn, started and stopped cleanly.

Ctrl+C / SIGTERM: the engine is shut down first (every unfinished request ends with an error
event, so the open streams close), then uvicorn closes the connections and the process exits
with status 0. One log line per request goes to stderr (app.Run.close).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from mlxlis import __version__
from mlxlis.cache.disk import DiskCache
from mlxlis.cache.store import BITS, GROUP_SIZES, KVFormat
from mlxlis.errors import MlxlisError
from mlxlis.generation.engine import Engine, MemoryPlan
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation
from mlxlis.generation.warmup import warm_up
from mlxlis.loading.adapters import Adapter
from mlxlis.models.footprint import Footprint, footprint, weight_bytes
from mlxlis.runtime import mlx_thread
from mlxlis.runtime.memory import memory_budget, wire
from mlxlis.serve.app import State, create_app, log
from mlxlis.serve.http_protocol import HEAD_WAIT_S, with_deadline
from mlxlis.serve.listings import Listing, describe
from mlxlis.serve.pool import DEFAULT_KEEP_ALIVE, Idle, Pool, Served, attach
from mlxlis.serve.prepare import Target
from mlxlis.serve.service import MAX_VISION_BODY_BYTES
from mlxlis.serve.tracing import RequestIdFilter

import uvicorn

SHUTDOWN_WAIT_S = 10.0  # the most an in-flight step may delay the exit
# kept free of requests' caches for a step's transient arrays (a prompt chunk's activations and
# scores), or 2 % of the budget when that is more
MARGIN_BYTES = 256 << 20


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    max_batch: int = 8
    max_queue: int = 64
    max_context: int | str | None = None  # "auto": the longest --max-batch requests fit
    api_key: str | None = None
    verbose: bool = False
    defaults: SamplingParams = SamplingParams()
    prefix_cache_mb: int = 1024  # the prefix cache's bound (0: off)
    responses_store_mb: int = 64  # /v1/responses kept for previous_response_id (0: none)
    keepalive: float = 10.0  # seconds between an Anthropic stream's pings while it is quiet
    prefix_cache_dir: str | None = None  # finished requests' caches also kept on disk
    prefix_cache_disk_gb: float = 10.0
    allow_image_urls: bool = False  # fetch requests' http(s) image URLs (serve/images.py)
    strict_context: bool = False  # prompt + max_tokens over the context: 400, not cut
    head_timeout: float = HEAD_WAIT_S  # seconds a connection has to send a request's head
    # a model loaded on demand stays loaded this long once idle (None: forever); one loaded at
    # start (-m) stays loaded unless --keep-alive says otherwise (`start_keep_alive`)
    keep_alive: float | None = DEFAULT_KEEP_ALIVE
    start_keep_alive: float | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS: the browser origins allowed ("*": any)


@dataclass
class Started:
    """A model loaded before the server starts (-m), with its flags' speculation."""

    listing: Listing
    model: Any
    speculation: Speculation | None = None


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: State):
        super().__init__(config)
        self.state = state

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.pool.start()  # unloads idle models past their keep-alive
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.stopping = True
        await self.state.pool.close()
        engines = self.state.pool.engines()
        await asyncio.get_running_loop().run_in_executor(None, stop_engines, engines)
        await super().shutdown(sockets)


def stop_engines(engines: list[Engine | Idle]) -> None:
    for engine in engines:
        try:
            engine.shutdown(timeout=SHUTDOWN_WAIT_S)
        except TimeoutError:
            log.warning("the engine did not stop within %.0f s", SHUTDOWN_WAIT_S)


def fingerprint(model: Any) -> str:
    """system_fingerprint: changes when the weights, their form or mlxlis change."""
    d = model.describe()
    key = "|".join([__version__, str(model.path), d["dtype"], d["quant"], d["template"]])
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise MlxlisError(
            f"cannot listen on {host}:{port}: {e.strerror or e}", field="--port"
        ) from None


class Clipped(logging.Formatter):
    """Log records bounded: a line past LINE characters and a record past LINES lines are cut
    (saying how much was), so a request's own text (a 7 MB model name echoed in its 404) can
    not fill the log; a traceback's lines are far shorter."""

    LINE, LINES = 1000, 200

    def format(self, record: logging.LogRecord) -> str:
        lines = super().format(record).split("\n")
        out = [x if len(x) <= self.LINE else f"{x[: self.LINE]}… ({len(x)} chars)" for x in lines]
        if len(out) > self.LINES:
            out = [*out[: self.LINES], f"… ({len(out) - self.LINES} more lines)"]
        return "\n".join(out)


def setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Clipped("mlxlis serve: %(request_tag)s%(message)s"))
    handler.addFilter(RequestIdFilter())  # a request's lines start with its x-request-id
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def memory_plan(
    model: Any, opts: ServeOptions, prints: dict[KVFormat | None, Footprint], budget: int
) -> MemoryPlan:
    """What the requests' caches may fill: the budget (runtime/memory.py) less the weights,
    the prefix cache's bound and a margin for a step's transient arrays (with several models
    loaded, the pool plans each one's room beside the others: pool.Pool._plan_rooms)."""
    fp = prints[model.kv_format]
    margin = max(MARGIN_BYTES, budget // 50)
    room = budget - fp.weights - (opts.prefix_cache_mb << 20) - margin
    wire(budget - margin)  # Metal: the weights and caches stay resident (as mlx-lm does)
    return MemoryPlan(fp, room, model.context_length, model.kv_format, prints)


def footprints(model: Any) -> dict[KVFormat | None, Footprint]:
    """The footprint of every KV format a request may ask for (kv_bits, kv_group_size): dense
    and each quantized one whose groups divide the head dimensions."""
    out = {}
    for kv in [None, *(KVFormat(b, g) for b in BITS for g in GROUP_SIZES)]:
        try:
            model.check_kv(kv)
        except MlxlisError:
            continue
        out[kv] = footprint(model, kv)
    return out


def disk_cache(model: Any, opts: ServeOptions, folder: str | None) -> DiskCache | None:
    """--prefix-cache-dir: finished requests' caches kept on disk, read back across restarts
    (`folder`: the model's own, in a server of several models)."""
    if folder is None:
        return None
    if model.part is not None:
        raise MlxlisError(
            "a pipelined model's caches live in every rank: not kept on disk",
            field="--prefix-cache-dir",
        )
    try:
        return DiskCache(
            folder,
            int(opts.prefix_cache_disk_gb * (1 << 30)),
            model.cache_key(),
            model.make_cache,
            log.warning,
        )
    except OSError as e:
        raise MlxlisError(f"cannot use it: {e.strerror or e}", field="--prefix-cache-dir") from None


def cache_folder(opts: ServeOptions, name: str, several: bool) -> str | None:
    """The model's --prefix-cache-dir folder: the folder itself for a server of one model, a
    folder per model inside it for several (a model deletes the files of another as foreign)."""
    if opts.prefix_cache_dir is None:
        return None
    if not several:
        return opts.prefix_cache_dir
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80]
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return str(Path(opts.prefix_cache_dir) / f"{safe}-{digest}")


def context_for(model: Any, opts: ServeOptions, plan: MemoryPlan | None) -> int:
    """The context a request may fill: the model's, --max-context, or what auto finds."""
    context = model.context_length
    if opts.max_context == "auto":  # the longest that --max-batch requests can all reach
        if plan is None:
            raise MlxlisError("auto needs the model on one machine", field="--max-context")
        context = plan.footprint.max_context(plan.room // opts.max_batch, context)
        if context < 1:
            raise MlxlisError(
                f"no context fits: {plan.room / 2**20:.0f} MiB are left for caches beside the "
                "weights (MLXLIS_MAX_MEMORY, --kv-bits, --max-batch, --prefix-cache-mb)",
                field="--max-context",
            )
        log.info("--max-context auto: %d tokens", context)
    elif opts.max_context is not None:
        if opts.max_context > context:
            raise MlxlisError(
                f"{opts.max_context} is over the model's context length ({context})",
                field="--max-context",
            )
        context = opts.max_context
    return context


def build_served(
    model: Any,
    listing: Listing,
    opts: ServeOptions,
    budget: int,
    several: bool,
    speculation: Speculation | None = None,
    keep_alive: float | None = None,
) -> Served:
    """On the MLX thread: a loaded model's target, engine and memory plan, served by the pool
    (a model that does not generate: its weights and no engine, serve/embeddings.py)."""
    if model.task != "generate":
        target = Target(model, opts.defaults, model.context_length, frozenset())
        reserve = weight_bytes(model)
        return Served(listing, target, Idle(model), fingerprint(model), reserve, keep_alive)
    prints = footprints(model) if model.part is None else None
    plan = memory_plan(model, opts, prints, budget) if prints is not None else None
    context = context_for(model, opts, plan)
    stops = frozenset(model.stop_ids())
    target = Target(model, opts.defaults, context, stops, speculation, opts.strict_context)
    # the kernels compile as the next job on this thread: the first request waits for what is
    # left of it instead of compiling them itself (generation/warmup)
    mlx_thread.shared().submit(lambda: warm_up(model, opts.defaults))
    engine = Engine(
        model,
        max_active=opts.max_batch,
        max_queued=opts.max_queue,
        prefix_cache_bytes=opts.prefix_cache_mb << 20,
        memory=plan and replace(plan, context=context),
        disk=disk_cache(model, opts, cache_folder(opts, listing.name, several)),
    )
    engine.on_error = lambda text: log.error("error: %s", text.rstrip())
    if listing.size is None and model.path is not None:  # fetched by this load
        listing = describe(listing.name, listing.ref, Path(model.path))
    weights = prints[model.kv_format].weights if prints is not None else 0
    if speculation is not None and speculation.draft_model is not None:  # held beside it
        weights += footprint(speculation.draft_model, None).weights
    reserve = weights + (opts.prefix_cache_mb << 20)
    return Served(listing, target, engine, fingerprint(model), reserve, keep_alive)


def serve(
    names: dict[str, Listing],
    opts: ServeOptions,
    load: Callable[[Listing], Any],
    started: list[Started],
    default: str | None,
    adapters: dict[str, dict[str, Adapter]] | None = None,
) -> int:
    """Serve the listed models (`started` loaded already, the others by `load` on demand)
    until Ctrl+C / SIGTERM; returns the exit status. `adapters`: a model's name -> its LoRA
    adapters by name, loaded with it (those of a started model that do not fit it: an
    MlxlisError now)."""
    adapters = adapters or {}
    setup_logging(opts.verbose)
    budget = memory_budget()
    several = len({x.name for x in names.values()}) > 1

    def build(listing: Listing, model: Any) -> Served:  # on the MLX thread
        return build_served(model, listing, opts, budget, several, None, opts.keep_alive)

    margin = max(MARGIN_BYTES, budget // 50)
    pool = Pool(names, load, build, budget, margin, opts.prefix_cache_mb << 20, default, adapters)
    shown = [s.listing.name for s in started] or [f"{len(pool.listings())} models"]
    for s in started:  # their adapters now: one that does not fit is the operator's to fix
        job = partial(attach, s.model, adapters.get(s.listing.name, {}))
        if refused := mlx_thread.shared().submit(job).result():
            name, why = next(iter(refused.items()))
            raise MlxlisError(f"{s.listing.name}:{name}: {why}", field="--adapter")
    while started:  # taken out of the list: an unloaded model keeps no reference here
        s = started.pop(0)
        first = partial(build_served, s.model, s.listing, opts, budget, several, s.speculation)
        del s
        pool.add(mlx_thread.shared().submit(partial(first, opts.start_keep_alive)).result())
        del first
    sock = listen(opts.host, opts.port)
    state = State(pool, opts.api_key)
    state.responses_store_bytes = opts.responses_store_mb << 20
    state.keepalive = opts.keepalive
    state.allow_image_urls = opts.allow_image_urls
    state.allowed_origins = opts.allowed_origins
    if several or any(s.model.vision is not None for s in pool.loaded.values()):  # images
        state.max_body = MAX_VISION_BODY_BYTES
    config = uvicorn.Config(
        create_app(state),
        log_level="info" if opts.verbose else "warning",
        access_log=opts.verbose,
        lifespan="off",
        timeout_graceful_shutdown=int(SHUTDOWN_WAIT_S),
        http=with_deadline(opts.head_timeout),  # a request's head within it (http_protocol.py)
    )
    server = _Server(config, state)

    def fatal(message: str) -> None:  # a rank was lost, the loop failed: nothing more runs
        state.fatal = message
        log.error("error: %s", message)
        server.should_exit = True

    pool.set_on_fatal(fatal)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    context = ""
    if len(pool.loaded) == 1:  # the one model's: what a client may fill
        context = f", context {next(iter(pool.loaded.values())).target.max_context}"
    log.info(
        "%s on %s (batch %d, queue %d%s%s)",
        ", ".join(shown),
        url,
        opts.max_batch,
        opts.max_queue,
        context,
        ", API key required" if opts.api_key else "",
    )
    # uvicorn re-raises the signal that stopped it once it is done, with the handlers it found:
    # these make that a clean exit (status 0) instead of a death by SIGTERM / KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        state.worker.shutdown(wait=False)
        if not state.stopping:  # uvicorn failed before a signal: the engines still run
            stop_engines(pool.engines())
    if state.fatal is not None:
        return 1
    log.info("stopped")
    return 0
