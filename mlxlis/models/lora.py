"""Low-rank adapters on a loaded network, unmerged: y = W x + s · B (A x), where W stays as the
file holds it (dense, MLX-quantized, GGUF blocks) and A (r, in), B (out, r), s come from the
adapter (loading/adapters.py).

`apply` puts a `LoRALinear` in place of each module the adapter targets; the module it wraps
keeps its own weights and kernels (`base`). Nothing is merged: the same base can be served
with and without the adapter by a later change, and quantized weights stay quantized.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence

from mlxlis.errors import AdapterError
from mlxlis.loading.adapters import Adapter, LoRA
from mlxlis.models.base import Family
from mlxlis.models.config import ModelConfig
from mlxlis.models.conventions import ROW_ONLY

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
    if isinstance(module, (LoRALinear, SwitchLoRA)):
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


def check(
    net: nn.Module,
    layers: Mapping[str, LoRA],
    path: str,
    labels: Mapping[str, str] | None = None,
) -> None:
    """Every target a linear module of `net` whose (in, out) the adapter's shapes match; an
    AdapterError naming the file and the first module that is not (nothing applied yet), by
    the adapter's own name for it (`labels`: network name -> the adapter's)."""
    for name, lora in layers.items():
        field = (labels or {}).get(name, name)
        found = find(net, name)
        if found is None:
            raise AdapterError("the model has no such module", path=path, field=field)
        shape = dims(found[2])
        if shape is None:
            kind = type(found[2]).__name__
            raise AdapterError(f"not a linear module ({kind})", path=path, field=field)
        n_in, out = shape
        r = lora.a.shape[0]
        if lora.a.shape[1] != n_in or lora.b.shape != (out, r):
            raise AdapterError(
                f"lora_A {tuple(lora.a.shape)} and lora_B {tuple(lora.b.shape)} do not fit a "
                f"module of {n_in} inputs and {out} outputs (an adapter of another base?)",
                path=path,
                field=field,
            )


def _replace(parent: object, key: str | int, module: nn.Module) -> None:
    """`module` in place of the child `key` of `parent` (a module, or a list of layers)."""
    if isinstance(parent, list):
        parent[key] = module  # type: ignore[index]
    else:
        setattr(parent, key, module)  # type: ignore[arg-type]


def apply(
    net: nn.Module,
    layers: Mapping[str, LoRA],
    dtype: mx.Dtype,
    path: str,
    labels: Mapping[str, str] | None = None,
) -> None:
    """Every target wrapped (all checked first: an adapter never partly applies)."""
    check(net, layers, path, labels)
    for name, lora in layers.items():
        parent, key, module = find(net, name)  # type: ignore[misc]
        _replace(parent, key, LoRALinear(module, lora, dtype))
    # made now: a lazy array built on this thread cannot be evaluated on another's stream
    mx.eval([m.parameters() for _, m in net.named_modules() if isinstance(m, LoRALinear)])


Undo = Callable[[str, LoRA], LoRA]  # (the network's tensor name, LoRA) -> LoRA in our layout
Names = Callable[[str], str | None]  # an adapter's "<module>.weight" -> the network's name


def adapt(
    net: nn.Module,
    adapter: Adapter,
    names: Callable[[str], str | None],
    dtype: mx.Dtype,
    undo: Undo | None = None,
) -> None:
    """`adapter` applied to `net`, its module names mapped to the network's by `names` (the
    family's Hugging Face renames, Family.hf.name, or its GGUF names: `naming`), each LoRA
    put in the network's layout by `undo` (a GGUF adapter's conventions)."""
    apply(net, targets(adapter, names, undo), dtype, str(adapter.path), labels(adapter, names))


def naming(
    adapter: Adapter, spec: Family, cfg: ModelConfig
) -> tuple[Callable[[str], str | None], Undo | None]:
    """How `adapter`'s module names map onto a `spec` network (`names`), and what puts its
    LoRAs in that network's layout (`undo`): nothing for a checkpoint-named adapter; for a
    llama.cpp one, the family's GGUF names and the row conventions its converter folded
    into B (a convention that is not rows alone is refused, by module)."""
    if adapter.naming != "gguf":
        return spec.hf.name, None
    path = str(adapter.path)
    if adapter.arch not in spec.gguf.archs:
        raise AdapterError(
            f"an adapter of a {adapter.arch} model; this model is {cfg.family} "
            f"({', '.join(spec.gguf.archs) or 'no GGUF architecture'})",
            path=path,
            field="general.architecture",
        )

    own = labels(adapter, spec.gguf.module_name)  # errors name the adapter's tensors

    def undo(name: str, lora: LoRA) -> LoRA:
        b = lora.b  # (out, r): rows as the base's converter laid the weight's out
        for convention in spec.gguf.conventions:
            applies, fn = convention
            if not applies(name):
                continue
            if convention not in ROW_ONLY:
                raise AdapterError(
                    "llama.cpp's layout of this module is not undone for adapters",
                    path=path,
                    field=own.get(name.removesuffix(".weight"), name),
                )
            try:
                b = fn(b, cfg, "weight")
            except ValueError:  # rows that are no whole heads: an adapter of another base
                raise AdapterError(
                    f"lora_b {tuple(lora.b.shape)} does not fit this model's heads",
                    path=path,
                    field=own.get(name.removesuffix(".weight"), name),
                ) from None
        return LoRA(lora.a, b, lora.scale)

    return spec.gguf.module_name, undo


def targets(
    adapter: Adapter, names: Callable[[str], str | None], undo: Undo | None = None
) -> dict[str, LoRA]:
    """The adapter's LoRAs by the network's module names (`names`: Family.hf.name, or the
    GGUF names `naming` gives), in its layout (`undo`)."""
    layers = {}
    for name, lora in adapter.layers.items():
        ours = names(name + ".weight")
        if ours is None:  # a module of a part the family drops (a vision tower)
            raise AdapterError(
                "a module this model does not load", path=str(adapter.path), field=name
            )
        layers[ours.removesuffix(".weight")] = lora if undo is None else undo(ours, lora)
    return layers


def labels(adapter: Adapter, names: Callable[[str], str | None]) -> dict[str, str]:
    """The network's module name -> the adapter's own name for it (errors name the latter)."""
    out = {}
    for name in adapter.layers:
        ours = names(name + ".weight")
        if ours is not None:
            out[ours.removesuffix(".weight")] = name
    return out


# --- several adapters on one base, chosen per row -----------------------------------------

# (B,) each row's adapter (-1: none) and (B,) its scale multiplier; None: no row has one
_rows: contextvars.ContextVar[tuple[mx.array, mx.array] | None] = contextvars.ContextVar(
    "lora_rows", default=None
)


@contextlib.contextmanager
def rows(ids: Sequence[int] | None, scales: Sequence[float] | None = None) -> Iterator[None]:
    """The adapter of each row of the forwards built in the block: `ids[b]` an index into the
    model's selectable adapters (`select`), -1 for none, its scale multiplied by `scales[b]`
    (1 when not given); None: no row has one."""
    if ids is None:
        chosen = None
    else:
        mult = [1.0] * len(ids) if scales is None else list(scales)
        chosen = (mx.array(list(ids), mx.int32), mx.array(mult, mx.float32))
    token = _rows.set(chosen)
    try:
        yield
    finally:
        _rows.reset(token)


class SwitchLoRA(nn.Module):
    """`base` plus, per row, the low-rank delta of the adapter `rows` names for it: the
    adapters' A and B stacked (ranks padded with zeros to the largest: a zero row or column
    adds nothing), gathered by row, so rows on different adapters share one forward."""

    def __init__(self, base: nn.Module, n_in: int, out: int):
        super().__init__()
        self.base = base
        self.n_in, self.out = n_in, out
        self.lora_a = mx.zeros((0, n_in, 1))  # (adapters, in, r)
        self.lora_b = mx.zeros((0, 1, out))  # (adapters, r, out)
        self.scales = mx.zeros((0,))  # (adapters,)

    def add(self, lora: LoRA | None, dtype: mx.Dtype) -> None:
        """One more adapter (None: one that leaves this module alone)."""
        r = max(self.lora_a.shape[2], lora.a.shape[0] if lora is not None else 1)
        a = mx.zeros((self.n_in, r), dtype)
        b = mx.zeros((r, self.out), dtype)
        scale = 0.0
        if lora is not None:
            k = lora.a.shape[0]
            a[:, :k] = lora.a.T.astype(dtype)
            b[:k, :] = lora.b.T.astype(dtype)
            scale = lora.scale
        pad = r - self.lora_a.shape[2]
        stack_a = mx.pad(self.lora_a.astype(dtype), [(0, 0), (0, 0), (0, pad)])
        stack_b = mx.pad(self.lora_b.astype(dtype), [(0, 0), (0, pad), (0, 0)])
        self.lora_a = mx.concatenate([stack_a, a[None]])
        self.lora_b = mx.concatenate([stack_b, b[None]])
        self.scales = mx.concatenate([self.scales, mx.array([scale], mx.float32)])

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)  # (B, T, out)
        chosen = _rows.get()
        if chosen is None or self.scales.shape[0] == 0:
            return y
        ids, mult = chosen  # (B,), (B,)
        pick = mx.maximum(ids, 0)  # (B,); -1 (none) reads adapter 0, scaled by 0
        scale = mx.where(ids >= 0, self.scales[pick] * mult, 0.0).astype(y.dtype)
        delta = (x @ self.lora_a[pick]) @ self.lora_b[pick]  # (B, T, r) -> (B, T, out)
        return y + delta * scale[:, None, None]


def select(
    net: nn.Module,
    adapter: Adapter,
    names: Callable[[str], str | None],
    dtype: mx.Dtype,
    undo: Undo | None = None,
) -> None:
    """`adapter` made selectable per row (`rows`), after those selectable already: every
    module any of them targets holds a slot for each (zeros where one leaves it alone)."""
    layers = targets(adapter, names, undo)
    check(net, layers, str(adapter.path), labels(adapter, names))
    switches = [m for _, m in net.named_modules() if isinstance(m, SwitchLoRA)]
    count = switches[0].scales.shape[0] if switches else 0
    for name in layers:
        parent, key, module = find(net, name)  # type: ignore[misc]
        if not isinstance(module, SwitchLoRA):
            n_in, out = dims(module)  # type: ignore[misc]
            switch = SwitchLoRA(module, n_in, out)
            for _ in range(count):  # the adapters before this one leave it alone
                switch.add(None, dtype)
            _replace(parent, key, switch)
    for name, m in net.named_modules():
        if isinstance(m, SwitchLoRA):
            m.add(layers.get(name), dtype)
    mx.eval([m.parameters() for _, m in net.named_modules() if isinstance(m, SwitchLoRA)])
