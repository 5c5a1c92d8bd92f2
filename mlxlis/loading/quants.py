"""GGUF tensor blocks → MLX arrays: affine-quantized where MLX can hold them exactly, else dense.

MLX affine quantization stores w = scale·q + bias per group of 32 along a row, with the codes
of a row as one little-endian bit stream in uint32 words (code j at bit j·bits). The
32-element (sub-)blocks of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K map onto that form exactly:

    Q4_0 / Q5_0 / Q8_0  d·(q − 8 / 16 / 0)   scale d,     bias −8d / −16d / −128d (codes q+128)
    Q4_1 / Q5_1         d·q + m              scale d,     bias m
    Q4_K / Q5_K         d·sc·q − dmin·m      scale d·sc,  bias −dmin·m   (per 32-sub-block)

Scales and biases are computed in float32 (d·sc has ≤ 17 significant bits, so it is exact
there) and then cast to the compute dtype. Everything else becomes a dense array.

How it is fast (load time is dominated by this file): every block's codes are repacked with
whole-word bit operations on little-endian uint64 "planes" (one word of 8 codes per block and
group, contiguous across blocks) instead of one numpy call per code position; the results are
written straight into the final MLX buffers (no per-chunk arrays, no concatenation), in chunks
small enough to stay in cache, and the chunks of a large tensor are shared among the CPU cores
(numpy releases the GIL inside its loops).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import FileFormatError, UnsupportedQuantError
from .gguf import GGML_TYPES, GGUFTensor

GROUP = 32
CHUNK_ELEMENTS = 1 << 18  # weights per conversion chunk: keeps the temporaries in cache
QUANTIZABLE: frozenset[str] = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"})
_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}


@dataclass
class Converted:
    weight: mx.array  # packed uint32 codes (quantized) or dense array in `dtype`
    scales: mx.array | None = None  # (rows, cols // group) in `dtype`
    biases: mx.array | None = None
    bits: int | None = None
    group_size: int | None = None

    @property
    def quantized(self) -> bool:
        return self.scales is not None


def convert_tensor(
    t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype, *, dequantize: bool = False, path: str = "",
    out: tuple[mx.array, ...] = (),
) -> Converted:
    """Convert one GGUF tensor (its raw bytes) to MLX: quantized (see module doc) or dense.

    `out`: the buffers from `allocate(t, dequantize=...)`, when the caller made them early.
    """
    if t.ggml_type not in GGML_TYPES:
        raise UnsupportedQuantError(f"unknown ggml type id {t.ggml_type}", path=path, field=t.name)
    if raw.dtype != np.uint8 or raw.size != t.nbytes:
        raise FileFormatError(f"expected {t.nbytes} raw bytes, got {raw.size}",
                              path=path, field=t.name)  # fmt: skip
    if t.type_name in QUANTIZABLE:
        if dequantize or len(t.shape) < 2:  # dense: MLX's own dequantization of the exact form
            q = _quantized(t, raw, mx.float32, ())
            w, s, m = (a.reshape(-1, a.shape[-1]) for a in (q.weight, q.scales, q.biases))
            w = mx.dequantize(w, s, m, group_size=GROUP, bits=q.bits)
            w = w.reshape(t.shape).astype(dtype)
            del q, s, m
            mx.eval(w)
            return Converted(w)
        return _quantized(t, raw, dtype, out)
    return Converted(_dense(t, raw, dtype, path, out))


def allocate(t: GGUFTensor, *, dequantize: bool = False) -> tuple[mx.array, ...]:
    """The output buffers `convert_tensor` will fill for `t`, not yet evaluated.

    A loader can create them all first and `mx.async_eval` them, so that MLX allocates and
    zero-fills the memory on its own thread while earlier tensors convert.
    """
    name = t.type_name
    if name in QUANTIZABLE:
        if dequantize or len(t.shape) < 2:
            return ()  # temporaries of the dense path: made when needed
        return _quantized_buffers(t)
    if name in ("F32", "F16", "BF16") or t.ggml_type not in GGML_TYPES:
        return ()
    return (mx.zeros(t.shape, mx.float32),)


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
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


_POOL: ThreadPoolExecutor | None = None


def _for_chunks(n: int, step: int, fn: Callable[[int, int], None]) -> None:
    """fn(i, j) for consecutive spans of [0, n); spans run on all cores when there are several."""
    global _POOL
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


# --- little-endian word planes and bit packing ---

_U64 = np.uint64
_LOW_NIBBLES = _U64(0x0F0F0F0F0F0F0F0F)
_BIT4 = _U64(0x1010101010101010)


def _plane(b: np.ndarray, offset: int, width: int = 8) -> np.ndarray:
    """Bytes offset..offset+width of every block (row of b) as one little-endian integer: (n,)."""
    return b[:, offset : offset + width].view({8: "<u8", 4: "<u4", 2: "<u2"}[width])[:, 0]


def _f16(b: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at `offset` of every block: (n,) float16 (a strided view)."""
    return b[:, offset : offset + 2].view("<f2")[:, 0]


