"""Load a GGUF file: metadata -> config, tensors -> module names, conventions undone,
quantized blocks -> MLX affine arrays (or dense), one tensor at a time.

Memory: each tensor is converted straight into its final MLX buffer and the
file pages it was read from are dropped from the process right after, so the load peak stays
near the loaded weights (the mmap would otherwise add the whole file to the resident set).
The tokenizer is built on a second thread while the weights convert (it needs only metadata).
Which tensors stay quantized by default depends on the device: see `dense_by_default`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlxlis.errors import UnexpectedTensorError, UnsupportedError
from mlxlis.loading.binding import bind, float32_names, kept_narrow, quantize_like
from mlxlis.loading.gguf import GGUFFile
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.loading.quants import QUANTIZABLE, allocate, convert_tensor
from mlxlis.loading.slices import Cut, cut_gguf, cut_gguf_bytes
from mlxlis.models import PROJECTORS, build_model, family
from mlxlis.models.config import ModelConfig
from mlxlis.models.gguf_config import config_from_gguf
from mlxlis.models.mmproj import beside, load_mmproj
from mlxlis.models.model import Model
from mlxlis.models.multimodal import CachedVision
from mlxlis.models.placement import Placement
from mlxlis.models.quantized import Kernels
from mlxlis.prompt.template import diagnose_missing_template, discover_template
from mlxlis.runtime import device, kernels
from mlxlis.runtime.memory import available_memory
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx

# dequantize=None, the per-device default. Measured on the three catalog models (2-core x86 VM
# shared with other jobs, OpenBLAS, fp32, greedy; prompt tok/s over 100 tokens / decode tok/s
# over 64; best of 2; `scripts/load_profile.py NAME [--quantized|--dequantize] --decode`):
#                              quantized     dense          weights q / dense
#   SmolLM2-135M Q4_1          12 / 6.8      172-259 / 6.6-8.3   115 MB / 538 MB
#   Gemma 3 270M Q4_K_M        14 / 3.3      215-233 / 4.5-5.4   332 MB / 1.07 GB
#   Qwen2.5-Coder-0.5B Q4_K_M  3.8 / 2.0     120-126 / 4.6       760 MB / 2.1 GB (*)
# (*) embedding kept quantized. MLX's CPU quantized matmul has no BLAS path: prompt processing
# is 15-30x slower than dense fp32, and decoding is no faster (up to 2.3x slower). So on CPU,
# without mlxlis's own kernels (runtime/kernels: not built), every matmul weight goes dense when
# the dense weights fit comfortably; an untied embedding (a row lookup, never a matmul) stays
# quantized. With them, the blocks stay quantized (MoE experts aside: the kernels do not cover
# gather_qmm) — see scripts/bench_qmv.py for the figures. On Metal and CUDA the quantized
# kernels are the fast path, so quantized. dequantize=True / False force either way.
SPECIAL = {"rope_freqs.weight"}  # GGUF tensors that are not parameters (read by the loader)
CPU_DENSE_FRACTION = 0.5  # dense on CPU while the dense weights need ≤ this much of free memory
PREFETCH_BYTES = 256 << 20  # output buffers allocated ahead of the conversion


def dense_by_default(dense_bytes: int, on: mx.Device | None = None) -> bool:
    """dequantize=None: dense on CPU when `dense_bytes` fit comfortably, quantized elsewhere
    (`on`: the device the products will run on, default the current stream's; on a GPU the
    blocks stay in MLX's quantized layout for `mx.quantized_matmul`, the sub-blocks of 16
    that it cannot take dense in the compute dtype)."""
    return device.on_cpu(on) and dense_bytes <= CPU_DENSE_FRACTION * available_memory()


class _Clock:
    """Accumulates wall seconds per stage into `timings` (a no-op when it is None)."""

    def __init__(self, timings: dict[str, float] | None):
        self.timings, self.last = timings, time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[stage] = self.timings.get(stage, 0.0) + now - self.last
        self.last = now


def load_gguf(
    path: Path,
    dtype: mx.Dtype,
    *,
    dequantize: bool | None = None,
    chat_template: str | None = None,
    timings: dict[str, float] | None = None,
    placement: Placement | None = None,
    mmproj: Path | str | bool | None = None,
) -> Model:
    """Load a GGUF model. dequantize: True = every weight dense, False = quantized blocks kept,
    None = the per-device default (see CPU_DENSE_FRACTION); `timings`, when given, receives
    wall seconds per stage (scripts/load_profile.py). Under a `placement` (a pipeline, under a
    launcher) this rank's share of the layers is all that is read and built. `mmproj`: the
    vision tower's file (llama.cpp's mmproj GGUF); None: one found beside the model, for a
    family that sees (mmproj.beside); False: none."""
    clock = _Clock(timings)
    with read_gguf(path) as gf, ThreadPoolExecutor(1, "mlxlis-tokenizer") as side:
        md = gf.metadata
        shapes = {name: t.shape for name, t in gf.tensors.items()}
        cfg = config_from_gguf(md, shapes, str(path))
        clock("read")
        tokenizer = side.submit(_tokenizer, md, path, timings)
        part = None
        encoder = family(cfg.family).kind == "encoder"  # loaded whole on every rank
        if placement is not None and not encoder:
            part = placement.place(cfg, module_sizes(gf, cfg), str(path))
        held = part.holds if part is not None else None
        dense, sub_blocks = _dense_policy(gf, cfg, dtype, dequantize, part)
        spec = family(cfg.family)
        # the tensors that are config first: the network is built from them, and its
        # Float32Parameters say which weights convert to float32
        specials = _specials(gf, spec.gguf.config_tensors)
        rope_freqs = specials.pop("rope_freqs.weight", None)
        if spec.gguf.tensor_config is not None:
            cfg = spec.gguf.tensor_config(cfg, specials)
        if rope_freqs is not None and spec.gguf.rope_freqs is not None:
            cfg, rope_freqs = spec.gguf.rope_freqs(cfg, rope_freqs)
        extras = {} if rope_freqs is None else {"rope_freq_factors": rope_freqs}
        own = cfg  # the network this rank builds: a tensor rank's heads and rows only
        if part is not None:
            extras.update(layers=part.layers, embeds=part.first, heads=part.last)
            own = part.local(cfg)
        net = build_model(own, **extras)
        cut = part.cut if part is not None else None
        weights, quant, ignored = _convert(
            gf, own, dtype, dense, clock, held, sub_blocks, float32_names(net), cut
        )
        if quant:
            quantize_like(net, weights, quant, quantizer=Kernels(dtype))  # mlxlis's CPU kernels
        bind(net, weights, path, dtype)
        clock("bind")
        tok = tokenizer.result()
        clock("tokenizer (wait)")
        if encoder:  # embeds or reranks (from_encoder.py)
            from mlxlis.models.from_encoder import load_encoder_gguf

            summary = _summary(gf, dense, quant)
            return load_encoder_gguf(path, cfg, net, tok, md, dtype, quant_summary=summary)
    vision = None
    # of tensor ranks rank 0 holds the tower (Share.sees); a pipeline's ranks read text only
    tower_here = part is None or (part.sees and part.rank == 0)
    if mmproj is not False and tower_here and cfg.family in PROJECTORS:
        kind = PROJECTORS[cfg.family].kind
        proj = beside(path, cfg, kind) if mmproj in (None, True) else Path(mmproj)
        if proj is not None:
            vision = CachedVision(load_mmproj(proj, cfg, tok, md, dtype, PROJECTORS))
            clock("vision")
    elif mmproj not in (None, False, True) and (cfg.family not in PROJECTORS or not part.sees):
        raise UnsupportedError(  # (a tensor rank other than 0 leaves the tower to rank 0)
            f"a {cfg.family} model takes no images"
            if cfg.family not in PROJECTORS
            else "images with a model pipelined across ranks are not supported",
            path=mmproj,
            field="mmproj",
        )
    template = _template(chat_template, md, path)
    diagnosis = None if template is not None else _diagnose(path, md)
    clock("template")
    return Model(
        cfg,
        net if part is None else placement.wrap(net, part, dtype),
        tok,
        dtype=dtype,
        path=path,
        fmt="gguf",
        template=template,
        quant_summary=_summary(gf, dense, quant),
        diagnosis=diagnosis,
        skipped=sorted(ignored),
        part=part,
        vision=vision,
        sees=family(cfg.family).vision is not None,
    )


def _summary(gf: GGUFFile, dense: Callable[[str], bool], quant: dict) -> str:
    """The file's tensor types and what stayed quantized, for `inspect`."""
    types: dict[str, int] = {}
    for t in gf.tensors.values():
        types[t.type_name] = types.get(t.type_name, 0) + 1
    summary = ", ".join(f"{k}×{v}" for k, v in sorted(types.items()))
    kept = f"{len(quant)} quantized modules" if quant else "dense"
    if quant and any(dense(n) for n in gf.tensors if _quantizable(gf.tensors[n])):
        kept += ", the rest dense"
    return f"{summary} ({kept})"


