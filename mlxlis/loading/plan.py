"""Binding plans: each model parameter resolved to one tensor of one file, validated from the
safetensors headers before anything is read (see manifest.py for the manifest format and the
rules), and loaded lazily. Stacked expert parameters may come from per-expert or fused
tensors of the Hugging Face layouts (`Binding.parts`, `Binding.half`), and a tensor in another
converter's layout may bind transposed (`layouts`)."""

from __future__ import annotations

import difflib
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxlis import limits
from mlxlis.errors import ConfigError, FileFormatError, UnsupportedError
from mlxlis.loading.binding import Bindable, Quantizer, quantize_like
from mlxlis.loading.manifest import (
    _QUANT_PARTS,
    _TIED,
    INDEX,
    BindingDtypeError,
    BindingMissingError,
    BindingShapeError,
    DuplicateBindingError,
    Manifest,
    ManifestError,
    QuantTripletError,
    SourceSpec,
    UnboundTensorsWarning,
    UnexpectedBindingError,
    UnknownParameterError,
)
from mlxlis.loading.safetensors import ST_DTYPES, read_header, weight_files
from mlxlis.loading.slices import Cut, read_cut

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# ---------------------------------------------------------------- sources


@dataclass
class _Source:
    name: str
    files: list[Path]
    tensors: dict[str, tuple[Path, dict]]  # key -> (file, header entry)


def _open_source(spec: SourceSpec, manifest: Manifest, folder: Path) -> _Source:
    if spec.files is None:
        files = weight_files(folder)
    else:
        base = manifest.base or folder
        found: dict[Path, None] = {}
        for g in spec.files:
            matches = []
            try:
                for p in base.glob(g):
                    if len(found) + len(matches) >= limits.SAFETENSORS_MAX_FILES:
                        raise ManifestError(
                            f"files match more than {limits.SAFETENSORS_MAX_FILES} files",
                            path=manifest.origin,
                            field=f"sources.{spec.name}",
                        )
                    matches.append(p)
            except (ValueError, OSError, IndexError) as e:  # pathlib refuses it, unreadable dir
                raise ManifestError(
                    f"files glob {g!r}: {e}", path=manifest.origin, field=f"sources.{spec.name}"
                ) from None
            if not matches:
                raise ManifestError(
                    f"files glob {g!r} matches nothing in {base}",
                    path=manifest.origin,
                    field=f"sources.{spec.name}",
                )
            for p in sorted(matches):
                if not p.is_file() or p.suffix != ".safetensors":
                    raise ManifestError(
                        f"{p.name} matched by {g!r} is not a .safetensors file "
                        "(other formats are never read)",
                        path=manifest.origin,
                        field=f"sources.{spec.name}",
                    )
                found[p] = None
        files = list(found)
    tensors: dict[str, tuple[Path, dict]] = {}
    for path in files:
        header = read_header(path)
        for key, entry in header.items():
            if key in tensors:
                raise FileFormatError(
                    f"tensor also present in {tensors[key][0].name}", path=path, field=key
                )
            tensors[key] = (path, entry)
    return _Source(spec.name, files, tensors)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Binding:
    param: str
    source: str
    key: str
    file: Path
    explicit: bool  # named by the manifest (else bound by name)
    # a stacked expert parameter: its per-expert tensors in expert order (`key` is the first)
    # and the file of each (a layer's experts may span shards)
    parts: tuple[str, ...] = ()
    part_files: tuple[Path, ...] = ()
    axes: tuple[int, ...] | None = None  # transposed at load (another converter's layout)
    half: int | None = None  # this half of the tensor's axis `half_axis` (fused gate_up experts)
    half_axis: int = 1
    strided: bool = False  # the halves interleaved along half_axis (even, odd indices)
    blocks: bool = False  # uint8 MXFP4 blocks (..., G, 16) read as uint32 words (..., G·4)
    joined: bool = False  # the parts concatenated on axis 0 (shards of rows), not stacked


