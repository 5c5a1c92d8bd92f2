"""GGUF tensor blocks → MLX arrays: affine-quantized where MLX can hold them exactly, else dense.

MLX affine quantization stores w = scale·q + bias per group of 32 along a row, with the codes
of a row as one little-endian bit stream in uint32 words (code j at bit j·bits). The
32-element (sub-)blocks of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K map onto that form exactly:

    Q4_0 / Q5_0 / Q8_0  d·(q − 8 / 16 / 0)   scale d,     bias −8d / −16d / −128d (codes q+128)
    Q4_1 / Q5_1         d·q + m              scale d,     bias m
    Q4_K / Q5_K         d·sc·q − dmin·m      scale d·sc,  bias −dmin·m   (per 32-sub-block)

Scales and biases are computed in float32 (d·sc has ≤ 17 significant bits, so it is exact
there) and then cast to the compute dtype. Where mlxlis's CPU kernels run the products
(`sub_blocks`), Q4_K / Q5_K / Q6_K are held as stored instead (quant_blocks.Super: each
group's integer scale and min, each 256 weights' float16 d and dmin; the kernels form the same
d·sc and −dmin·m), at the file's size. MXFP4 (gpt-oss's experts: 32 e2m1 codes and one
E8M0 exponent a block) is MLX's "mxfp4" mode with the codes reordered (ggml keeps codes j and
j + 16 in byte j; MLX codes 2b and 2b + 1 in byte b) and the exponent as the scale, bit for
bit. Everything else becomes a dense array.

How it is fast (load time is dominated by this): the block kernels in quant_blocks.py repack
codes with whole-word bit operations; here their results are written straight into the final
MLX buffers (no per-chunk arrays, no concatenation), in chunks small enough to stay in cache,
and the chunks of a large tensor are shared among all cores but one, which MLX's own thread
uses meanwhile to allocate the next buffers (numpy releases the GIL in its loops). Dense
output of the affine types is scale·q + bias computed by numpy in float32: the same bits as
`mx.dequantize`, which on CPU takes ~50 ns per weight.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mlxlis.errors import FileFormatError, UnsupportedQuantError
from mlxlis.loading.gguf import GGML_TYPES, GGUFTensor
from mlxlis.loading.quant_blocks import AFFINE, DENSE, SUPER, Super, affine_dense

import mlx.core as mx
import numpy as np

GROUP = 32
CHUNK_ELEMENTS = 1 << 17  # weights per conversion chunk: keeps the temporaries in cache
AFFINE_HELD: frozenset[str] = frozenset(AFFINE)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K
QUANTIZABLE: frozenset[str] = AFFINE_HELD | {"MXFP4"}  # types MLX holds quantized
SUPER_HELD: frozenset[str] = frozenset(SUPER)  # Q4_K Q5_K Q6_K as stored, for the kernels


@dataclass
class Converted:
    weight: mx.array  # packed uint32 codes (quantized) or dense array in `dtype`
    scales: mx.array | None = None  # (rows, cols // group) in `dtype` (super-block: integers)
    biases: mx.array | None = None
    bits: int | None = None
    group_size: int | None = None
    mode: str = "affine"
    # a super-block format (quant_blocks.Super): (rows, cols // 256, 2) float16 d, dmin
    super_scales: mx.array | None = None

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def parts(self, part: str) -> dict[str, mx.array]:
        """The arrays a module takes: weight, scales (and affine biases) when quantized, else
        the dense array as its `part`."""
        if self.scales is None:
            return {part: self.weight}
        out = {"weight": self.weight, "scales": self.scales}
        if self.biases is not None:  # mxfp4 has none
            out["biases"] = self.biases
        if self.super_scales is not None:
            out["super_scales"] = self.super_scales
        return out

    def quant_block(self) -> dict[str, Any]:
        """The module's entry in a quantization block (quantize_like's)."""
        block = {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}
        return block | ({"super": True} if self.super_scales is not None else {})


def convert_tensor(
    t: GGUFTensor,
    raw: np.ndarray,
    dtype: mx.Dtype,
    *,
    dequantize: bool = False,
    path: str = "",
    out: tuple[mx.array, ...] = (),
    done: Callable[[int, int], None] | None = None,
    sub_blocks: bool = False,
) -> Converted:
    """Convert one GGUF tensor (its raw bytes) to MLX: quantized (see module doc) or dense.

    `sub_blocks`: a SUPER_HELD type (Q4_K, Q5_K, Q6_K) held as stored (quant_blocks.Super),
    a layout only mlxlis's CPU kernels multiply (runtime/kernels; MLX's own products take float
    scales in groups of 32 and more).
    `out`: the buffers from `allocate(t, dequantize=..., sub_blocks=...)`, when the caller made
    them early.
    `done(start, stop)`: told, from any thread, when raw[start:stop] has been converted.
    """
    if t.ggml_type not in GGML_TYPES:
        raise UnsupportedQuantError(f"unknown ggml type id {t.ggml_type}", path=path, field=t.name)
    if raw.dtype != np.uint8 or raw.size != t.nbytes:
        raise FileFormatError(
            f"expected {t.nbytes} raw bytes, got {raw.size}", path=path, field=t.name
        )
    if t.type_name == "MXFP4" and not dequantize and len(t.shape) > 1:
        return _mxfp4(t, raw)
    if _as_super(t, dequantize, sub_blocks):
        return _super(t, raw, out, done)
    if t.type_name in AFFINE_HELD:
        if dequantize or len(t.shape) < 2:  # dense: scale·q + bias in float32, as MLX would
            kind = AFFINE[t.type_name]
            return Converted(
                _dense_blocks(t, raw, dtype, lambda b, o: affine_dense(kind, b, o), out, done)
            )
        return _quantized(t, raw, dtype, out, done)
    return Converted(_dense(t, raw, dtype, path, out, done))


def _as_super(t: GGUFTensor, dequantize: bool, sub_blocks: bool) -> bool:
    """Held as stored (a super-block format): where the kernels' layouts are asked for
    (`sub_blocks`), 2-D, rows of whole super-blocks."""
    return (
        sub_blocks
        and not dequantize
        and t.type_name in SUPER_HELD
        and len(t.shape) == 2
        and t.shape[-1] % 256 == 0
    )


def allocate(
    t: GGUFTensor, *, dequantize: bool = False, sub_blocks: bool = False
) -> tuple[mx.array, ...]:
    """The output buffers `convert_tensor` will fill for `t`, not yet evaluated.

    A loader can create them ahead and `mx.async_eval` them, so that MLX allocates and
    zero-fills the memory on its own thread while earlier tensors convert.
    """
    name = t.type_name
    if name == "MXFP4" and not dequantize and len(t.shape) > 1:
        return ()  # repacked from the file's bytes
    if _as_super(t, dequantize, sub_blocks):
        return _super_buffers(t, SUPER[name])
    if name in AFFINE_HELD and not dequantize and len(t.shape) > 1:
        return _quantized_buffers(t)
    if name in ("F32", "F16", "BF16") or t.ggml_type not in GGML_TYPES:
        return ()  # copied from the file as they are
    return (_zeros(t.shape, mx.float32),)


_LOCAL = threading.local()  # MLX streams belong to the thread that made them


def _zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A CPU array for the host to fill (unified memory: usable on any device after), made on
    a stream of its own: a stream runs in order, so allocations queued ahead on the default one
    would hold up the loader's small evaluations behind them."""
    stream = getattr(_LOCAL, "stream", None)
    if stream is None:
        stream = _LOCAL.stream = mx.new_stream(mx.cpu)
    return mx.zeros(shape, dtype, stream=stream)