# Delta swaps that move the even nibbles of a word (the low nibble of each byte) into its low
# 32 bits and the odd nibbles into its high 32 bits, both in order (Hacker's Delight 7-2).
_UNZIP = ((_U64(0x00F000F000F000F0), _U64(4)), (_U64(0x0000FF000000FF00), _U64(8)),
          (_U64(0x00000000FFFF0000), _U64(16)))  # fmt: skip


def _unzip_nibbles(x: np.ndarray) -> None:
    t = np.empty_like(x)
    for mask, s in _UNZIP:
        np.right_shift(x, s, out=t)
        t ^= x
        t &= mask
        x ^= t
        t <<= s
        x ^= t


def _pack4(qs: np.ndarray, out32: np.ndarray) -> None:
    """GGUF 4-bit layout -> MLX's: qs (n, 8m) bytes hold, per 8m bytes, codes 0..8m−1 in the low
    nibbles and 8m..16m−1 in the high ones; out32 (n, 2m) gets the 16m codes as one stream."""
    n, m = qs.shape[0], qs.shape[1] // 8
    w = np.ascontiguousarray(qs).view("<u8")  # (n, m)
    _unzip_nibbles(w)  # word k: low half = codes 8k..8k+7, high half = codes 8m+8k..
    out32.reshape(n, 2, m)[:] = w.view("<u4").reshape(n, m, 2).transpose(0, 2, 1)


# Compress 5-bit codes held one per byte (8 per word) into the low 40 bits of the word.
_PACK5 = ((_U64(3), _U64(0x001F001F001F001F), _U64(0x03E003E003E003E0)),
          (_U64(6), _U64(0x000003FF000003FF), _U64(0x000FFC00000FFC00)),
          (_U64(12), _U64(0x00000000000FFFFF), _U64(0x000000FFFFF00000)))  # fmt: skip


def _pack5(codes: np.ndarray, out32: np.ndarray) -> None:
    """codes (G, n) uint64, word g = codes 8g..8g+7 of a block (one per byte, < 32), G % 4 == 0
    -> out32 (n, 5G/4): the block's 8G codes as one 5-bit stream. Consumes `codes`."""
    t = np.empty_like(codes)
    for s, keep, moved in _PACK5:
        np.right_shift(codes, s, out=t)
        t &= moved
        codes &= keep
        codes |= t
    g4, n = codes.shape[0] // 4, codes.shape[1]
    x = codes.reshape(g4, 4, n)  # four 40-bit values make 160 bits: bytes 0-7, 8-15, 16-19
    out = out32.view(np.uint8).reshape(n, g4, 20)
    z, y = t[:g4], t[g4 : 2 * g4]
    np.left_shift(x[:, 1], _U64(40), out=z)
    z |= x[:, 0]
    out[:, :, 0:8].view("<u8")[..., 0].T[...] = z  # (g4, n) strided views of the output
    np.right_shift(x[:, 1], _U64(24), out=z)
    np.left_shift(x[:, 2], _U64(16), out=y)
    z |= y
    np.left_shift(x[:, 3], _U64(56), out=y)
    z |= y
    out[:, :, 8:16].view("<u8")[..., 0].T[...] = z
    np.right_shift(x[:, 3], _U64(8), out=z)
    out[:, :, 16:20].view("<u4")[..., 0].T[...] = z  # (setitem keeps the low 32 bits)


