"""`mlxlis serve`: its flags, their bounds, and the server started on the loaded model."""

from __future__ import annotations

import argparse
import os

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
from mlxlis.settings import settings


def _context(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        message = f"expected a number of tokens or auto, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxlis serve",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health). The sampling flags set the defaults of "
        "requests that leave a value out.",
    )
    add_model_args(p)
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
        "--allow-image-urls",
        action="store_true",
        help="fetch the http(s) image URLs requests name (at most 20 MiB, 10 s each); by "
        "default only data: URLs and base64 images are read, and a URL is refused",
    )
    return p


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
        from mlxlis.serve.server import ServeOptions, serve

        # the model is built on the thread the engine runs on (MLX streams are per thread)
        model = mlx_thread.shared().submit(lambda: load_model(a)).result()
        if launched() and model.rank != 0:  # rank 0 serves; the others run its steps
            mlx_thread.shared().submit(lambda: follow(model)).result()
            return 0
        if a.verbose:
            print_details(model)
        spec = mlx_thread.shared().submit(lambda: load_speculation(a, model)).result()
        name = (
            a.model if not os.path.exists(a.model) else os.path.basename(os.path.normpath(a.model))
        )
        return serve(
            model,
            ServeOptions(
                name,
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
                spec,
                a.keepalive,
                a.prefix_cache_dir,
                a.prefix_cache_disk_gb,
                a.allow_image_urls,
                a.strict_context,
                a.head_timeout,
            ),
        )

    return guard(a.debug, go)
