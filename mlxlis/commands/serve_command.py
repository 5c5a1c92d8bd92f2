"""`mlxlis serve`: its flags, their bounds, and the server started on the loaded model."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING

from mlxlis.commands.args import (
    add_model_args,
    add_sampling_args,
    add_speculative_args,
    load_speculation,
    sampling_params,
    speculative_flags,
)
from mlxlis.commands.common import guard, load_model, print_details
from mlxlis.distributed.leader import follow
from mlxlis.errors import MlxlisError
from mlxlis.loading import catalog
from mlxlis.settings import settings

if TYPE_CHECKING:  # imported where used: `mlxlis serve --help` stays quick
    from mlxlis.loading.adapters import Adapter
    from mlxlis.serve.listings import Listing


def _context(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        message = f"expected a number of tokens or auto, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


UNSET = object()  # --keep-alive not given (None is -1's forever)


def _keep_alive(text: str) -> float | None:
    from mlxlis.serve.pool import keep_alive_seconds

    try:
        return keep_alive_seconds(text, "--keep-alive")
    except MlxlisError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxlis serve",
        description="Serve models over the OpenAI, Anthropic, Responses and Ollama HTTP APIs "
        "(/v1/chat/completions, /v1/messages, /v1/responses, /api/chat, /v1/models, /health, "
        "...). A request names its model; one not loaded is loaded then, within the memory "
        "budget (the least recently used idle model unloaded to make room), and unloaded once "
        "idle for its keep-alive. The sampling flags set the defaults of requests that leave a "
        "value out.",
    )
    add_model_args(p, several=True)
    add_sampling_args(p)
    add_speculative_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free one)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        metavar="N",
        help="requests generating at once (default 8)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests waiting for a place; more get HTTP 429 (default 64)",
    )
    p.add_argument(
        "--max-context",
        type=_context,
        default=None,
        metavar="N|auto",
        help="prompt + completion tokens per request (default: the model's context length; "
        "auto: the longest --max-batch requests' caches fit in the memory beside the weights)",
    )
    p.add_argument(
        "--strict-context",
        action="store_true",
        help="refuse a request whose prompt + max_tokens exceed the context (400 "
        "context_length_exceeded, OpenAI's rule); by default max_tokens is a ceiling: the "
        "reply stops at the context's end with the API's length stop reason (what agents "
        "such as Claude Code and Codex need: they ask for 32 000 tokens as a matter of course)",
    )
    p.add_argument(
        "--api-key",
        default=settings().api_key,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` (default: $MLXLIS_API_KEY; none: no key)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=1024,
        metavar="MB",
        help="memory for the KV caches of recent prompts, reused by requests that "
        "share their start (default 1024; 0: off)",
    )
    p.add_argument(
        "--responses-store-mb",
        type=int,
        default=64,
        metavar="MB",
        help="memory for /v1/responses kept for GET and previous_response_id, the least "
        "recently used dropped first (default 64; 0: none kept)",
    )
    p.add_argument(
        "--prefix-cache-dir",
        default=None,
        metavar="DIR",
        help="also keep finished requests' caches as files in DIR, read back when a later "
        "prompt shares their start, across restarts (default: memory only); one folder per "
        "model (any KV formats): files another model wrote there are deleted as foreign",
    )
    p.add_argument(
        "--prefix-cache-disk-gb",
        type=float,
        default=10.0,
        metavar="GB",
        help="the most --prefix-cache-dir holds, the least recently used dropped first "
        "(default 10)",
    )
    p.add_argument(
        "--keepalive",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between the `ping` events of a /v1/messages stream waiting for a place "
        "or reading a long prompt, so that clients and proxies do not time out (default 10)",
    )
    p.add_argument(
        "--head-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a connection has to send a request's line and headers (after it opens, "
        "or after its previous response); a client that stalls there is disconnected "
        "(default 30)",
    )
    p.add_argument(
        "--models-dir",
        action="append",
        default=None,
        metavar="DIR",
        help="also serve the GGUF files and safetensors folders in DIR, by file or folder name "
        "(may be given several times)",
    )
    p.add_argument(
        "--alias",
        action="append",
        default=None,
        metavar="NAME=REF",
        help="another name for a model, one clients already send (e.g. a Claude model name "
        "for a local model); REF is a served name or a model reference (several times)",
    )
    p.add_argument(
        "--adapter",
        dest="adapters",  # not `adapter`: load_model applies that one to the model itself
        action="append",
        default=None,
        metavar="[MODEL:]NAME=PATH",
        help="a LoRA adapter (PEFT's or mlx-lm's folder, llama.cpp's GGUF LoRA, or a Hub "
        "name) on MODEL (default: the first -m), loaded with it and applied unmerged per "
        "request: a request names MODEL:NAME (or NAME) as its model, or the adapter's id in "
        "llama.cpp's `lora` field; requests on different adapters share each batch "
        "(several times)",
    )
    p.add_argument(
        "--rerank",
        action="append",
        default=None,
        metavar="NAME",
        help="the -m model of this NAME loaded as a reranker: a causal LM such as "
        "Qwen3-Reranker scoring by p(yes) (load's task rerank; several times)",
    )
    p.add_argument(
        "--keep-alive",
        type=_keep_alive,
        default=UNSET,
        metavar="DURATION",
        help="how long a model stays loaded once idle: 5m, 1h30m, 30s, seconds; -1 forever, 0 "
        "unloaded as soon as its requests end (default: 5m for a model loaded on demand; "
        "the first -m model, loaded at start, forever); a request's keep_alive overrides it",
    )
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch the http(s) image URLs requests name (at most 20 MiB, 10 s each); by "
        "default only data: URLs and base64 images are read, and a URL is refused",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGIN[,ORIGIN...]",
        help="web pages of these origins (scheme://host[:port], or * for any) may call the "
        "server from a browser: CORS headers and preflights answered (default: none, no CORS "
        "header at all; several times)",
    )
    return p


ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")


def allowed_origins(given: list[str]) -> tuple[str, ...]:
    """--allowed-origins' origins, each checked: `*`, or scheme://host[:port] as a browser
    sends it in `Origin` (no path, not even a trailing slash: it would never match)."""
    out: list[str] = []
    for text in given:
        for origin in (x.strip() for x in text.split(",")):
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise MlxlisError(
                    f"expected * or scheme://host[:port] (no path), got {origin!r}",
                    field="--allowed-origins",
                )
            out.append(origin)
    return ("*",) if "*" in out else tuple(dict.fromkeys(out))


def named_adapter(text: str) -> tuple[str | None, str, str]:
    """`[MODEL:]NAME=PATH` -> (MODEL or None: the first -m, NAME, PATH)."""
    head, sep, ref = text.partition("=")
    model, colon, name = head.rpartition(":")
    if not (sep and name and ref) or (colon and not model):
        raise MlxlisError(f"expected [MODEL:]NAME=PATH, got {text!r}", field="--adapter")
    return model or None, name, ref


def adapters_of(
    given: list[str], names: dict[str, Listing], first: str | None
) -> dict[str, dict[str, Adapter]]:
    """--adapter's adapters, read and checked now (a bad file: an error naming it), by the
    name of the model each runs on."""
    from mlxlis.loading.adapters import read_adapter

    out: dict[str, dict[str, Adapter]] = {}
    for text in given:
        model, name, ref = named_adapter(text)
        if model is None and first is None:
            raise MlxlisError(f"{text}: name its model (MODEL:NAME=PATH)", field="--adapter")
        listing = names.get(model or first or "")
        if listing is None or listing.adapter:
            raise MlxlisError(f"{text}: no served model {model!r}", field="--adapter")
        own = out.setdefault(listing.name, {})
        if name in own:
            raise MlxlisError(f"{text}: {listing.name} has an adapter {name!r}", field="--adapter")
        own[name] = read_adapter(ref)
    return out


def named_alias(text: str) -> tuple[str, str]:
    name, sep, ref = text.partition("=")
    if not (sep and name and ref):
        raise MlxlisError(f"expected NAME=REF, got {text!r}", field="--alias")
    return name, ref


SERVE_BOUNDS = {
    "port": (0, 65535),
    "max_batch": (1, None),
    "max_queue": (1, None),
    "max_context": (1, None),
    "prefix_cache_mb": (0, 1 << 30),
    "responses_store_mb": (0, 1 << 20),
    "keepalive": (0.01, 3600),
    "head_timeout": (0.1, 3600),
    "prefix_cache_disk_gb": (0.001, 1 << 20),
}


def run_serve(argv: list[str]) -> int:
    p = serve_parser()
    a = p.parse_args(argv)
    params = sampling_params(p, a)
    speculative_flags(p, a)
    for name, (low, high) in SERVE_BOUNDS.items():
        value = getattr(a, name)
        if isinstance(value, (int, float)) and (value < low or (high is not None and value > high)):
            flag = "--" + name.replace("_", "-")
            p.exit(2, f"{p.prog}: error: {flag}: out of range: {value}\n")

    def go() -> int:
        from mlxlis.distributed import launched
        from mlxlis.runtime import mlx_thread
        from mlxlis.serve.listings import named, of_ref, on_disk, table, with_adapters
        from mlxlis.serve.pool import DEFAULT_KEEP_ALIVE
        from mlxlis.serve.server import ServeOptions, Started, serve

        origins = allowed_origins(a.allowed_origins or [])  # refused before any loading
        refs = [named(text) for text in a.model or []]
        aliases = dict(named_alias(text) for text in a.alias or [])
        dirs = [Path(d).expanduser() for d in a.models_dir or []]
        if launched() and (len(refs) != 1 or dirs or aliases):
            raise MlxlisError(
                "a pipelined server (mlx.launch) serves one model: name it with one -m",
                field="-m",
            )
        listings = [of_ref(name, ref) for name, ref in refs]
        listings += on_disk(dirs, stores=not refs)  # without -m: every model on the disk
        names = table(listings, aliases)
        if not names:
            raise MlxlisError(
                "no model to serve: none is on the disk (mlxlis pull, or name one with -m or "
                "--models-dir)",
                field="-m",
            )
        if a.adapters and launched():
            raise MlxlisError("adapters on a pipelined model", field="--adapter")
        for r in a.rerank or ():
            if r not in names:
                raise MlxlisError(f"no model named {r!r} to rerank with", field="--rerank")
        rerankers = {names[r].name for r in a.rerank or ()}

        def task_of(listing) -> str | None:
            return "rerank" if listing.name in rerankers else None

        adapters = adapters_of(a.adapters or [], names, listings[0].name if refs else None)
        with_adapters(names, adapters)
        started = []
        if refs:  # the first -m is loaded now, with the speculation flags: errors show at once
            main = listings[0]
            # the model is built on the thread the engines run on (MLX streams are per thread)
            model = (
                mlx_thread.shared().submit(lambda: load_model(a, main.ref, task_of(main))).result()
            )
            if launched() and model.rank != 0:  # rank 0 serves; the others run its steps
                mlx_thread.shared().submit(lambda: follow(model)).result()
                return 0
            if a.verbose:
                print_details(model)
            spec = mlx_thread.shared().submit(lambda: load_speculation(a, model)).result()
            started.append(Started(main, model, spec))
            del model, spec  # the pool's from now on: unloaded, nothing here keeps it
        elif a.speculative is not None:
            raise MlxlisError("speculation is for the model named by the first -m", field="-m")
        default = listings[0].name if refs else None
        if default is None and catalog.DEFAULT_MODEL in names:
            default = catalog.DEFAULT_MODEL
        given = a.keep_alive is not UNSET  # -1 (forever) parses to None: not "not given"
        keep = a.keep_alive if given else DEFAULT_KEEP_ALIVE
        return serve(
            names,
            ServeOptions(
                a.host,
                a.port,
                a.max_batch,
                a.max_queue,
                a.max_context,
                a.api_key or None,
                a.verbose,
                params,
                a.prefix_cache_mb,
                a.responses_store_mb,
                a.keepalive,
                a.prefix_cache_dir,
                a.prefix_cache_disk_gb,
                a.allow_image_urls,
                a.strict_context,
                a.head_timeout,
                keep,
                a.keep_alive if given else None,
                origins,
            ),
            lambda listing: load_model(a, listing.ref, task_of(listing)),
            started,
            default,
            adapters,
        )

    return guard(a.debug, go)
