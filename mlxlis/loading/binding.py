"""Bind tensors (already under module names) to a family model: checks, casts, quantization."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import MissingTensorError, ShapeMismatchError, UnexpectedTensorError

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def quantize_like(model: nn.Module, weights: dict[str, mx.array], quant: dict | None) -> None:
    """Turn the Linear/Embedding modules whose tensors arrive with `.scales` into quantized ones.

    `quant` is config.json's "quantization" block: defaults plus per-module overrides
    ({"bits", "group_size"} or False), as mlx_lm.convert writes it.
    """
    quant = quant or {}
    default = {k: quant[k] for k in ("group_size", "bits", "mode") if k in quant}

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        override = quant.get(path)
        if override is False:
            return False
        if isinstance(override, dict):
            return {**default, **override}
        return default or True

    nn.quantize(model, class_predicate=predicate)


def bind(
    model: nn.Module,
    weights: dict[str, mx.array],
    path: Path | str,
    dtype: mx.Dtype,
    ignore: tuple[str, ...] = (),
) -> None:
    """Check names and shapes against the model, cast floats to `dtype`, load, materialise.

    Arrays are popped from `weights` as they are bound so the caller's references drop.
    """
    expected = dict(tree_flatten(model.parameters()))
    for name in ignore:
        weights.pop(name, None)
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise MissingTensorError(
            f"missing tensors: {', '.join(missing[:5])}{more}", path=path, field=missing[0]
        )
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise UnexpectedTensorError(
            f"unexpected tensors: {', '.join(unexpected[:5])}{more}", path=path, field=unexpected[0]
        )
    items = []
    for name, ref in expected.items():
        arr = weights.pop(name)
        if tuple(arr.shape) != tuple(ref.shape):
            raise ShapeMismatchError(
                f"shape {tuple(arr.shape)} in the file, model expects {tuple(ref.shape)}",
                path=path,
                field=name,
            )
        if arr.dtype in FLOAT_DTYPES and ref.dtype in FLOAT_DTYPES and arr.dtype != dtype:
            arr = arr.astype(dtype)
        items.append((name, arr))
    model.update(tree_unflatten(items))
    del items
    mx.eval(model.parameters())
