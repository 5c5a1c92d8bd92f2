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
import numpy as np


class LoRALinear(nn.Module):
    """`base` (a Linear, a quantized Linear) plus its low-rank delta."""

    def __init__(self, base: nn.Module, lora: LoRA, dtype: mx.Dtype):
        super().__init__()
        self.base = base
        self.lora_a = lora.a.T.astype(dtype)  # (in, r)
        # (r, out) with the scale in it: a decoding step pays one product and one addmm, not
        # four operations (on the CPU each operation's fixed cost, not its size, is the price)
        self.lora_b = (lora.b.T.astype(mx.float32) * lora.scale).astype(dtype)
        self.scale = lora.scale  # (in lora_b already: kept to say it)

    def __call__(self, x: mx.array) -> mx.array:
        # base(x) + (x A^T)(s B^T): (..., in) -> (..., r) -> (..., out)
        return mx.addmm(self.base(x), x @ self.lora_a, self.lora_b)


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
    names: Names,
    dtype: mx.Dtype,
    undo: Undo | None = None,
) -> None:
    """`adapter` applied to `net`, its module names mapped to the network's by `names` (the
    family's Hugging Face renames, Family.hf.name, or its GGUF names: `naming`), each LoRA
    put in the network's layout by `undo` (a GGUF adapter's conventions)."""
    apply(net, targets(adapter, names, undo), dtype, str(adapter.path), labels(adapter, names))


def naming(adapter: Adapter, spec: Family, cfg: ModelConfig) -> tuple[Names, Undo | None]:
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


def targets(adapter: Adapter, names: Names, undo: Undo | None = None) -> dict[str, LoRA]:
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


def labels(adapter: Adapter, names: Names) -> dict[str, str]:
    """The network's module name -> the adapter's own name for it (errors name the latter)."""
    out = {}
    for name in adapter.layers:
        ours = names(name + ".weight")
        if ours is not None:
            out[ours.removesuffix(".weight")] = name
    return out


# --- several adapters on one base, chosen per row -----------------------------------------

# (B,) the rows, (B,) each row's slot (slot 0: none; adapter k: slot k + 1), and (B,) each
# row's scale multiplier or None (every one 1); None: no row has one
Picked = tuple[mx.array, mx.array, mx.array | None]
_rows: contextvars.ContextVar[Picked | None] = contextvars.ContextVar("lora_rows", default=None)


@contextlib.contextmanager
def rows(ids: Sequence[int] | None, scales: Sequence[float] | None = None) -> Iterator[None]:
    """The adapter of each row of the forwards built in the block: `ids[b]` an index into the
    model's selectable adapters (`select`), -1 for none, its scale multiplied by `scales[b]`
    (1 when not given); None: no row has one."""
    if ids is None:
        token = _rows.set(None)
    else:
        slots = mx.array([i + 1 for i in ids], mx.int32)
        mult = None
        if scales is not None and any(k != 1.0 for k in scales):
            mult = mx.array(list(scales), mx.float32)
        token = _rows.set((mx.arange(len(slots), dtype=mx.int32), slots, mult))
    try:
        yield
    finally:
        _rows.reset(token)


class SwitchLoRA(nn.Module):
    """`base` plus, per row, the low-rank delta of the adapter `rows` names for it: the
    adapters' A and s·B stacked behind a slot of zeros (no adapter), ranks padded with zeros
    to the largest (a zero row or column adds nothing), each row's pair taken by
    `mx.gather_mm` straight from the stacks, so rows on different adapters share one forward
    and nothing is copied per row."""

    def __init__(self, base: nn.Module, n_in: int, out: int):
        super().__init__()
        self.base = base
        self.n_in, self.out = n_in, out
        self.lora_a = mx.zeros((1, n_in, 1))  # (1 + adapters, in, r); slot 0: none
        self.lora_b = mx.zeros((1, 1, out))  # (1 + adapters, r, out), each times its scale
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
            b[:k, :] = (lora.b.T.astype(mx.float32) * lora.scale).astype(dtype)
            scale = lora.scale
        pad = r - self.lora_a.shape[2]
        stack_a = mx.pad(self.lora_a.astype(dtype), [(0, 0), (0, 0), (0, pad)])
        stack_b = mx.pad(self.lora_b.astype(dtype), [(0, 0), (0, pad), (0, 0)])
        self.lora_a = mx.concatenate([stack_a, a[None]])
        self.lora_b = mx.concatenate([stack_b, b[None]])
        self.scales = mx.concatenate([self.scales, mx.array([scale], mx.float32)])

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)  # (B, T, out)
        picked = _rows.get()
        if picked is None or self.scales.shape[0] == 0:
            return y
        batch, slots, mult = picked
        h = mx.gather_mm(x, self.lora_a, batch, slots)  # (B, T, r)
        delta = mx.gather_mm(h, self.lora_b, batch, slots)  # (B, T, out)
        if mult is not None:  # a request's own scale on its adapter's
            delta = delta * mult.astype(delta.dtype)[:, None, None]
        return y + delta