# --- output buffers and chunking ---


def _writable(a: mx.array) -> np.ndarray:
    """Materialise a fresh MLX array and return a writable numpy view of its memory.

    Documented MLX behaviour (usage/numpy: "writing to the view is reflected in the original
    array"); filling the final buffers in place saves a copy and a second allocation of every
    weight. Only arrays made here by `mx.zeros` (never shared) are written this way.
    """
    mx.eval(a)
    view = np.array(a, copy=False)
    if not (view.flags.writeable and view.flags.c_contiguous):
        raise RuntimeError("MLX did not expose a writable contiguous buffer")  # a bug, not input
    return view


def _workers() -> int:
    """Threads for the chunks of one tensor: one core is left to MLX's own thread, which
    allocates and zero-fills the next buffers meanwhile (measured on 2 cores: a second
    converter thread there made the load slower, 2.3 s vs 1.85 s for Qwen2.5)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        n = os.cpu_count() or 1
    return max(1, min(n - 1, 8))


_POOL: ThreadPoolExecutor | None = None


def _forget_pool() -> None:  # a forked child has the pool object but not its threads
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _for_chunks(
    n: int,
    step: int,
    fn: Callable[[int, int], None],
    done: Callable[[int, int], None] | None = None,
    scale: int = 1,
) -> None:
    """fn(i, j) for consecutive spans of [0, n), then done(i·scale, j·scale); the spans are
    shared among `_workers()` threads when there are several."""
    global _POOL
    if done is not None:
        work = fn

        def fn(i: int, j: int) -> None:
            work(i, j)
            done(i * scale, j * scale)

    spans = [(i, min(n, i + step)) for i in range(0, n, step)]
    workers = min(len(spans), _workers())
    if workers <= 1:
        for i, j in spans:
            fn(i, j)
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_workers(), thread_name_prefix="mlxlis-convert")

    def run(part: list[tuple[int, int]]) -> None:
        for i, j in part:
            fn(i, j)

    for f in [_POOL.submit(run, spans[k::workers]) for k in range(workers)]:
        f.result()


# --- packing, affine and dense conversion ---


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) uint8 codes -> (rows, cols·bits/32) uint32, MLX's little-endian bit stream.

    The general (slow) packer, for any bit width; the loaders' fast paths are checked against it.
    """
    rows, cols = codes.shape
    if bits == 8:
        packed = np.ascontiguousarray(codes)
    elif bits == 4:
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    else:  # 8 codes fill `bits` whole bytes; place each code's bits (uint8 shifts truncate)
        group = codes.reshape(-1, 8)
        packed = np.zeros((group.shape[0], bits), np.uint8)
        for j in range(8):  # over the 8 code positions, vectorised across all groups
            byte, shift = divmod(j * bits, 8)
            packed[:, byte] |= group[:, j] << shift
            if shift + bits > 8:
                packed[:, byte + 1] |= group[:, j] >> (8 - shift)
    return np.ascontiguousarray(packed).reshape(rows, -1).view("<u4")