def _quantizable(t) -> bool:
    return t.type_name in QUANTIZABLE and len(t.shape) > 1


# the projections whose K-quant blocks the CPU kernels take as stored (quant_blocks.Super;
# Q6_K's in groups of 16): linear layers only
# (MLX's own ops, which an embedding lookup or the experts' gather_qmm use, take no group 16)
SUB_BLOCK_TENSOR = re.compile(
    r"^(?:blk\.\d+\.(?:attn_(?:q|k|v|qkv|output)|ffn_(?:gate|up|down)(?:_shexp)?)|output)\.weight$"
)


def _dense_policy(
    gf: GGUFFile, cfg: ModelConfig, dtype: mx.Dtype, dequantize: bool | None, part=None
) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
    """GGUF tensor name -> convert it dense? (only quantized-form tensors are affected), and
    -> hold its K-quant blocks as stored (Q4_K / Q5_K / Q6_K: integer scales and a float16
    pair per 256 weights, Q6_K in groups of 16; the CPU kernels' default, in float32)?
    `part`: a pipeline rank's share, whose tensors alone count."""
    never = lambda name: False  # noqa: E731
    if dequantize is not None:
        return (lambda name: dequantize), never
    # a pipeline rank that embeds but does not head uses a tied embedding as a lookup only
    tied_head = cfg.tie_word_embeddings and (part is None or part.last)
    # row lookups, never matmuls: an untied embedding, Gemma 4's per-layer embedding table
    lookup = {
        n
        for n in gf.tensors
        if n.endswith("token_embd.weight") and (n != "token_embd.weight" or not tied_head)
    }
    family_ = family(cfg.family)
    held = {n for n in gf.tensors if part is None or part.holds(family_.gguf.module_name(n) or "")}
    dense_bytes = sum(
        math.prod(t.shape) * dtype.size
        for n, t in gf.tensors.items()
        if _quantizable(t) and n not in lookup and n in held
    )
    if not dense_by_default(dense_bytes):
        return never, never
    if kernels.load() is not None:  # the CPU kernels read the blocks as stored; MoE experts
        # (gather_qmm, which the kernels do not cover) stay dense
        sub = (lambda n: SUB_BLOCK_TENSOR.match(n) is not None) if dtype == mx.float32 else never
        return (lambda name: "_exps." in name), sub
    return (lambda name: name not in lookup), never