def select(
    net: nn.Module,
    adapter: Adapter,
    names: Names,
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


# --- merging into the base weights ---------------------------------------------------------


def dense_weight(module: nn.Module) -> mx.array:
    """The (out, in) float32 weight of a linear module as it computes: a Linear's own, a
    quantized one's dequantized (MLX's formats, and the forms held for the CPU kernels only:
    GGUF's super-blocks, symmetric affine without biases, groups of 16)."""
    if not isinstance(module, nn.QuantizedLinear):
        return module.weight.astype(mx.float32)
    scales, biases = module["scales"], module.get("biases")
    group, bits, mode = module.group_size, module.bits, module.mode
    supers = module.get("super_scales")
    if supers is None and (biases is not None or mode != "affine") and group in (32, 64, 128):
        return mx.dequantize(
            module["weight"], scales, biases, group_size=group, bits=bits, mode=mode
        ).astype(mx.float32)
    if supers is not None:
        from mlxlis.runtime.kernels import super_scales_as_float

        scales, biases = super_scales_as_float(scales, biases, supers, group)
    scales = scales.astype(mx.float32)
    if biases is None:  # symmetric (Q6_K): bias −2^(bits−1)·scale
        biases = -(2 ** (bits - 1)) * scales
    # the codes: a little-endian bit stream of `bits` per weight, as MLX packs them
    packed = np.array(module["weight"]).view(np.uint8)  # (out, in·bits/8)
    stream = np.unpackbits(packed, axis=1, bitorder="little")  # (out, in·bits)
    out = stream.shape[0]
    codes = stream.reshape(out, -1, bits) @ (1 << np.arange(bits))  # (out, in)
    w = mx.array(codes.astype(np.float32)).reshape(out, -1, group)  # (out, groups, group)
    w = w * scales[..., None] + biases.astype(mx.float32)[..., None]
    return w.reshape(out, -1)


def requantizable(module: nn.QuantizedLinear) -> bool:
    """Whether `mx.quantize` makes the module's form again (an MLX-quantized folder's, a GGUF
    block MLX holds as its own affine arrays): not the super-block and bias-free forms the
    CPU kernels alone read, nor group sizes MLX does not quantize to."""
    if "super_scales" in module or module.mode == "affine" and "biases" not in module:
        return False
    try:  # the one authority on which (bits, group, mode) MLX quantizes to
        probe = mx.zeros((1, module.group_size * 4))
        mx.quantize(probe, module.group_size, module.bits, mode=module.mode)
    except ValueError:
        return False
    return True


def _merged(module: LoRALinear, dtype: mx.Dtype) -> tuple[nn.Module, str]:
    """The base of an adapted module (several adapters: nested) with every delta s·B·A added
    to its weight, and how it is held now."""
    delta: mx.array | None = None
    node: nn.Module = module
    while isinstance(node, LoRALinear):
        # lora_a (in, r), lora_b (r, out): (B A)ᵀ = lora_a @ lora_b, (in, out)
        d = (node.lora_a.astype(mx.float32) @ node.lora_b.astype(mx.float32)).T  # s·B·A
        delta = d if delta is None else delta + d  # (out, in)
        node = node.base
    assert delta is not None
    weight = dense_weight(node) + delta  # (out, in) float32
    bias = node.get("bias")
    if isinstance(node, nn.QuantizedLinear) and requantizable(node):
        dt = node["scales"].dtype  # quantized as a merged checkpoint in that dtype would be
        dt = dt if mx.issubdtype(dt, mx.floating) else mx.float32  # mxfp4's are uint8
        w, *sb = mx.quantize(weight.astype(dt), node.group_size, node.bits, mode=node.mode)
        node.weight, node.scales = w, sb[0]
        if len(sb) > 1:
            node.biases = sb[1]
        g = f"{node.bits}-bit g{node.group_size}"
        return node, f"merged and requantized to {g}" + (
            f" {node.mode}" if node.mode != "affine" else ""
        )
    if isinstance(node, nn.QuantizedLinear):  # a form MLX does not make: dense from here
        out, n_in = weight.shape
        dense = nn.Linear(n_in, out, bias=bias is not None)
        dense.weight = weight.astype(dtype)
        if bias is not None:
            dense.bias = bias
        return dense, f"merged into dense {str(dtype).replace('mlx.core.', '')} weights"
    node.weight = weight.astype(node.weight.dtype)
    return node, f"merged into dense {str(node.weight.dtype).replace('mlx.core.', '')} weights"


def fuse(net: nn.Module, dtype: mx.Dtype) -> str:
    """Every applied adapter (`LoRALinear`) merged into its base's weight, the wrapper gone:
    a dense weight gets W + s·B·A in its dtype; an MLX-quantized one is dequantized, merged
    and quantized again with its bits, group size and mode; a form only the CPU kernels read
    (GGUF super-blocks) becomes dense in `dtype`. Returns what was done, e.g. "merged and
    requantized to 4-bit g64 (28 modules)"; "" when nothing was adapted."""
    done: dict[str, int] = {}
    names = [n for n, m in net.named_modules() if isinstance(m, LoRALinear)]
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    for name in outer:
        parent, key, module = find(net, name)  # type: ignore[misc]
        merged, how = _merged(module, dtype)
        mx.eval(merged.parameters())  # one module's float32 weight at a time, not the model's
        _replace(parent, key, merged)
        done[how] = done.get(how, 0) + 1
    return "; ".join(f"{how} ({n} module{'s' if n > 1 else ''})" for how, n in sorted(done.items()))