@dataclass
class BindingPlan:
    """The validated bindings: every model parameter to one tensor of one file."""

    bindings: dict[str, Binding]
    unbound: list[tuple[str, str]] = field(default_factory=list)  # (source, key), lenient
    quantized: list[str] = field(default_factory=list)  # module paths made quantized
    origin: str | None = None
    relaid: list[str] = field(default_factory=list)  # parameters bound through `layouts`
    dropped: list[str] = field(default_factory=list)  # checkpoint tensors the family skips
    cuts: dict[str, Cut] = field(default_factory=dict)  # a tensor rank's slices (slices.py)
    entries: dict[tuple[Path, str], dict] = field(default_factory=dict)  # their headers

    def load(self) -> dict[str, mx.array]:
        """Lazy arrays under parameter names (nothing is read until evaluated); the `cuts`
        read now, their slices only."""
        out: dict[str, mx.array] = {}
        for p, c in self.cuts.items():
            b = self.bindings[p]
            pieces = [
                read_cut(f, self.entries[(f, k)], c, p, self.origin or str(f))
                for f, k in zip(b.part_files or (b.file,), b.parts or (b.key,), strict=True)
            ]
            out[p] = mx.stack(pieces) if b.parts else pieces[0]
            mx.eval(out[p])
        files: dict[Path, None] = {}
        for b in self.bindings.values():
            if b.param in self.cuts:
                continue
            files.update(dict.fromkeys(b.part_files or (b.file,)))
        loaded: dict[Path, dict[str, mx.array]] = {}
        for path in files:
            try:
                loaded[path] = mx.load(str(path))
            except (RuntimeError, ValueError, OSError) as e:
                raise FileFormatError(f"cannot load: {e}", path=path) from None

        def tensor(path: Path, key: str) -> mx.array:
            if key not in loaded[path]:  # MLX read the header differently from the validator
                raise FileFormatError("tensor missing from MLX's reading", path=path, field=key)
            return loaded[path][key]

        for b in self.bindings.values():
            if b.param in self.cuts:
                continue
            if b.parts:  # (n_experts, out, in) from n_experts (out, in) tensors, or row shards
                experts = [tensor(f, k) for f, k in zip(b.part_files, b.parts, strict=True)]
                out[b.param] = mx.concatenate(experts) if b.joined else mx.stack(experts)
            else:
                out[b.param] = tensor(b.file, b.key)
            if b.half is not None:  # (E, 2·F, in) -> gate rows, then up rows (or on axis 2)
                a, ax = out[b.param], b.half_axis
                n = a.shape[ax] // 2
                cut = slice(b.half, None, 2) if b.strided else slice(b.half * n, (b.half + 1) * n)
                out[b.param] = mx.contiguous(a[(slice(None),) * ax + (cut,)])
            if b.blocks:
                a = out[b.param]
                out[b.param] = a.view(mx.uint32).reshape(*a.shape[:-2], a.shape[-2] * 4)
            if b.axes is not None:  # contiguous: the layout a converted folder reloads in
                out[b.param] = mx.contiguous(out[b.param].transpose(b.axes))
        return out


def _expand(manifest: Manifest, layers: int) -> dict[str, tuple[str, str]]:
    """param path -> (source, key), templates expanded over the layer indices."""
    templated = sum(1 for p, _, _ in manifest.entries if INDEX in p)
    if templated * layers + len(manifest.entries) > limits.MANIFEST_MAX_BINDINGS:
        raise ManifestError(
            f"{templated} templates × {layers} layers exceed "
            f"{limits.MANIFEST_MAX_BINDINGS} bindings",
            path=manifest.origin,
        )
    out: dict[str, tuple[str, str]] = {}
    origin: dict[str, str] = {}
    for path_t, source, key_t in manifest.entries:
        indices = range(layers) if INDEX in path_t else (None,)
        for i in indices:
            path = path_t if i is None else path_t.replace(INDEX, str(i))
            key = key_t if i is None else key_t.replace(INDEX, str(i))
            if path in out:
                raise DuplicateBindingError(
                    f"parameter bound twice in the manifest: to {out[path][1]!r} (by "
                    f"{origin[path]!r}) and to {key!r} (by {path_t!r})",
                    path=manifest.origin,
                    field=path,
                )
            out[path] = (source, key)
            origin[path] = path_t
    return out


