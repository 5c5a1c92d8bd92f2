"""Bind tensors (already under module names) to a family model: checks, casts, quantization.

Which tensor feeds which parameter is decided and validated beforehand by `manifest.py`
(binding manifests); `bind` is the last step and re-checks names and shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol

from mlxlis.errors import ConfigError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from mlxlis.runtime import kernels
from mlxlis.runtime.device import on_cpu

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


class Bindable(Protocol):
    """What binding a checkpoint asks of a network (an nn.Module: its modules and parameters,
    and how its family reads a checkpoint's names); plan.py binds against it."""

    def named_modules(self) -> list[tuple[str, nn.Module]]: ...

    def parameters(self) -> dict: ...

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint names -> ours (the family's renames; what it drops left out), values
        unchanged: applied to names only by the plan."""
        ...

    def expert_stacks(self) -> dict[str, Any]:
        """Stacked expert parameters -> where Hugging Face checkpoints keep them (an
        ExpertSource of models/experts.py, or a tuple of alternatives); empty when none."""
        ...


class Float32Parameters:
    """A module whose parameters named in `float32` are held in float32 whatever the compute
    dtype, as transformers keeps them (`_keep_in_fp32_modules_strict`): GLM-4.5's router,
    whose near-ties a float16 / bfloat16 copy of its weight or correction bias would break.
    `bind` (and the GGUF conversion) cast them to float32 instead of the compute dtype."""

    float32: ClassVar[tuple[str, ...]] = ()


def float32_names(model: nn.Module) -> set[str]:
    """The full names of the parameters `model`'s Float32Parameters modules keep in float32."""
    return {
        f"{path}.{p}" if path else p
        for path, m in model.named_modules()
        if isinstance(m, Float32Parameters)
        for p in m.float32
    }


class Quantizer(Protocol):
    """Which quantized layers a network is built with (models/quantized.py's Kernels: the same
    parameters and names as MLX's, the products through mlxlis's CPU kernels)."""

    def quantize(self, module: nn.Module, params: dict[str, Any]) -> nn.Module:
        """`module` quantized as its `to_quantized(**params)` would be."""
        ...

    def empty_linear(self) -> nn.QuantizedLinear:
        """A quantized linear layer with nothing set yet (filled in by hand: the layouts
        `to_quantized` refuses)."""
        ...


class MLXLayers:
    """MLX's own quantized layers."""

    def quantize(self, module: nn.Module, params: dict[str, Any]) -> nn.Module:
        return module.to_quantized(**params)

    def empty_linear(self) -> nn.QuantizedLinear:
        return nn.QuantizedLinear.__new__(nn.QuantizedLinear)


def kept_narrow(name: str, stored: mx.Dtype, dtype: mx.Dtype) -> bool:
    """A matmul's quantization scales / biases (`name`: the parameter) stored in float16 stay
    so under float32 compute where mlxlis's CPU kernels run the product: widening would change
    no value (float16 ⊂ float32) and cost 1 more bit per weight; the kernels read them as
    float32, and an embedding's lookup widens the rows it reads (models/quantized.py). Not MoE
    experts' or a prediction head's, whose products are MLX's own (which would widen them at
    every call)."""
    module, _, part = name.rpartition(".")
    if part == "super_scales":  # a super-block format's d, dmin: float16 is its layout
        return True
    if part not in ("scales", "biases") or stored != mx.float16 or dtype != mx.float32:
        return False
    if any(k in module for k in ("switch_mlp", "experts", "mtp")):
        return False
    return on_cpu() and kernels.load() is not None  # a GPU's products are MLX's own


def quantize_like(
    model: nn.Module,
    weights: dict[str, mx.array],
    quant: dict | None,
    path: Path | str = "config.json",
    quantizer: Quantizer | None = None,
) -> None:
    """Turn the Linear/Embedding modules whose tensors arrive with `.scales` into quantized ones.

    `quant` is config.json's "quantization" block: defaults plus per-module overrides
    ({"bits", "group_size"} or False), as mlx_lm.convert writes it. `quantizer`: which
    quantized layers are built (None: MLX's own).
    """
    quantizer = quantizer or MLXLayers()
    quant = quant or {}
    _check_quant(quant, path)
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

    def quantized(name: str, module: nn.Module) -> nn.Module:  # as nn.quantize reads `predicate`
        params = predicate(name, module)
        if not params:
            return module
        if params is True:
            params = {"group_size": None, "bits": None, "mode": "affine"}
        if not params.get("quantize_input", True):
            params = {k: v for k, v in params.items() if k != "quantize_input"}
        return quantizer.quantize(module, params)

    _sub_block_layers(model, weights, quant, path, quantizer)
    leaves = tree_map_with_path(quantized, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)


def _sub_block_layers(
    model: nn.Module,
    weights: dict[str, mx.array],
    quant: dict,
    path: Path | str,
    quantizer: Quantizer,
) -> None:
    """The linear layers in the layouts only mlxlis's CPU kernels take: groups of 16 (Q6_K's
    sub-blocks) and super-block formats (K-quants as stored: integer scales, a float16 pair
    per 256 weights). Made here, since MLX's `to_quantized` refuses them; their arrays are
    placeholders of the right shapes until `bind`."""
    for name, module in list(model.named_modules()):
        q = quant.get(name)
        own = isinstance(q, dict) and (q.get("group_size") == 16 or q.get("super"))
        if not own or f"{name}.scales" not in weights:
            continue
        if type(module) is not nn.Linear:
            raise ConfigError(
                f"groups of 16 and super-block formats are only held for linear layers, not "
                f"{type(module).__name__}",
                path=path,
                field=f"quantization.{name}",
            )
        out_dims, in_dims = module.weight.shape
        group = q["group_size"]
        layer = quantizer.empty_linear()
        nn.Module.__init__(layer)
        layer.group_size, layer.bits, layer.mode = group, q["bits"], "affine"
        layer.weight = mx.zeros((out_dims, in_dims * q["bits"] // 32), mx.uint32)
        layer.scales = mx.zeros((out_dims, in_dims // group))  # no biases: −2^(bits−1)·scale
        if f"{name}.biases" in weights:
            layer.biases = mx.zeros((out_dims, in_dims // group))
        if q.get("super"):
            layer.super_scales = mx.zeros((out_dims, in_dims // 256, 2), mx.float16)
        if "bias" in module:
            layer.bias = module.bias
        layer.freeze()
        *parents, last = name.split(".")
        owner = model
        for part in parents:
            owner = owner[int(part)] if isinstance(owner, list) else owner[part]
        owner[last] = layer


def _check_quant(quant: dict, path: Path | str) -> None:
    """Types and signs of a quantization block before MLX sees it: MLX rejects unsupported
    values with a ValueError, but a group_size of 0 kills the process (integer division)."""
    blocks = [("quantization", quant)]
    blocks += [(f"quantization.{k}", v) for k, v in quant.items() if isinstance(v, dict)]
    for where, block in blocks:
        for key in ("group_size", "bits"):
            v = block.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ConfigError(
                    f"{key} must be a positive integer, got {v!r}"[:200],
                    path=path,
                    field=f"{where}.{key}",
                )
        mode = block.get("mode")
        if mode is not None and not isinstance(mode, str):
            raise ConfigError(
                f"mode must be a string, got {mode!r}"[:200], path=path, field=f"{where}.mode"
            )


def bind(
    model: nn.Module,
    weights: dict[str, mx.array],
    path: Path | str,
    dtype: mx.Dtype,
    ignore: tuple[str, ...] = (),
) -> None:
    """Check names and shapes against the model, cast floats to `dtype` (float32 for those a
    Float32Parameters module keeps), load, materialise.

    Arrays are popped from `weights` as they are bound so the caller's references drop.
    """
    expected = dict(tree_flatten(model.parameters()))
    wide = float32_names(model)
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
    # one cast per source array (an embedding and head sharing one tensor); the source array is
    # kept in the entry so its id cannot be reused while the cache lives
    cast: dict[int, tuple[mx.array, mx.array]] = {}
    for name, ref in expected.items():
        arr = weights.pop(name)
        if tuple(arr.shape) != tuple(ref.shape):
            raise ShapeMismatchError(
                f"shape {tuple(arr.shape)} in the file, model expects {tuple(ref.shape)}",
                path=path,
                field=name,
            )
        target = mx.float32 if name in wide else dtype
        narrow = kept_narrow(name, arr.dtype, target)
        if (
            arr.dtype in FLOAT_DTYPES
            and ref.dtype in FLOAT_DTYPES
            and arr.dtype != target
            and not narrow
        ):
            if id(arr) not in cast:
                cast[id(arr)] = (arr, arr.astype(target))
            arr = cast[id(arr)][1]
        items.append((name, arr))
    del cast
    model.update(tree_unflatten(items))
    del items
    mx.eval(model.parameters())
