"""The models a server holds: loaded on demand by name, kept within the memory budget,
unloaded when idle.

A request names a model (`Listing`); the first one to name a model that is not loaded loads it
(`Pool.use`), and requests to it wait for the load while the other models keep serving. The
weights of every loaded model, each one's prefix-cache bound and a margin stay within the
budget (runtime/memory.py): a model that does not fit is loaded after the least recently used
*idle* ones are unloaded (a model with requests in flight is never unloaded under them; when
the idle ones do not free enough, the request is refused with a 503 and Retry-After), and a
model whose files alone outgrow the budget is refused before anything is read. Each loaded
model's engine checks its requests' caches against what the others' weights, prefix caches
and running requests leave (Engine.others).

A LoRA adapter (`--adapter`) is loaded with its model, selectable per request (its bytes
count with the model's); a request naming the adapter (BASE:NAME) gets the model as its view
(`Served.view`): the same engine, every request of it on that adapter.

A model is unloaded once idle for its keep-alive (`--keep-alive`, a request's `keep_alive`:
a duration, `-1` forever, `0` as soon as its requests end); its engine stops and the arrays
are freed (MLX's cache cleared), so the memory returns.

Everything here runs on the event loop's thread (no lock): a decision and what it changes
happen without an await between them.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from mlxlis.errors import ConfigError, MlxlisError
from mlxlis.generation.engine import Engine
from mlxlis.loading.adapters import Adapter
from mlxlis.models import family, lora
from mlxlis.runtime import mlx_thread
from mlxlis.runtime.device import trim_malloc
from mlxlis.serve.listings import Listing
from mlxlis.serve.openai_format import TokenText
from mlxlis.serve.prepare import Target

import mlx.core as mx

log = logging.getLogger("mlxlis.serve")
DEFAULT_KEEP_ALIVE = 300.0  # seconds (Ollama's 5 minutes)
REAP_EVERY_S = 0.25  # how often idle models' keep-alives are checked
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def keep_alive_seconds(value: float | int | str, field: str = "keep_alive") -> float | None:
    """Ollama's keep_alive: seconds (a number, or a string of one), or a Go duration ("5m",
    "1h30m", "300ms"); negative: forever (None); 0: unload as soon as idle."""
    if isinstance(value, bool):
        raise ConfigError(
            f"expected a duration such as 5m or a number of seconds: {value}", field=field
        )
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ConfigError(
                    f"expected a duration such as 5m, 1h30m or 300ms, or a number of seconds, "
                    f"got {value!r}",
                    field=field,
                ) from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds):
        raise ConfigError(f"expected a finite duration, got {value!r}", field=field)
    return None if seconds < 0 else seconds


class PoolError(MlxlisError):
    """A model that cannot be served now: `status` is the HTTP status (404 unknown, 400 too
    large for the memory even alone, 503 the memory held by busy models)."""

    def __init__(self, message: str, status: int, code: str, field: str = "model"):
        super().__init__(message, field=field)
        self.status, self.code = status, code


class Idle:
    """The runner of a model that keeps no engine (an embedding or reranking model: each
    request's call runs as one job on the MLX thread, serve/embeddings.py): nothing queued,
    no caches beyond its weights, nothing to stop."""

    def __init__(self, model: Any):
        self.model = model
        self.memory = None
        self.others: Callable[[], int] | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.prefix = None  # no prefix cache
        self.counts = (0, 0)  # its requests are its holds (Served.busy)
        self.prefilled = 0  # no prompt is read into caches

    def reserved(self) -> int:
        return 0

    def shutdown(self, timeout: float | None = None) -> None:
        pass


@dataclass(eq=False)
class Served:
    """One loaded model as the routes use it."""

    listing: Listing
    target: Target
    engine: Engine | Idle  # Idle: a model that does not generate
    fingerprint: str
    reserve: int  # bytes it holds beside its requests' caches: weights + prefix-cache bound
    keep_alive: float | None  # seconds idle before it is unloaded; None: never
    last_used: float = field(default_factory=time.monotonic)
    holds: int = 0  # requests being prepared or running on it
    # its adapters that did not fit it when it loaded: name -> why (their requests get a 400)
    refused: dict[str, str] = field(default_factory=dict)
    owner: Served | None = None  # an adapter's view: the model's own Served
    token_text: TokenText = field(init=False)

    def __post_init__(self) -> None:
        tok = self.target.model.tokenizer
        self.token_text = TokenText(
            lambda ids: tok.decode(ids, clean_spaces=False), tok.token_bytes
        )

    @property
    def name(self) -> str:
        return self.listing.name

    @property
    def model(self) -> Any:
        return self.target.model

    @property
    def busy(self) -> bool:
        return self.holds > 0 or self.engine.counts != (0, 0)

    def expires(self) -> float | None:
        """When (time.monotonic) it is unloaded if it stays idle; None: never."""
        return None if self.keep_alive is None else self.last_used + self.keep_alive

    @contextmanager
    def held(self) -> Iterator[Served]:
        """Not unloaded while the block runs (a request being prepared and submitted)."""
        (self.owner or self).holds += 1
        try:
            yield self
        finally:
            self.release()

    def release(self) -> None:
        own = self.owner or self
        own.holds -= 1
        own.last_used = time.monotonic()

    def view(self, listing: Listing) -> Served:
        """The model as the requests naming one of its adapters (`listing`) use it: that
        adapter chosen for each, the same engine; held and kept alive as the model."""
        if why := self.refused.get(listing.adapter):
            raise PoolError(
                f"the adapter {listing.name!r} does not fit its model: {why}",
                400,
                "adapter_unusable",
            )
        key = self.model.selectable[listing.adapter].key
        return replace(
            self,
            listing=listing,
            target=replace(self.target, adapter=listing.adapter),
            fingerprint=f"{self.fingerprint}-{key[:8]}",
            holds=0,
            owner=self,
        )


Loader = Callable[[Listing], Any]  # a listing's files -> its Model (on the loading thread)
Builder = Callable[[Listing, Any], Served]  # a loaded Model -> its Served (on the MLX thread)


class Pool:
    def __init__(
        self,
        names: dict[str, Listing],
        load: Loader,
        build: Builder,
        budget: int,
        margin: int,
        prefix_bytes: int,
        default: str | None = None,
        adapters: dict[str, dict[str, Adapter]] | None = None,
    ):
        self.names = names  # every name a request may use -> its listing
        self.adapters = adapters or {}  # a model's name -> its adapters by name
        self.load, self.build = load, build
        self.budget, self.margin, self.prefix_bytes = budget, margin, prefix_bytes
        self.default = default  # the model of a request that names none
        self.loaded: dict[str, Served] = {}  # by listing name
        self._loading: dict[str, asyncio.Future[Served]] = {}
        self._lock: asyncio.Lock | None = None  # one load or eviction decision at a time
        self._reaper: asyncio.Task | None = None
        # told when an engine stops on its own (a rank lost, its loop failed): the server exits
        self.on_fatal: Callable[[str], None] | None = None

    # --- names ---
    def listings(self) -> list[Listing]:
        """Each model once, in listing order."""
        return list({x.name: x for x in self.names.values()}.values())

    def listing(self, name: str | None) -> Listing:
        if name is None or name == "":
            if self.default is None:
                raise PoolError(
                    "this server serves several models: name one (GET /v1/models lists them)",
                    400,
                    "model_required",
                )
            name = self.default
        x = self.names.get(name) or self.names.get(name.removesuffix(":latest"))
        if x is None:
            shown = name if len(name) <= 200 else name[:200] + "…"
            raise PoolError(
                f"model {shown!r} not found",  # Ollama's words (GET /v1/models lists them)
                404,
                "model_not_found",
            )
        return x

    # --- loading ---
    def add(self, served: Served) -> None:
        """A model loaded before the server starts (-m): kept as `served.keep_alive` says."""
        self._ids(served)
        served.engine.on_fatal = self.on_fatal
        self.loaded[served.name] = served
        self._plan_rooms()

    def _ids(self, served: Served) -> None:
        """Its adapters' ids for llama.cpp's `lora` field: their order on the command line
        (one that did not fit keeps its id; a request naming it is refused)."""
        names = tuple(self.adapters.get(served.name, {}))
        served.target = replace(served.target, adapters=names)

    def set_on_fatal(self, fn: Callable[[str], None]) -> None:
        """`fn` told when any engine, loaded now or later, stops on its own."""
        self.on_fatal = fn
        for name in self.loaded:
            self.loaded[name].engine.on_fatal = fn

    async def use(self, name: str | None, keep_alive: float | None | str = "") -> Served:
        """The named model, loaded if it is not (evicting idle ones as needed); the caller
        holds it (`Served.held`) before its next await. `keep_alive` ("": unchanged) is its
        keep-alive from now on."""
        chosen = self.listing(name)
        listing = self.names[chosen.base] if chosen.adapter else chosen
        served = self.loaded.get(listing.name)
        if served is None:
            served = await self._load(listing)
        served.last_used = time.monotonic()
        if keep_alive != "":
            served.keep_alive = keep_alive  # type: ignore[assignment]
        return served.view(chosen) if chosen.adapter else served

    async def _load(self, listing: Listing) -> Served:
        pending = self._loading.get(listing.name)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Served] = asyncio.get_running_loop().create_future()
        self._loading[listing.name] = fut
        try:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                adapters = self.adapters.get(listing.name, {})
                files = sum(a.weights.stat().st_size for a in adapters.values())
                need = (listing.size or 0) + files + self.prefix_bytes
                await self._make_room(listing.name, need)
                started = time.monotonic()
                # read on a thread of its own: the other models' engines go on meanwhile
                model, refused = await asyncio.wrap_future(
                    mlx_thread.loading().submit(_loaded(self.load, listing, adapters))
                )
                for name, why in refused.items():
                    log.error("adapter %s:%s not loaded: %s", listing.name, name, why)
                job = mlx_thread.shared().submit(partial(self.build, listing, model))
                served = await asyncio.wrap_future(job)
                served.refused = refused
                self._ids(served)
                del model
                served.engine.on_fatal = self.on_fatal
                self.loaded[listing.name] = served
                self._plan_rooms()
                try:  # its weights as loaded, not as listed: the others make room if they can
                    await self._make_room(listing.name, 0)
                except PoolError as e:  # busy ones hold it: their requests' checks bound the rest
                    log.warning("loaded %s beyond the budget for now: %s", listing.name, e)
                log.info("loaded %s in %.1f s", listing.name, time.monotonic() - started)
            fut.set_result(served)
            return served
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters re-raise it; no "never retrieved" warning
            raise
        finally:
            del self._loading[listing.name]

    def held_bytes(self) -> int:
        """What the loaded models hold: weights, prefix-cache bounds, running requests' caches."""
        return sum(s.reserve + s.engine.reserved() for s in self.loaded.values())

    async def _make_room(self, name: str, need: int) -> None:
        """Unload idle models other than `name`, least recently used first, until `need` more
        bytes fit; a PoolError, with nothing unloaded, when `need` cannot fit even alone or
        when the busy models hold the room."""
        budget = self.budget - self.margin
        if need > budget:
            raise PoolError(
                f"the model {name!r} needs {need / 2**20:.0f} MiB (its weights and the prefix "
                f"cache's bound), over the server's memory budget of {budget / 2**20:.0f} MiB "
                "(MLXLIS_MAX_MEMORY, --prefix-cache-mb)",
                400,
                "model_too_large",
            )
        others = [s for s in self.loaded.values() if s.name != name]
        idle = [s.name for s in sorted(others, key=lambda s: s.last_used) if not s.busy]
        kept = sum(s.reserve + s.engine.reserved() for s in others if s.name not in idle)
        if need + kept + self._held_by(name) > budget:
            busy = ", ".join(repr(s.name) for s in others if s.name not in idle)
            raise PoolError(
                f"the model {name!r} needs {need / 2**20:.0f} MiB and the models with requests "
                f"in flight ({busy}) hold {kept / 2**20:.0f} MiB of {budget / 2**20:.0f} MiB; "
                "retry when they finish",
                503,
                "memory_full",
            )
        del others  # names only from here: an unloaded model's last reference is unload's
        for victim in idle:
            if need + self.held_bytes() <= budget:
                break
            await self.unload(victim)

    def _held_by(self, name: str) -> int:
        s = self.loaded.get(name)
        return 0 if s is None else s.reserve + s.engine.reserved()

    def _plan_rooms(self) -> None:
        """Each engine's room for its requests' caches: the budget less every loaded model's
        weights and prefix-cache bound (what the other engines' requests hold is checked at
        each submit: Engine.others)."""
        fixed = sum(s.reserve for s in self.loaded.values())
        room = self.budget - self.margin - fixed
        for s in self.loaded.values():
            engine = s.engine
            if engine.memory is not None:
                engine.memory = replace(engine.memory, room=room)
            engine.others = partial(self._reserved_besides, s.name)

    def _reserved_besides(self, name: str) -> int:
        """What the requests of the loaded models other than `name` hold (Engine.others)."""
        return sum(s.engine.reserved() for s in self.loaded.values() if s.name != name)

    # --- unloading ---
    async def unload(self, name: str) -> bool:
        """Unload the named model if it is loaded and idle; True when it was unloaded."""
        served = self.loaded.get(name)
        if served is None or served.busy:
            return False
        del self.loaded[name]
        self._plan_rooms()
        engine = served.engine
        engine.others = None
        del served
        await asyncio.to_thread(engine.shutdown)
        del engine
        await asyncio.wrap_future(mlx_thread.shared().submit(_free))
        log.info("unloaded %s", name)
        return True

    def start(self) -> None:
        """The task that unloads models idle past their keep-alive (on the running loop)."""
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            now = time.monotonic()
            due = [
                s.name
                for s in self.loaded.values()
                if (t := s.expires()) is not None and t <= now and not s.busy
            ]  # names: no reference to a model is held while it is unloaded
            for name in due:
                try:
                    await self.unload(name)
                except Exception as e:  # noqa: BLE001 — said; the server goes on
                    log.error("unloading %s failed: %s: %s", name, type(e).__name__, e)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()

    def engines(self) -> list[Engine | Idle]:
        return [s.engine for s in self.loaded.values()]


def _loaded(
    load: Loader, listing: Listing, adapters: dict[str, Adapter]
) -> Callable[[], tuple[Any, dict[str, str]]]:
    def job() -> tuple[Any, dict[str, str]]:
        model = load(listing)
        refused = attach(model, adapters)
        mx.eval(model.net.parameters())  # every weight read here, none left for the MLX thread
        return model, refused

    return job


def attach(model: Any, adapters: dict[str, Adapter]) -> dict[str, str]:
    """Each adapter made selectable on `model` (Model.select_adapter); those that do not fit
    it (another base's, a module it lacks): name -> why, the model left without them."""
    refused = {}
    for name, adapter in adapters.items():
        try:
            names, undo = lora.naming(adapter, family(model.config.family), model.config)
            model.select_adapter(name, adapter, names, undo)
        except MlxlisError as e:
            refused[name] = str(e)
    return refused


def _free() -> None:
    """On the MLX thread: the unloaded model's arrays released, MLX's buffer cache emptied and
    the allocator's free pages returned, so the memory goes back to the system."""
    gc.collect()
    mx.clear_cache()
    trim_malloc()