def _quantizable(net: nn.Module) -> set[str]:
    return {name for name, m in net.named_modules() if hasattr(m, "to_quantized")}


def _float(dtype: mx.Dtype) -> bool:
    return dtype in (mx.float32, mx.float16, mx.bfloat16)


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def _more(items: list, n: int = 5) -> str:
    return f" (+{len(items) - n} more)" if len(items) > n else ""


def plan_bindings(
    net: Bindable,
    cfg: Any,
    manifest: Manifest,
    folder: Path,
    *,
    strict: bool = True,
    layouts: dict[str, tuple[int, ...]] | None = None,
    held: Callable[[str], bool] | None = None,
    quantizer: Quantizer | None = None,
    cut: Callable[[str], Cut | None] | None = None,
) -> BindingPlan:
    """Validate `manifest` against the model and the sources' headers (reads headers only);
    quantize the modules whose scales are bound (mutates `net`, `quantizer` building them, None:
    MLX's); return the plan. `layouts`: parameter name suffix -> the axes of a transpose at load
    (another converter's layout, e.g. mlx-lm's conv1d). `held(param)`: a pipeline rank's share
    (`net` holds only it); the other ranks' parameters' tensors are neither bound nor reported.
    `cut(param)`: the slice of it a tensor rank reads (`net` is built for the slices)."""
    folder = Path(folder)
    where = manifest.origin or str(folder)  # what errors about the mapping name
    sources = {spec.name: _open_source(spec, manifest, folder) for spec in manifest.sources}
    default = sources[manifest.default_source]
    explicit = _expand(manifest, cfg.num_hidden_layers)
    elsewhere: set[tuple[str, str]] = set()  # (source, key) another pipeline rank reads
    if held is not None:
        elsewhere = {v for p, v in explicit.items() if not held(p)}
        explicit = {p: v for p, v in explicit.items() if held(p)}
    # by-name lookups go through the family's own renames (net.sanitize, e.g. the prefixes of
    # multimodal Gemma 3 checkpoints), applied to the names only; what it drops is ignored
    by_name: dict[str, str] = {k: k for k in default.tensors}
    by_name = {k: v for k, v in net.sanitize(by_name).items() if v in default.tensors}
    dropped = set(default.tensors) - set(by_name.values())
    if held is not None:
        elsewhere |= {(default.name, v) for k, v in by_name.items() if not held(k)}
        by_name = {k: v for k, v in by_name.items() if held(k)}

    # quantized modules: those whose `.scales` is bound, by the manifest, by name or (MXFP4
    # experts) by a Hugging Face layout of the family's
    quantizable = _quantizable(net)
    stacks = net.expert_stacks()
    scaled: dict[str, None] = {}  # the `.scales` parameters bound, in order
    for m in sorted(quantizable):
        p = f"{m}.scales"
        if (p in explicit and explicit[p][1] in sources[explicit[p][0]].tensors) or (
            p not in explicit
            and (p in by_name or (p in stacks and _has_layout(stacks[p], by_name, default)))
        ):
            scaled[p] = None
    if scaled:
        try:
            quantize_like(net, scaled, cfg.quantization, folder / "config.json", quantizer)
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError, ArithmeticError, RuntimeError) as e:
            raise ConfigError(
                f"cannot quantize as the checkpoint's quantization block says: {e}",
                path=folder / "config.json",
                field="quantization",
            ) from None
    modules = dict(net.named_modules())
    quantized = sorted(m for m in quantizable if "scales" in modules.get(m, {}))
    expected = dict(tree_flatten(net.parameters()))

    # parameters the model does not have
    unknown = [p for p in explicit if p not in expected]
    if unknown:
        p = unknown[0]
        module, _, part = p.rpartition(".")
        if part in ("scales", "biases") and module in quantizable and module not in quantized:
            raise QuantTripletError(
                f"{p} is bound but {module}.scales is not (or its tensor "
                f"{explicit.get(module + '.scales', ('', module + '.scales'))[1]!r} is "
                "absent): a quantized weight needs weight, scales and biases bound together",
                path=where,
                field=p,
            )
        if cfg.tie_word_embeddings and p.startswith("lm_head."):
            hint = " (the model ties lm_head to model.embed_tokens: tie_word_embeddings)"
        else:
            close = difflib.get_close_matches(p, list(expected), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownParameterError(
            f"the model ({cfg.family}) has no such parameter{hint}; {len(unknown)} unknown in all",
            path=where,
            field=p,
        )

    # resolve every parameter: the manifest's binding, else the tensor of the same name, else
    # (stacked experts) the Hugging Face layouts: per-expert tensors (any shards), or fused
    bindings: dict[str, Binding] = {}
    missing: list[tuple[str, str, str, bool]] = []
    for p in expected:
        source, key = explicit.get(p) or (default.name, by_name.get(p, p))
        src = sources[source]
        hit = src.tensors.get(key)
        if hit is None and p not in explicit and p in stacks:
            found = _expert_binding(p, stacks[p], by_name, default, where)
            if found is not None:
                bindings[p] = found
                continue
        if hit is None:
            missing.append((p, source, key, p in explicit))
        else:
            bindings[p] = Binding(p, source, key, hit[0], p in explicit)
    if missing:
        missing_params = {m[0] for m in missing}
        for module in quantized:
            parts = [f"{module}.{s}" for s in _QUANT_PARTS if f"{module}.{s}" in expected]
            absent = [q for q in parts if q in missing_params]
            if absent and len(absent) < len(parts):
                q = absent[0]
                source, key = explicit.get(q) or (default.name, by_name.get(q, q))
                raise QuantTripletError(
                    f"quantized {module}: expected tensor {key!r} in source {source!r} for "
                    f"{q}, found none ({', '.join(parts)} must be bound together)",
                    path=where,
                    field=q,
                )
        p, source, key, named = missing[0]
        how = "bound by the manifest" if named else "not in the manifest, so bound by name"
        listing = ", ".join(m[0] for m in missing[:5]) + _more(missing)
        raise BindingMissingError(
            f"missing tensors: {listing}; first: expected tensor {key!r} in source {source!r} "
            f"({_files(sources[source])}; {how}), found none",
            path=where,
            field=p,
        )

    # one tensor, one parameter (the embedding and the head may share one)
    users: dict[tuple[Path, str], list[str]] = defaultdict(list)
    for b in bindings.values():
        for file, key in zip(b.part_files or (b.file,), b.parts or (b.key,), strict=True):
            users[(file, key if b.half is None else f"{key}[half {b.half}]")].append(b.param)
    for (file, key), params in users.items():
        if len(params) > 1 and not _tied_pair(params):
            raise DuplicateBindingError(
                f"tensor {key!r} ({file.name}) is bound to {' and '.join(params)}; a tensor "
                "feeds one parameter (only model.embed_tokens and lm_head may share one)",
                path=where,
                field=params[1],
            )

    # dtype, rank, dimensions
    relaid: list[str] = []
    cuts: dict[str, Cut] = {}
    for p, ref in expected.items():
        b = bindings[p]
        entry = sources[b.source].tensors[b.key][1]
        st = entry["dtype"]
        dt = ST_DTYPES.get(st)
        shape = tuple(entry["shape"])
        if cut is not None and (c := cut(p)) is not None:  # a tensor rank's slice
            shape = _cut_shape(b, shape, c, where)
            cuts[p] = c
        if b.parts and b.joined:  # row shards: their rows add up
            shape = _joined_shape(b, sources[b.source], where)
        elif b.parts:  # each expert's tensor: the parameter's shape without the expert axis
            if p not in cuts:
                _check_parts(b, sources[b.source], ref, where)
            shape = (len(b.parts), *shape)
        elif b.half is not None and len(shape) > b.half_axis and shape[b.half_axis] % 2 == 0:
            shape = tuple(n // 2 if i == b.half_axis else n for i, n in enumerate(shape))
        if b.blocks and len(shape) > 2 and shape[-1] == 16 and st == "U8":
            shape, st, dt = (*shape[:-2], shape[-2] * 4), "U32", mx.uint32
        if b.axes is not None and len(shape) == len(b.axes):  # a layout of its own (Llama 4)
            shape = tuple(shape[i] for i in b.axes)
        module, _, part = p.rpartition(".")
        if _float(ref.dtype):
            ok = dt is not None and _float(dt)
            want = "a float tensor (F32, F16 or BF16)"
        else:
            ok = dt == ref.dtype
            packed = " (a packed quantized weight)" if ref.dtype == mx.uint32 else ""
            want = f"{_dtype_name(ref.dtype)}{packed}"
        if not ok:
            hint = ""
            if part == "weight" and module in quantizable and module not in quantized:
                hint = f"; a packed quantized weight needs {module}.scales and biases bound too"
            raise BindingDtypeError(
                f"tensor {b.key!r} in {b.file.name} is {st}, expected {want}{hint}",
                path=where,
                field=p,
            )
        want_shape = tuple(ref.shape)
        axes = next((a for sfx, a in (layouts or {}).items() if p.endswith(sfx)), None)
        if (
            axes
            and shape != want_shape
            and len(shape) == len(axes)
            and tuple(shape[i] for i in axes) == want_shape
        ):
            bindings[p] = b = replace(b, axes=axes)
            relaid.append(p)
            shape = want_shape
        if len(shape) != len(want_shape):
            raise BindingShapeError(
                f"tensor {b.key!r} in {b.file.name} has rank {len(shape)} (shape {shape}), "
                f"expected rank {len(want_shape)} (shape {want_shape})",
                path=where,
                field=p,
            )
        if shape != want_shape:
            raise BindingShapeError(
                f"tensor {b.key!r} in {b.file.name} has shape {shape}, model expects {want_shape}",
                path=where,
                field=p,
            )

    # tensors no parameter takes
    taken = {(f, k.split("[half ")[0]) for f, k in users}  # a fused tensor bound by halves
    by_name_of = {raw: name for name, raw in by_name.items()}
    unbound = []
    for src in sources.values():
        for key, (file, _) in src.tensors.items():
            if (file, key) in taken or key.endswith("rotary_emb.inv_freq"):
                continue
            if src is default and key in dropped:
                continue  # dropped on purpose by the family (e.g. a vision tower)
            if (src.name, key) in elsewhere:
                continue  # another pipeline rank's share
            if cfg.tie_word_embeddings and by_name_of.get(key, key).startswith("lm_head."):
                continue  # some tied checkpoints still carry a copy of the head
            unbound.append((src.name, key))
    unbound = sorted(set(unbound))
    if unbound:
        listing = ", ".join(f"{k} ({s})" for s, k in unbound[:5]) + _more(unbound)
        if strict:
            raise UnexpectedBindingError(
                f"unexpected tensors (bound to no parameter; lenient mode ignores them): {listing}",
                path=where,
                field=unbound[0][1],
            )
        warnings.warn(
            UnboundTensorsWarning(
                f"{where}: {len(unbound)} tensors bound to no parameter, ignored: {listing}",
                unbound,
            ),
            stacklevel=3,
        )
    entries = {
        (f, k): sources[b.source].tensors[k][1]
        for p, b in bindings.items()
        if p in cuts
        for f, k in zip(b.part_files or (b.file,), b.parts or (b.key,), strict=True)
    }
    origin = manifest.origin
    return BindingPlan(bindings, unbound, quantized, origin, relaid, sorted(dropped), cuts, entries)


def _cut_shape(b: Binding, shape: tuple[int, ...], c: Cut, where: str) -> tuple[int, ...]:
    """The shape of the slice `c` of a bound tensor of `shape` (per expert when stacked);
    an UnsupportedError for a binding whose tensor is reshaped at load (halves, transposes,
    joined shards, MXFP4 blocks): those are not split across tensor ranks."""
    if b.half is not None or b.axes is not None or b.blocks or b.joined or not shape:
        raise UnsupportedError(
            f"tensor {b.key!r} is reshaped at load, and is not split across tensor ranks",
            path=where,
            field=b.param,
        )
    ax = c.axis % len(shape)
    taken = c.stored(shape[ax], b.param, where)
    return (*shape[:ax], len(taken), *shape[ax + 1 :])


def _expert_binding(
    p: str, lay, by_name: dict[str, str], src: _Source, where: str
) -> Binding | None:
    """A stacked expert parameter bound by a Hugging Face layout (`lay`, an ExpertSource):
    every per-expert tensor, else the fused tensor; None when neither is there. Some experts
    present and others not is an error naming the first missing one."""
    if isinstance(lay, tuple):  # alternatives, in order
        for one in lay:
            found = _expert_binding(p, one, by_name, src, where)
            if found is not None:
                return found
        return None
    parts = tuple(by_name.get(k, k) for k in lay.parts)
    hits = [src.tensors.get(k) for k in parts]
    if parts and all(hits):
        files = tuple(h[0] for h in hits)
        return Binding(p, src.name, parts[0], files[0], False, parts, files, joined=lay.joined)
    fused = by_name.get(lay.fused, lay.fused)
    if fused in src.tensors:
        return Binding(
            p,
            src.name,
            fused,
            src.tensors[fused][0],
            False,
            half=lay.half,
            half_axis=lay.axis,
            axes=lay.axes,
            strided=lay.strided,
            blocks=lay.blocks,
        )
    if any(hits):
        gone = next(k for k, h in zip(parts, hits, strict=True) if h is None)
        raise BindingMissingError(
            f"expert tensor {gone!r} missing ({sum(h is None for h in hits)} of {len(parts)} "
            f"experts absent; {_files(src)}): every expert of {p} is needed",
            path=where,
            field=p,
        )
    return None


def _has_layout(lay, by_name: dict[str, str], src: _Source) -> bool:
    """Some layout of `lay` (an ExpertSource or alternatives) is in the checkpoint."""
    lays = lay if isinstance(lay, tuple) else (lay,)
    return any(by_name.get(one.fused, one.fused) in src.tensors for one in lays)


def _check_parts(b: Binding, src: _Source, ref: mx.array, where: str) -> None:
    """Every per-expert tensor of a stacked binding has the same dtype and the shape of one
    expert's slice of the parameter."""
    first = src.tensors[b.key][1]
    for key in b.parts:
        entry = src.tensors[key][1]
        if entry["dtype"] != first["dtype"] or tuple(entry["shape"]) != tuple(ref.shape[1:]):
            raise BindingShapeError(
                f"expert tensor {key!r} in {src.tensors[key][0].name} is {entry['dtype']} "
                f"{tuple(entry['shape'])}, expected {first['dtype']} {tuple(ref.shape[1:])} "
                f"(one expert of {b.param}, shape {tuple(ref.shape)})",
                path=where,
                field=b.param,
            )


def _joined_shape(b: Binding, src: _Source, where: str) -> tuple[int, ...]:
    """The shape row shards make concatenated; each must be of the first one's dtype and row
    width."""
    first = src.tensors[b.key][1]
    rows = 0
    for key in b.parts:
        entry = src.tensors[key][1]
        if entry["dtype"] != first["dtype"] or tuple(entry["shape"][1:]) != tuple(
            first["shape"][1:]
        ):
            raise BindingShapeError(
                f"shard {key!r} in {src.tensors[key][0].name} is {entry['dtype']} "
                f"{tuple(entry['shape'])}, expected {first['dtype']} rows of "
                f"{tuple(first['shape'][1:])} (a shard of {b.param})",
                path=where,
                field=b.param,
            )
        rows += entry["shape"][0]
    return (rows, *tuple(first["shape"][1:]))


def _files(src: _Source) -> str:
    names = [f.name for f in src.files]
    return ", ".join(names[:3]) + _more(names, 3)


def _tied_pair(params: list[str]) -> bool:
    if len(params) != 2:
        return False
    a, b = sorted(params, key=lambda p: not p.startswith(_TIED[0]))
    return (
        a.startswith(_TIED[0])
        and b.startswith(_TIED[1])
        and (a[len(_TIED[0]) :] == b[len(_TIED[1]) :])
    )