def _quantized_buffers(t: GGUFTensor) -> tuple[mx.array, ...]:
    kind = AFFINE[t.type_name]
    rows, cols = math.prod(t.shape[:-1]), t.shape[-1]  # 1-D: one row
    return (
        _zeros((rows, cols * kind.bits // 32), mx.uint32),
        _zeros((rows, cols // kind.group), mx.float32),
        _zeros((rows, cols // kind.group), mx.float32),
    )


def _super_buffers(t: GGUFTensor, kind: Super) -> tuple[mx.array, ...]:
    rows, cols = t.shape
    g = cols // kind.group
    out = [_zeros((rows, cols * kind.bits // 32), mx.uint32)]
    out += [_zeros((rows, g), mx.int8 if kind.signed else mx.uint8)]
    out += [_zeros((rows, g), mx.uint8)] if kind.biases else []
    return (*out, _zeros((rows, cols // 256, 2), mx.float16))


def _super(
    t: GGUFTensor,
    raw: np.ndarray,
    out: tuple[mx.array, ...],
    done: Callable[[int, int], None] | None = None,
) -> Converted:
    """A K-quant held as stored (quant_blocks.Super): codes, sc, m, (d, dmin)."""
    _, block, type_size = GGML_TYPES[t.ggml_type]
    kind = SUPER[t.type_name]
    rows, cols = t.shape
    n_blocks = t.nbytes // type_size
    w, s, *rest = out or _super_buffers(t, kind)
    m, kd = (rest[0], rest[1]) if kind.biases else (None, rest[0])
    blocks = raw.reshape(n_blocks, type_size)
    wv, sv, kv = (_writable(a).reshape(n_blocks, -1) for a in (w, s, kd))
    sv = sv.view(np.uint8)  # int8 scales are written as their bytes
    mv = None if m is None else _writable(m).reshape(n_blocks, -1)
    kv = kv.view(np.uint16)

    def chunk(i: int, j: int) -> None:
        kind.pack(blocks[i:j], wv[i:j])
        kind.ints(blocks[i:j], sv[i:j], None if mv is None else mv[i:j])
        kind.supers(blocks[i:j], kv[i:j])

    _for_chunks(n_blocks, max(1, CHUNK_ELEMENTS // block), chunk, done, type_size)
    return Converted(
        weight=w.reshape(rows, cols * kind.bits // 32),
        scales=s,
        biases=m,
        bits=kind.bits,
        group_size=kind.group,
        super_scales=kd,
    )


def _quantized(
    t: GGUFTensor,
    raw: np.ndarray,
    dtype: mx.Dtype,
    out: tuple[mx.array, ...],
    done: Callable[[int, int], None] | None = None,
) -> Converted:
    _, block, type_size = GGML_TYPES[t.ggml_type]
    kind = AFFINE[t.type_name]
    bits, group = kind.bits, kind.group
    cols = t.shape[-1]
    n_blocks = t.nbytes // type_size
    w, s, m = out or _quantized_buffers(t)
    # every block fills its own slots of the outputs, so blocks convert independently
    blocks = raw.reshape(n_blocks, type_size)
    wv, sv, mv = (_writable(a).reshape(n_blocks, -1) for a in (w, s, m))

    def chunk(i: int, j: int) -> None:
        kind.pack(blocks[i:j], wv[i:j])
        kind.scales(blocks[i:j], sv[i:j], mv[i:j])

    _for_chunks(n_blocks, max(1, CHUNK_ELEMENTS // block), chunk, done, type_size)
    lead = t.shape[:-1]
    w = w.reshape(*lead, cols * bits // 32)
    s = s.reshape(*lead, cols // group)
    m = m.reshape(*lead, cols // group)
    if dtype != mx.float32:
        s, m = s.astype(dtype), m.astype(dtype)
        mx.eval(s, m)
    elif t.type_name in HALF_EXACT:
        s, m = _halved(s, m)
    return Converted(weight=w, scales=s, biases=m, bits=bits, group_size=group)


# block types whose scales and biases float16 holds exactly: d and m are float16 in the file,
# and −8d / −16d / −128d only change the exponent (the check below catches an overflow). Kept
# so beside float32 activations they cost 1 bit per weight instead of 2 (Q4_1: the file's own
# 5 bits), read back as the same float32 values. Q4_K / Q5_K's d·sc needs up to 17 bits.
HALF_EXACT = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})


def _halved(s: mx.array, m: mx.array) -> tuple[mx.array, mx.array]:
    """Scales and biases as float16 when every value of both survives the round trip (one
    dtype for the pair, as the products take them), else unchanged."""
    half = s.astype(mx.float16), m.astype(mx.float16)
    mx.eval(*half)
    for h, a in zip(half, (s, m), strict=True):
        # compared a chunk at a time: whole-tensor temporaries were ~1/4 of a Q8_0 embedding's
        # size (Gemma 3's: 40 MiB) on top of the weights, at the load's peak
        hv, av = np.array(h, copy=False).reshape(-1), np.array(a, copy=False).reshape(-1)
        for i in range(0, av.size, CHUNK_ELEMENTS):
            if not np.array_equal(
                hv[i : i + CHUNK_ELEMENTS].astype(np.float32), av[i : i + CHUNK_ELEMENTS]
            ):
                return s, m
    return half


def _mxfp4(t: GGUFTensor, raw: np.ndarray) -> Converted:
    """MXFP4 blocks (1 exponent byte, 16 code bytes: code j low nibble of byte j, code j + 16
    its high nibble) -> MLX mxfp4: (…, cols / 8) uint32 codes, code k at bits 4k, and the
    (…, cols / 32) uint8 exponents as scales."""
    n = t.nbytes // 17
    blocks = raw.reshape(n, 17)
    qs = blocks[:, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # (n, 32) in element order
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # (n, 16) bytes, two codes each
    lead, cols = t.shape[:-1], t.shape[-1]
    w = np.ascontiguousarray(packed).view("<u4").reshape(*lead, cols // 8)
    s = np.ascontiguousarray(blocks[:, 0]).reshape(*lead, cols // 32)
    return Converted(weight=mx.array(w), scales=mx.array(s), bits=4, group_size=32, mode="mxfp4")


def _into(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray, np.ndarray], None]:
    def run(b: np.ndarray, out: np.ndarray) -> None:
        out[...] = fn(b)

    return run


def _dense_blocks(
    t: GGUFTensor,
    raw: np.ndarray,
    dtype: mx.Dtype,
    fn: Callable[[np.ndarray, np.ndarray], None],
    out: tuple[mx.array, ...],
    done: Callable[[int, int], None] | None = None,
) -> mx.array:
    """fn(blocks (n, type_size) uint8, values (n, block) float32) writes the output in place."""
    _, block, type_size = GGML_TYPES[t.ggml_type]
    (dense,) = out or (_zeros(t.shape, mx.float32),)
    n_blocks = raw.size // type_size
    blocks, values = raw.reshape(n_blocks, type_size), _writable(dense).reshape(n_blocks, block)

    def chunk(i: int, j: int) -> None:
        fn(blocks[i:j], values[i:j])

    _for_chunks(n_blocks, max(1, CHUNK_ELEMENTS // block), chunk, done, type_size)
    if dtype != mx.float32:
        dense = dense.astype(dtype)
        mx.eval(dense)
    return dense


def _dense(
    t: GGUFTensor,
    raw: np.ndarray,
    dtype: mx.Dtype,
    path: str,
    out: tuple[mx.array, ...],
    done: Callable[[int, int], None] | None,
) -> mx.array:
    name = t.type_name
    if name in ("F32", "F16"):
        dense = mx.array(raw.view("<f4" if name == "F32" else "<f2").reshape(t.shape))
        dense = dense.astype(dtype)
    elif name == "BF16":
        dense = mx.array(raw.view("<u2").reshape(t.shape)).view(mx.bfloat16).astype(dtype)
    elif name == "F64":
        return _dense_blocks(t, raw, dtype, _into(lambda b: b.view("<f8")), out, done)
    elif name in DENSE:
        return _dense_blocks(t, raw, dtype, DENSE[name], out, done)
    else:  # IQ*, TQ*, MXFP4, ...: gguf-py's dequantizer when it has one
        return _dense_blocks(t, raw, dtype, _into(_gguf_dequantizer(t, path)), out, done)
    mx.eval(dense)
    return dense


def _gguf_dequantizer(t: GGUFTensor, path: str) -> Callable[[np.ndarray], np.ndarray]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    def unsupported() -> UnsupportedQuantError:
        return UnsupportedQuantError(
            f"ggml type {t.type_name} (id {t.ggml_type}) has no MLX mapping and no dequantizer",
            path=path,
            field=t.name,
        )

    try:
        qtype = GGMLQuantizationType(t.ggml_type)
    except ValueError:  # a type this gguf package predates
        raise unsupported() from None

    def run(blocks: np.ndarray) -> np.ndarray:
        try:
            return dequantize(blocks, qtype)
        except NotImplementedError:
            raise unsupported() from None

    return run
