"""GGUF tensor blocks → MLX arrays: affine-quantized where MLX can hold them exactly, else dense.

MLX affine quantization stores w = scale·q + bias per group of 32 along a row, with the codes
of a row as one little-endian bit stream in uint32 words (code j at bit j·bits). The
32-element (sub-)blocks of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K map onto that form exactly:

    Q4_0 / Q5_0 / Q8_0  d·(q − 8 / 16 / 0)   scale d,     bias −8d / −16d / −128d (codes q+128)
    Q4_1 / Q5_1         d·q + m              scale d,     bias m
    Q4_K / Q5_K         d·sc·q − dmin·m      scale d·sc,  bias −dmin·m   (per 32-sub-block)

Scales and biases are computed in float32 (d·sc has ≤ 17 significant bits, so it is exact
there) and then cast to the compute dtype. Everything else becomes a dense array.
Tensors are converted in row chunks so temporaries stay small next to the tensor itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import FileFormatError, UnsupportedQuantError
from .gguf import GGML_TYPES, GGUFTensor

GROUP = 32
CHUNK_ELEMENTS = 1 << 20  # weights per conversion chunk: bounds the numpy temporaries
QUANTIZABLE: frozenset[str] = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"})
_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes uint8 (n, B), scales, biases (n, B/32)


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
    t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype, *, dequantize: bool = False, path: str = ""
) -> Converted:
    """Convert one GGUF tensor (its raw bytes) to MLX: quantized (see module doc) or dense."""
    if t.ggml_type not in GGML_TYPES:
        raise UnsupportedQuantError(f"unknown ggml type id {t.ggml_type}", path=path, field=t.name)
    if raw.dtype != np.uint8 or raw.size != t.nbytes:
        raise FileFormatError(f"expected {t.nbytes} raw bytes, got {raw.size}",
                              path=path, field=t.name)  # fmt: skip
    if t.type_name in QUANTIZABLE:
        decode = _DECODERS[t.type_name]
        if dequantize or len(t.shape) < 2:
            return Converted(_dense_from_codes(t, raw, dtype, decode))
        return _quantized(t, raw, dtype, decode, _BITS[t.type_name])
    return Converted(_dense(t, raw, dtype, path))


# --- block decoders: (n_blocks, type_size) uint8 -> codes, scales, biases in float32 ---


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row (little-endian fp16) -> (n, 1) float32."""
    return b.view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian u32 -> (n, 32) bits, bit j for element j, as bit 4."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _q4_0(b: np.ndarray) -> Decoded:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Decoded:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 6:22]) | _high_bits32(b[:, 2:6]), d, -16 * d


def _q5_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 8:24]) | _high_bits32(b[:, 4:8]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Decoded:
    d = _f16(b[:, 0:2])
    return b[:, 2:34] ^ 0x80, d, -128 * d  # int8 q -> uint8 q+128 by flipping the sign bit


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: d, dmin (fp16) and 12 bytes of 6-bit sub-block scales/mins -> (n, 8) each."""
    d, dmin, s = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 256) codes: chunk c's low nibbles are sub-block 2c, high 2c+1."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> Decoded:
    scale, bias = _k_scales(b)
    return _k_nibbles(b[:, 16:144]), scale, bias


def _q5_k(b: np.ndarray) -> Decoded:
    scale, bias = _k_scales(b)
    # qh[l] bit i is the 5th bit of element l of sub-block i
    hi = np.unpackbits(b[:, 16:48], axis=1, bitorder="little").reshape(-1, 32, 8)
    hi = hi.transpose(0, 2, 1).reshape(-1, 256) << 4
    return _k_nibbles(b[:, 48:176]) | hi, scale, bias


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
    sc = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    return (sc[:, :, None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 16, 16): element 128h + 32k + l is bits 2k..2k+1 of qs[32h + l]."""
    q = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    return (q & 3).reshape(-1, 16, 16)


def _q2_k(b: np.ndarray) -> np.ndarray:
    """sc[16] (lo: scale, hi: min) qs[64] fp16 d, dmin: d·sc·q − dmin·m per 16 elements."""
    d, dmin, sc = _f16(b[:, 80:82]), _f16(b[:, 82:84]), b[:, 0:16]
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * _two_bit_codes(b[:, 16:80]).astype(np.float32) - ml).reshape(-1, 256)


