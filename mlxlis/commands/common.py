"""What the commands share: messages to stderr, loading the model their flags name, its
details, and the guard that turns errors into exit codes (0 success, 2 bad input / unsupported /
no template, message on stderr, no traceback unless --debug; 1 a bug; 130 interrupted)."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from mlxlis.errors import MlxlisError
from mlxlis.models.model import Model
from mlxlis.runtime import process

SUBCOMMANDS = ("chat", "serve", "inspect", "pull", "models", "rm", "convert", "embed")


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def load_model(a: argparse.Namespace, ref: str | None = None, task: str | None = None):
    """The model `ref` (default: the -m flag's) names, loaded with the flags' options; `task`
    (default: the --task flag's) as `mlxlis.load` takes it."""
    import warnings

    from mlxlis import load
    from mlxlis.api import LoadOptions
    from mlxlis.loading.manifest import UnboundTensorsWarning

    options = LoadOptions(
        dtype=a.dtype,
        dequantize=a.dequantize,
        chat_template=a.chat_template,
        bindings=getattr(a, "bindings", None),
        strict=getattr(a, "strict", True),
        layers_split=getattr(a, "layers_split", None),
        tensor=getattr(a, "tensor", None),
        kv_bits=a.kv_bits,
        kv_group_size=a.kv_group_size,
        mmproj=getattr(a, "mmproj", None),
        adapters=tuple(getattr(a, "adapter", None) or ()),
        adapter_scale=getattr(a, "adapter_scale", 1.0),
        fuse=getattr(a, "fuse", False),
        task=task if task is not None else getattr(a, "task", None),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnboundTensorsWarning)
        model = load(a.model if ref is None else ref, **options.kwargs())
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
    if model.fused:
        names = ", ".join(ad.path.name for ad in model.adapters)
        say(f"mlxlis: --fuse: {names} {model.fused}")
    return model


def print_details(model: Model) -> None:
    """The model's facts, this process's (device, BLAS, kernels) after its dtype, and why a
    faster BLAS is not in use last, when so."""
    facts = process.describe()
    notice = facts.pop("notice", None)
    rows: list[tuple[str, str]] = []
    for k, v in model.describe().items():
        rows.append((k, v))
        if k == "dtype":
            rows += facts.items()
    for k, v in rows + ([("notice", notice)] if notice else []):
        say(f"{k:>9}: {v}")


def guard(debug: bool, fn: Callable[[], int]) -> int:
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
