"""Low-rank adapters on a loaded network, unmerged: y = W x + s · B (A x), where W stays as the
file holds it (dense, MLX-quantized, GGUF blocks) and A (r, in), B (out, r), s come from the
adapter (loading/adapters.py).

`apply` puts a `LoRALinear` in place of each module the adapter targets; the module it wraps
keeps its own weights and kernels (`base`). Nothing is merged: the same base can be served
with and without the adapter by a later change, and quantized weights stay quantized.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from mlxlis.errors import AdapterError
from mlxlis.loading.adapters import Adapter, LoRA

import mlx.core as mx
import mlx.nn as nn


class LoRALinear(nn.Module):
    """`base` (a Linear, a quantized Linear) plus its low-rank delta."""

    def __init__(self, base: nn.Module, lora: LoRA, dtype: mx.Dtype):
        super().__init__()
        self.base = base
        self.lora_a = lora.a.T.astype(dtype)  # (in, r)
        self.lora_b = lora.b.T.astype(dtype)  # (r, out)
        self.scale = lora.scale

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)  # (..., out)
        delta = (x @ self.lora_a) @ self.lora_b  # (..., r) -> (..., out)
        return y + delta * self.scale


def dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a linear module (a quantized one's unpacked, an adapted one's base),
    None for another kind."""
    if isinstance(module, LoRALinear):
        return dims(module.base)
    if isinstance(module, nn.QuantizedLinear):
        out, packed = module.weight.shape
        return packed * 32 // module.bits, out
    if isinstance(module, nn.Linear):
        out, n_in = module.weight.shape
        return n_in, out
    return None


def find(net: nn.Module, name: str) -> tuple[nn.Module, str | int, nn.Module] | None:
    """(parent, key, module) of the dotted module `name` under `net`, None when absent."""
    parent: object = None
    key: str | int = ""
    node: object = net
    for part in name.split("."):
        parent = node
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return None
            key, node = int(part), node[int(part)]
        elif isinstance(node, nn.Module) and part in node:
            key, node = part, node[part]
        else:
            return None
    return (parent, key, node) if isinstance(node, nn.Module) else None  # type: ignore[return-value]


def check(net: nn.Module, layers: Mapping[str, LoRA], path: str) -> None:
    """Every target a linear module of `net` whose (in, out) the adapter's shapes match; an
    AdapterError naming the file and the first module that is not (nothing applied yet)."""
    for name, lora in layers.items():
        found = find(net, name)
        if found is None:
            raise AdapterError("the model has no such module", path=path, field=name)
        shape = dims(found[2])
        if shape is None:
            kind = type(found[2]).__name__
            raise AdapterError(f"not a linear module ({kind})", path=path, field=name)
        n_in, out = shape
        r = lora.a.shape[0]
        if lora.a.shape[1] != n_in or lora.b.shape != (out, r):
            raise AdapterError(
                f"lora_A {tuple(lora.a.shape)} and lora_B {tuple(lora.b.shape)} do not fit a "
                f"module of {n_in} inputs and {out} outputs (an adapter of another base?)",
                path=path,
                field=name,
            )


def apply(net: nn.Module, layers: Mapping[str, LoRA], dtype: mx.Dtype, path: str) -> None:
    """Every target wrapped (all checked first: an adapter never partly applies)."""
    check(net, layers, path)
    for name, lora in layers.items():
        parent, key, module = find(net, name)  # type: ignore[misc]
        wrapped = LoRALinear(module, lora, dtype)
        if isinstance(parent, list):
            parent[key] = wrapped  # type: ignore[index]
        else:
            setattr(parent, key, wrapped)  # type: ignore[arg-type]


def adapt(
    net: nn.Module, adapter: Adapter, names: Callable[[str], str | None], dtype: mx.Dtype
) -> None:
    """`adapter` applied to `net`, its module names (the base checkpoint's) mapped to the
    network's by `names` (the family's Hugging Face renames: Family.hf.name)."""
    layers = {}
    for name, lora in adapter.layers.items():
        ours = names(name + ".weight")
        if ours is None:  # a module of a part the family drops (a vision tower)
            raise AdapterError(
                "a module this model does not load", path=str(adapter.path), field=name
            )
        layers[ours.removesuffix(".weight")] = lora
    apply(net, layers, dtype, str(adapter.path))