def _spread_bits(h: np.ndarray) -> np.ndarray:
    """uint64 array of bytes (< 256) -> each bit i moved to bit 4 of byte i (in place)."""
    h *= _U64(0x0101010101010101)  # a copy of the byte in every byte
    h &= _U64(0x8040201008040201)  # byte i keeps bit i
    h += _U64(0x7F7F7F7F7F7F7F7F)  # a kept bit carries into bit 7 (never past the byte)
    h >>= _U64(3)
    h &= _BIT4
    return h


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


# --- block kernels: blocks (n, type_size) uint8 -> codes into w32 (n, words per block),
#     scales and biases into s, m (n, groups per block) float32 ---


def _q4_0(b: np.ndarray, w32: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    _pack4(b[:, 2:18], w32)
    s[:, 0] = _f16(b, 0)
    np.multiply(s, -8, out=m)


def _q4_1(b: np.ndarray, w32: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    _pack4(b[:, 4:20], w32)
    s[:, 0] = _f16(b, 0)
    m[:, 0] = _f16(b, 2)


def _q5_32(b: np.ndarray, w32: np.ndarray, qh: int, qs: int) -> None:
    """Q5_0/Q5_1: code j = nibble j of qs (low nibbles 0..15, high 16..31) | bit j of qh << 4."""
    n = b.shape[0]
    codes = np.empty((4, n), np.uint64)  # word g: codes 8g..8g+7
    lo, hi = _plane(b, qs), _plane(b, qs + 8)
    np.bitwise_and(lo, _LOW_NIBBLES, out=codes[0])
    np.bitwise_and(hi, _LOW_NIBBLES, out=codes[1])
    np.right_shift(lo, _U64(4), out=codes[2])
    np.right_shift(hi, _U64(4), out=codes[3])
    codes[2:] &= _LOW_NIBBLES
    codes |= _spread_bits(np.array(b[:, qh : qh + 4].T, np.uint64, order="C"))  # byte g: word g
    _pack5(codes, w32)


def _q5_0(b: np.ndarray, w32: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    _q5_32(b, w32, 2, 6)
    s[:, 0] = _f16(b, 0)
    np.multiply(s, -16, out=m)


def _q5_1(b: np.ndarray, w32: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    _q5_32(b, w32, 4, 8)
    s[:, 0] = _f16(b, 0)
    m[:, 0] = _f16(b, 2)


def _q8_0(b: np.ndarray, w32: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    # int8 q -> uint8 q+128 by flipping the sign bit; 8-bit codes are already MLX's stream
    np.bitwise_xor(b[:, 2:34], np.uint8(0x80), out=w32.view(np.uint8))
    s[:, 0] = _f16(b, 0)
    np.multiply(s, -128, out=m)


def _k_scales(b: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    """Q4_K/Q5_K: d, dmin (fp16) and 12 bytes of 6-bit sub-block scales/mins -> (n, 8) each."""
    d = _f16(b, 0).astype(np.float32)[:, None]
    dmin = _f16(b, 2).astype(np.float32)[:, None]
    lo, mid, hi = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    np.multiply(d, sc.astype(np.float32), out=s)
    np.multiply(dmin, mn.astype(np.float32), out=m)
    np.negative(m, out=m)


def _q4_k(b: np.ndarray, w32: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    # 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c+1
    n = b.shape[0]
    _pack4(b[:, 16:144].reshape(n * 4, 32), w32.reshape(n * 4, 8))
    _k_scales(b, s, m)


def _q5_k(b: np.ndarray, w32: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    # sub-block i = 2c + half: element l is nibble `half` of qs[32c + l] | bit i of qh[l] << 4
    n = b.shape[0]
    q = b[:, 48:176].view("<u8").T  # (16, n): word 4c + k holds bytes 8k..8k+7 of chunk c
    codes = np.empty((4, 2, 4, n), np.uint64)  # (c, half, k, n) = word 4·(2c + half) + k
    np.bitwise_and(q.reshape(4, 4, n), _LOW_NIBBLES, out=codes[:, 0])
    np.right_shift(q.reshape(4, 4, n), _U64(4), out=codes[:, 1])
    codes[:, 1] &= _LOW_NIBBLES
    codes = codes.reshape(8, 4, n)
    qh = np.ascontiguousarray(b[:, 16:48].view("<u8").T)  # (4, n): bytes 8k..8k+7 of qh
    t = np.empty_like(qh)
    for i in range(8):  # bit i of each qh byte -> bit 4 of sub-block i's code byte
        if i <= 4:
            np.left_shift(qh, _U64(4 - i), out=t)
        else:
            np.right_shift(qh, _U64(i - 4), out=t)
        t &= _BIT4
        codes[i] |= t
    _pack5(codes.reshape(32, n), w32)
    _k_scales(b, s, m)


Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
_KERNELS: dict[str, Kernel] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k,
}  # fmt: skip


def _quantized_buffers(t: GGUFTensor) -> tuple[mx.array, mx.array, mx.array]:
    rows, cols = math.prod(t.shape[:-1]), t.shape[-1]  # 1-D: one row
    return (mx.zeros((rows, cols * _BITS[t.type_name] // 32), mx.uint32),
            mx.zeros((rows, cols // GROUP), mx.float32),
            mx.zeros((rows, cols // GROUP), mx.float32))  # fmt: skip


def _quantized(t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype,
               out: tuple[mx.array, ...]) -> Converted:  # fmt: skip
    _, block, type_size = GGML_TYPES[t.ggml_type]
    bits = _BITS[t.type_name]
    cols = t.shape[-1]
    n_blocks = t.nbytes // type_size
    w, s, m = out or _quantized_buffers(t)
    # every block fills its own slots of the outputs, so blocks convert independently
    blocks = raw.reshape(n_blocks, type_size)
    wv, sv, mv = (_writable(a).reshape(n_blocks, -1) for a in (w, s, m))
    kernel = _KERNELS[t.type_name]

    def chunk(i: int, j: int) -> None:
        kernel(blocks[i:j], wv[i:j], sv[i:j], mv[i:j])

    _for_chunks(n_blocks, max(1, CHUNK_ELEMENTS // block), chunk)
    lead = t.shape[:-1]
    w = w.reshape(*lead, cols * bits // 32)
    s = s.reshape(*lead, cols // GROUP)
    m = m.reshape(*lead, cols // GROUP)
    if dtype != mx.float32:
        s, m = s.astype(dtype), m.astype(dtype)
        mx.eval(s, m)
    return Converted(weight=w, scales=s, biases=m, bits=bits, group_size=GROUP)


# --- dense-only K-quants (16-element sub-blocks; MLX has no group 16) ---
# Written here rather than taken from gguf-py: Q6_K is in two of our three real models and
# this runs ~4x faster; the tests check all three against gguf.quants.dequantize bit for bit.
# Products are formed in llama.cpp's order, (d·sc)·q, since fp32 rounding depends on it.


def _q6_k(b: np.ndarray) -> np.ndarray:
    """ql[128] qh[64] int8 sc[16] fp16 d: element o of the 256 has 6-bit code, scale sc[o // 16]."""
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)  # (n, half, -, j, l)
    q = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # (n, half, nibble, j, l)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = q.reshape(n, 2, 4, 32) | ((qh & 3) << 4)  # k = 2·nibble + j picks qh's bit pair
    q = q.view(np.int8) - np.int8(32)
    sc = _f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    return (sc[:, :, None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 16, 16): element 128h + 32k + l is bits 2k..2k+1 of qs[32h + l]."""
    q = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    return (q & 3).reshape(-1, 16, 16)


def _q2_k(b: np.ndarray) -> np.ndarray:
    """sc[16] (lo: scale, hi: min) qs[64] fp16 d, dmin: d·sc·q − dmin·m per 16 elements."""
    d = _f16(b, 80).astype(np.float32)[:, None]
    dmin = _f16(b, 82).astype(np.float32)[:, None]
    sc = b[:, 0:16]
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * _two_bit_codes(b[:, 16:80]).astype(np.float32) - ml).reshape(-1, 256)


def _q3_k(b: np.ndarray) -> np.ndarray:
    """hmask[32] qs[64] 12 bytes of 6-bit scales, fp16 d: d·(s − 32)·(q − 4·!hbit)."""
    n, s = b.shape[0], b[:, 96:108]
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)  # scale i: low 4 bits
    high = s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    sc = (low | ((high.reshape(n, 16) & 3) << 4)).view(np.int8) - np.int8(32)
    dl = (_f16(b, 108).astype(np.float32)[:, None] * sc.astype(np.float32))[:, :, None]
    # hmask[l] bit m belongs to element 32m + l; a clear bit subtracts 4
    hbit = np.unpackbits(b[:, 0:32], axis=1, bitorder="little").reshape(n, 32, 8)
    hbit = hbit.transpose(0, 2, 1).reshape(n, 16, 16)
    q = _two_bit_codes(b[:, 32:96]).view(np.int8) - ((hbit ^ 1) << 2).view(np.int8)
    return (dl * q.astype(np.float32)).reshape(n, 256)


_DENSE_DECODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q6_K": _q6_k, "Q2_K": _q2_k, "Q3_K": _q3_k,
}  # fmt: skip


def _dense_blocks(t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype,
                  fn: Callable[[np.ndarray], np.ndarray],
                  out: tuple[mx.array, ...]) -> mx.array:  # fmt: skip
    """fn: blocks (n, type_size) uint8 -> (n, block) float32 values, written into the output."""
    _, block, type_size = GGML_TYPES[t.ggml_type]
    (dense,) = out or (mx.zeros(t.shape, mx.float32),)
    n_blocks = raw.size // type_size
    blocks, values = raw.reshape(n_blocks, type_size), _writable(dense).reshape(n_blocks, block)

    def chunk(i: int, j: int) -> None:
        values[i:j] = fn(blocks[i:j])

    _for_chunks(n_blocks, max(1, CHUNK_ELEMENTS // block), chunk)
    if dtype != mx.float32:
        dense = dense.astype(dtype)
        mx.eval(dense)
    return dense


def _dense(t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype, path: str,
           out: tuple[mx.array, ...]) -> mx.array:  # fmt: skip
    name = t.type_name
    if name in ("F32", "F16"):
        dense = mx.array(raw.view("<f4" if name == "F32" else "<f2").reshape(t.shape))
        dense = dense.astype(dtype)
    elif name == "BF16":
        dense = mx.array(raw.view("<u2").reshape(t.shape)).view(mx.bfloat16).astype(dtype)
    elif name == "F64":
        return _dense_blocks(t, raw, dtype, lambda b: b.view("<f8").astype(np.float32), out)
    elif name in _DENSE_DECODERS:
        return _dense_blocks(t, raw, dtype, _DENSE_DECODERS[name], out)
    else:  # IQ*, TQ*, MXFP4, ...: gguf-py's dequantizer when it has one
        return _dense_blocks(t, raw, dtype, _gguf_dequantizer(t, path), out)
    mx.eval(dense)
    return dense


def _gguf_dequantizer(t: GGUFTensor, path: str) -> Callable[[np.ndarray], np.ndarray]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    def unsupported() -> UnsupportedQuantError:
        return UnsupportedQuantError(
            f"ggml type {t.type_name} (id {t.ggml_type}) has no MLX mapping and no dequantizer",
            path=path, field=t.name,
        )  # fmt: skip

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