def _q3_k(b: np.ndarray) -> np.ndarray:
    """hmask[32] qs[64] 12 bytes of 6-bit scales, fp16 d: d·(s − 32)·(q − 4·!hbit)."""
    n, s = b.shape[0], b[:, 96:108]
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)  # scale i: low 4 bits
    high = s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    sc = (low | ((high.reshape(n, 16) & 3) << 4)).view(np.int8) - np.int8(32)
    dl = (_f16(b[:, 108:110]) * sc.astype(np.float32))[:, :, None]
    # hmask[l] bit m belongs to element 32m + l; a clear bit subtracts 4
    hbit = np.unpackbits(b[:, 0:32], axis=1, bitorder="little").reshape(n, 32, 8)
    hbit = hbit.transpose(0, 2, 1).reshape(n, 16, 16)
    q = _two_bit_codes(b[:, 32:96]).view(np.int8) - ((hbit ^ 1) << 2).view(np.int8)
    return (dl * q.astype(np.float32)).reshape(n, 256)


_DENSE_DECODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q6_K": _q6_k, "Q2_K": _q2_k, "Q3_K": _q3_k,
}  # fmt: skip


_DECODERS: dict[str, Callable[[np.ndarray], Decoded]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k,
}  # fmt: skip


# --- packing and chunking ---


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) uint8 codes -> (rows, cols·bits/32) uint32, MLX's little-endian bit stream."""
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


def _row_chunks(t: GGUFTensor, raw: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (n_rows, blocks) for runs of whole rows; blocks is (n_blocks, type_size) uint8."""
    _, block, type_size = GGML_TYPES[t.ggml_type]
    cols = t.shape[-1]
    rows = math.prod(t.shape[:-1])
    row_bytes = cols // block * type_size
    step = max(1, CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        yield r1 - r0, raw[r0 * row_bytes : r1 * row_bytes].reshape(-1, type_size)


def _cat(parts: list[mx.array], shape: tuple[int, ...]) -> mx.array:
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    out = out.reshape(shape)
    mx.eval(out)
    return out


def _quantized(t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype,
               decode: Callable[[np.ndarray], Decoded], bits: int) -> Converted:  # fmt: skip
    cols = t.shape[-1]
    ws: list[mx.array] = []
    ss: list[mx.array] = []
    bs: list[mx.array] = []
    for n_rows, blocks in _row_chunks(t, raw):
        codes, scales, biases = decode(blocks)
        w = mx.array(pack_codes(codes.reshape(n_rows, cols), bits))
        s = mx.array(scales.reshape(n_rows, -1)).astype(dtype)
        b = mx.array(biases.reshape(n_rows, -1)).astype(dtype)
        mx.eval(w, s, b)  # materialise now so the float32 copies can go
        ws.append(w)
        ss.append(s)
        bs.append(b)
    lead = t.shape[:-1]
    return Converted(
        weight=_cat(ws, (*lead, cols * bits // 32)),
        scales=_cat(ss, (*lead, cols // GROUP)),
        biases=_cat(bs, (*lead, cols // GROUP)),
        bits=bits,
        group_size=GROUP,
    )


def _dense_from_codes(t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype,
                      decode: Callable[[np.ndarray], Decoded]) -> mx.array:  # fmt: skip
    def chunk(blocks: np.ndarray) -> np.ndarray:
        codes, scales, biases = decode(blocks)
        g = codes.reshape(scales.shape[0], -1, GROUP).astype(np.float32)  # (n, groups, 32)
        return g * scales[..., None] + biases[..., None]  # the same fp32 formula MLX applies

    return _dense_chunks(t, raw, dtype, chunk)


def _dense_chunks(t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype,
                  fn: Callable[[np.ndarray], np.ndarray]) -> mx.array:  # fmt: skip
    parts = []
    for n_rows, blocks in _row_chunks(t, raw):
        part = mx.array(fn(blocks).reshape(n_rows, -1)).astype(dtype)
        mx.eval(part)
        parts.append(part)
    return _cat(parts, t.shape)


def _dense(t: GGUFTensor, raw: np.ndarray, dtype: mx.Dtype, path: str) -> mx.array:
    name = t.type_name
    if name in ("F32", "F16"):
        out = mx.array(raw.view("<f4" if name == "F32" else "<f2").reshape(t.shape))
        out = out.astype(dtype)
    elif name == "BF16":
        out = mx.array(raw.view("<u2").reshape(t.shape)).view(mx.bfloat16).astype(dtype)
    elif name == "F64":
        return _dense_chunks(t, raw, dtype, lambda b: b.view("<f8").astype(np.float32))
    elif name in _DENSE_DECODERS:
        return _dense_chunks(t, raw, dtype, _DENSE_DECODERS[name])
    else:  # IQ*, TQ*, MXFP4, ...: gguf-py's dequantizer when it has one
        return _dense_chunks(t, raw, dtype, _gguf_dequantizer(t, path))
    mx.eval(out)
    return out


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