def module_sizes(gf: GGUFFile, cfg: ModelConfig) -> dict[str, int]:
    """Module tensor name -> its bytes in the file, for the tensors the model uses."""
    spec = family(cfg.family)
    sizes = {}
    for name, t in gf.tensors.items():
        if name in SPECIAL or (spec.gguf.ignored and spec.gguf.ignored(name, cfg)):
            continue
        target = spec.gguf.module_name(name)
        if target is not None:
            sizes[target] = t.nbytes
    return sizes


def _convert(
    gf: GGUFFile,
    cfg: ModelConfig,
    dtype: mx.Dtype,
    dense,
    clock: _Clock,
    held=None,
    sub=None,
    wide: frozenset[str] | set[str] = frozenset(),
    cut: Callable[[str], Cut | None] | None = None,
):
    """Every tensor under its module name, conventions undone: (weights, quant, names of the
    tensors the family ignores); the tensors that are config are _specials'.
    cut(module name): the slice of it this rank reads (a tensor rank's; slices.py), None whole.
    dense(name): convert that tensor dense (else quantized where MLX can hold it).
    sub(name): hold a K-quant tensor as stored (the CPU kernels' layout; None: never).
    held(module name): whether this pipeline rank reads it (None: every tensor); the others
    are never read. wide: the parameters kept in float32 (binding.Float32Parameters)."""
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict] = {}
    path = str(gf.path)
    spec = family(cfg.family)
    special = SPECIAL | set(spec.gguf.config_tensors)
    ignored = {n for n in gf.tensors if spec.gguf.ignored and spec.gguf.ignored(n, cfg)}
    targets = {}
    for name in gf.tensors:
        if name in ignored:
            continue
        targets[name] = None if name in special else spec.gguf.module_name(name)
        if targets[name] is None and name not in special:
            raise UnexpectedTensorError(
                f"no {cfg.family} module takes this tensor", path=gf.path, field=name
            )
    if held is not None:  # another rank's tensors: neither converted nor reported as skipped
        targets = {n: t for n, t in targets.items() if t is None or held(t)}
    # The final buffers are allocated and zero-filled on MLX's own thread while earlier tensors
    # convert: mx.async_eval keeps up to PREFETCH_BYTES of them ahead (a few tensors at a time:
    # a long list blocks on MLX's cap on in-flight tasks). They are the loaded weights, so this
    # costs no extra memory.
    names = [n for n in gf.tensors if n in targets]
    cuts = {n: c for n, m in targets.items() if m and cut and (c := cut(m)) is not None}
    tensors = {n: cut_gguf(t, cuts[n], path) if n in cuts else t for n, t in gf.tensors.items()}
    buffers = {
        name: allocate(t, dequantize=dense(name), sub_blocks=bool(sub and sub(name)))
        for name, t in tensors.items()
        if name not in special and name in targets
    }
    ahead, started = 0, 0  # bytes started and not yet converted; tensors started
    for i, name in enumerate(names):
        t = tensors[name]
        ahead -= sum(a.nbytes for a in buffers.get(name, ()))
        while started < len(names) and (started <= i or ahead < PREFETCH_BYTES):
            out = buffers.get(names[started], ())
            if out:
                mx.async_eval(out)
                ahead += sum(a.nbytes for a in out)
            started += 1
        if name in special:  # read by _specials
            continue
        target = targets[name]
        # 1-D tensors (norms, biases) convert in fp32 so `w - 1` happens before rounding
        conv_dtype = mx.float32 if len(t.shape) == 1 or target in wide else dtype
        raw, done = gf.raw(name), lambda i, j, name=name: gf.release(name, i, j)
        if name in cuts:  # this rank's slice only, its pages released once copied
            raw, done = cut_gguf_bytes(gf.tensors[name], raw, cuts[name], path), None
            gf.release(name)
        conv = convert_tensor(
            t,
            raw,
            conv_dtype,
            dequantize=dense(name),
            path=path,
            out=buffers.pop(name, ()),
            done=done,
            sub_blocks=bool(sub and sub(name)),
        )
        del raw
        gf.release(name)  # the file pages of this tensor are no longer needed
        module = target.rsplit(".", 1)[0]
        parts = conv.parts(target.rsplit(".", 1)[1])
        stacked = spec.gguf.stacked.get(name)  # one module per index on axis 0
        modules = [module]
        if stacked:  # t.shape is numpy's order: the stack's axis first
            modules = [stacked.format(k).rsplit(".", 1)[0] for k in range(t.shape[0])]
        if conv.quantized:
            quant.update({m: conv.quant_block() for m in modules})
        del conv
        for part, arr in parts.items():
            new = spec.undo(target, arr, cfg, part)
            want = mx.float32 if f"{module}.{part}" in wide else dtype
            if new.dtype in (mx.float32, mx.float16, mx.bfloat16) and new.dtype != want:
                if not kept_narrow(f"{module}.{part}", new.dtype, want):
                    new = new.astype(want)
            if new is not arr:
                mx.eval(new)  # materialise now so the converted original can go
            if stacked:
                weights.update({f"{m}.{part}": new[k] for k, m in enumerate(modules)})
            else:
                weights[f"{module}.{part}"] = new
        del parts, arr, new
        clock(f"convert {t.type_name}")
    return weights, quant, ignored


def _specials(gf, config_tensors) -> dict[str, mx.array]:
    """The tensors that are config, not parameters (rope_freqs, the family's
    gguf.config_tensors), by name, as float32 vectors."""
    out = {}
    for name in (SPECIAL | set(config_tensors)) & set(gf.tensors):
        t = gf.tensors[name]
        out[name] = convert_tensor(
            t, gf.raw(name), mx.float32, dequantize=True, path=str(gf.path)
        ).weight.reshape(-1)
        gf.release(name)
    return out


def _tokenizer(md: dict, path: Path, timings: dict[str, float] | None):
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(md, path)
    if timings is not None:
        timings["tokenizer (own thread)"] = time.perf_counter() - start
    return tok


def _template(explicit: str | None, md: dict, path: Path):
    return discover_template(explicit=explicit, gguf_metadata=md, gguf_path=path)


def _diagnose(path: Path, md: dict) -> str:
    return diagnose_missing_template(model_name=path.name, folder=None, gguf_metadata=md)
