"""GGUF block kernels: blocks (n, type_size) uint8 -> MLX's packed codes + scales/biases, or
dense float32 values. mlxlis.loading.quants drives them chunk by chunk into the final buffers.

Speed comes from whole-word bit operations on little-endian uint64 "planes" (one word of 8
codes per block and group, contiguous across the blocks of a chunk) instead of one numpy call
per code position or small inner dimensions, which cost numpy an iteration each.
Bit-exactness is checked against gguf-py's dequantizer by tests/test_quants.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_U64 = np.uint64
_LOW_NIBBLES = _U64(0x0F0F0F0F0F0F0F0F)
_BIT4 = _U64(0x1010101010101010)


def _plane(b: np.ndarray, offset: int) -> np.ndarray:
    """Bytes offset..offset+7 of every block (row of b) as one little-endian uint64: (n,)."""
    return b[:, offset : offset + 8].view("<u8")[:, 0]


def f16(b: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at `offset` of every block: (n,) float16 (a strided view)."""
    return b[:, offset : offset + 2].view("<f2")[:, 0]


# --- 4-bit: GGUF keeps codes 0..15 of 16 bytes in the low nibbles and 16..31 in the high ones;
#     MLX wants the 32 codes as one nibble stream ---

# Delta swaps that move the even nibbles of a word (the low nibble of each byte) into its low
# 32 bits and the odd nibbles into its high 32 bits, both in order (Hacker's Delight 7-2).
_UNZIP = (
    (_U64(0x00F000F000F000F0), _U64(4)),
    (_U64(0x0000FF000000FF00), _U64(8)),
    (_U64(0x00000000FFFF0000), _U64(16)),
)


def _pack4(qs: np.ndarray, out32: np.ndarray) -> None:
    """qs (n, 8m) bytes holding codes 0..8m−1 in their low nibbles and 8m..16m−1 in their high
    ones -> out32 (n, 2m): the 16m codes as one 4-bit stream."""
    n, m = qs.shape[0], qs.shape[1] // 8
    w = np.ascontiguousarray(qs).view("<u8")  # (n, m)
    t = np.empty_like(w)
    for mask, s in _UNZIP:
        np.right_shift(w, s, out=t)
        t ^= w
        t &= mask
        w ^= t
        t <<= s
        w ^= t
    # word k: low half = codes 8k..8k+7, high half = codes 8m+8k..8m+8k+7
    out32.reshape(n, 2, m)[:] = w.view("<u4").reshape(n, m, 2).transpose(0, 2, 1)


def _nibble_codes(qs: np.ndarray) -> np.ndarray:
    """qs (n, 8m) as for _pack4 -> codes (n, 16m) uint8, one per byte."""
    n, m = qs.shape[0], qs.shape[1] // 8
    w = np.ascontiguousarray(qs).view("<u8")
    codes = np.empty((n, 2, m), np.uint64)
    np.bitwise_and(w, _LOW_NIBBLES, out=codes[:, 0])
    np.right_shift(w, _U64(4), out=codes[:, 1])
    codes[:, 1] &= _LOW_NIBBLES
    return codes.view(np.uint8).reshape(n, 16 * m)


# --- 5-bit: codes built one per byte in word planes, then compressed to MLX's 5-bit stream ---

# Compress 5-bit codes held one per byte (8 per word) into the low 40 bits of the word.
_PACK5 = (
    (_U64(3), _U64(0x001F001F001F001F), _U64(0x03E003E003E003E0)),
    (_U64(6), _U64(0x000003FF000003FF), _U64(0x000FFC00000FFC00)),
    (_U64(12), _U64(0x00000000000FFFFF), _U64(0x000000FFFFF00000)),
)


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


def _q5_codes(b: np.ndarray, qh: int, qs: int) -> np.ndarray:
    """Q5_0/Q5_1 -> (4, n) words: code j = nibble j of qs (low nibbles 0..15, high 16..31),
    bit j of the uint32 qh as bit 4."""
    n = b.shape[0]
    codes = np.empty((4, n), np.uint64)
    lo, hi = _plane(b, qs), _plane(b, qs + 8)  # word g: codes 8g..8g+7
    np.bitwise_and(lo, _LOW_NIBBLES, out=codes[0])
    np.bitwise_and(hi, _LOW_NIBBLES, out=codes[1])
    np.right_shift(lo, _U64(4), out=codes[2])
    np.right_shift(hi, _U64(4), out=codes[3])
    codes[2:] &= _LOW_NIBBLES
    codes |= _spread_bits(np.array(b[:, qh : qh + 4].T, np.uint64, order="C"))  # byte g: word g
    return codes


def _q5_k_codes(b: np.ndarray) -> np.ndarray:
    """Q5_K -> (32, n) words: sub-block i = 2c + half, element l is nibble `half` of
    qs[32c + l] with bit i of qh[l] as bit 4; word 4i + k holds elements 8k..8k+7."""
    n = b.shape[0]
    q = b[:, 48:176].view("<u8").T.reshape(4, 4, n)  # (c, k, n)
    codes = np.empty((4, 2, 4, n), np.uint64)  # (c, half, k, n)
    np.bitwise_and(q, _LOW_NIBBLES, out=codes[:, 0])
    np.right_shift(q, _U64(4), out=codes[:, 1])
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
    return codes.reshape(32, n)


def _bytes(words: np.ndarray) -> np.ndarray:
    """(G, n) code words -> (n, 8G) codes, one per byte."""
    return np.ascontiguousarray(words.T).view(np.uint8)


# --- scales and biases, float32 (n, groups per block) ---


def _scale_d(offset: int, bias_factor: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    def scales(b: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:  # d·(q − k): bias −k·d
        s[:, 0] = f16(b, offset)
        np.multiply(s, bias_factor, out=m)

    return scales


def _scale_dm(b: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:  # d·q + m
    s[:, 0] = f16(b, 0)
    m[:, 0] = f16(b, 2)


def _k_ints(b: np.ndarray, sc: np.ndarray, mn: np.ndarray | None) -> None:
    """Q4_K/Q5_K: the 12 bytes of 6-bit sub-block scales and mins -> sc, mn (n, 8) uint8."""
    lo, mid, hi = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    np.bitwise_and(lo, np.uint8(63), out=sc[:, :4])
    np.bitwise_or(hi & np.uint8(0x0F), (lo >> np.uint8(6)) << np.uint8(4), out=sc[:, 4:])
    if mn is not None:
        np.bitwise_and(mid, np.uint8(63), out=mn[:, :4])
        np.bitwise_or(hi >> np.uint8(4), (mid >> np.uint8(6)) << np.uint8(4), out=mn[:, 4:])


def _scale_k(b: np.ndarray, s: np.ndarray, m: np.ndarray) -> None:
    """Q4_K/Q5_K: d, dmin (fp16) and 12 bytes of 6-bit sub-block scales/mins -> (n, 8) each."""
    d = f16(b, 0).astype(np.float32)[:, None]
    dmin = f16(b, 2).astype(np.float32)[:, None]
    sc, mn = np.empty((2, b.shape[0], 8), np.uint8)
    _k_ints(b, sc, mn)
    np.multiply(d, sc.astype(np.float32), out=s)
    np.multiply(dmin, mn.astype(np.float32), out=m)
    np.negative(m, out=m)


@dataclass(frozen=True)
class Affine:
    """A GGUF type that MLX's affine layout holds exactly (groups of 32)."""

    bits: int
    pack: Callable[[np.ndarray, np.ndarray], None]  # blocks, w32 (n, words per block)
    codes: Callable[[np.ndarray], np.ndarray]  # blocks -> (n, block) uint8 codes
    scales: Callable[[np.ndarray, np.ndarray, np.ndarray], None]  # blocks, s, m (n, groups)
    offset: int | None = None  # k when the value is d·(q − k): scale d, bias −k·d
    group: int = 32


def _q8_0_pack(b: np.ndarray, w32: np.ndarray) -> None:
    # int8 q -> uint8 q+128 by flipping the sign bit; 8-bit codes are already MLX's stream
    np.bitwise_xor(b[:, 2:34], np.uint8(0x80), out=w32.view(np.uint8))


def _q4_k_pack(b: np.ndarray, w32: np.ndarray) -> None:
    # 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c+1
    n = b.shape[0]
    _pack4(b[:, 16:144].reshape(n * 4, 32), w32.reshape(n * 4, 8))


AFFINE: dict[str, Affine] = {
    "Q4_0": Affine(
        4,
        lambda b, w: _pack4(b[:, 2:18], w),
        lambda b: _nibble_codes(b[:, 2:18]),
        _scale_d(0, -8),
        offset=8,
    ),
    "Q4_1": Affine(
        4, lambda b, w: _pack4(b[:, 4:20], w), lambda b: _nibble_codes(b[:, 4:20]), _scale_dm
    ),
    "Q5_0": Affine(
        5,
        lambda b, w: _pack5(_q5_codes(b, 2, 6), w),
        lambda b: _bytes(_q5_codes(b, 2, 6)),
        _scale_d(0, -16),
        offset=16,
    ),
    "Q5_1": Affine(
        5,
        lambda b, w: _pack5(_q5_codes(b, 4, 8), w),
        lambda b: _bytes(_q5_codes(b, 4, 8)),
        _scale_dm,
    ),
    "Q8_0": Affine(
        8, _q8_0_pack, lambda b: b[:, 2:34] ^ np.uint8(0x80), _scale_d(0, -128), offset=128
    ),
    "Q4_K": Affine(
        4,
        _q4_k_pack,
        lambda b: _nibble_codes(b[:, 16:144].reshape(-1, 32)).reshape(-1, 256),
        _scale_k,
    ),
    "Q5_K": Affine(
        5, lambda b, w: _pack5(_q5_k_codes(b), w), lambda b: _bytes(_q5_k_codes(b)), _scale_k
    ),
}


def affine_dense(kind: Affine, b: np.ndarray, out: np.ndarray) -> None:
    """out (n, block) float32 = scale·q + bias, bit for bit as MLX's dequantize computes it:
    scale·q is exact in float32, so the sum rounds once, fused or not; and for d·(q − k) types
    d·(q − k) is that same exact value, one pass shorter."""
    n = b.shape[0]
    rows = n * (out.shape[1] // 32)  # one row per group of 32
    s = np.empty((rows, 1), np.float32)
    m = np.empty((rows, 1), np.float32)
    kind.scales(b, s.reshape(n, -1), m.reshape(n, -1))
    o = out.reshape(rows, 32)
    codes = kind.codes(b).reshape(rows, 32)
    if kind.offset is not None:
        codes -= np.uint8(kind.offset)  # wraps: as int8 this is q − k
        o[...] = codes.view(np.int8)
        o *= s
    else:
        o[...] = codes
        o *= s
        o += m


# --- dense-only K-quants (16-element sub-blocks; MLX has no group 16) ---
# Written here rather than taken from gguf-py: Q6_K is in two of our three real models and
# this runs much faster; the tests check all three against gguf.quants.dequantize bit for bit.
# Products are formed in llama.cpp's order, (d·sc)·q, since fp32 rounding depends on it.


def _q6_k(b: np.ndarray, out: np.ndarray) -> None:
    """ql[128] qh[64] int8 sc[16] fp16 d: element o of the 256 has 6-bit code, scale sc[o // 16].

    Element 128h + 32k + l: nibble k // 2 of ql[64h + 32(k % 2) + l], plus bits 2k..2k+1 of
    qh[32h + l] as bits 4-5; minus 32.
    """
    n = b.shape[0]
    q = _q6_k_codes(b)
    q -= np.uint8(32)  # wraps: as int8 this is code − 32
    sc = f16(b, 208).astype(np.float32)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    o = out.reshape(n, 16, 16)
    o[...] = q.view(np.int8).reshape(n, 16, 16)
    o *= sc[:, :, None]


def _q6_k_codes(b: np.ndarray) -> np.ndarray:
    """Q6_K -> (n, 256) uint8 codes 0..63 in element order (as _q6_k reads them)."""
    n = b.shape[0]
    q = np.empty((n, 2, 4, 32), np.uint8)  # (n, h, k, l)
    ql, qv = b[:, 0:128].reshape(n, 2, 64), q.reshape(n, 2, 128)
    np.bitwise_and(ql, np.uint8(0x0F), out=qv[:, :, :64])
    np.right_shift(ql, np.uint8(4), out=qv[:, :, 64:])
    qh, t = b[:, 128:192].reshape(n, 2, 32), np.empty((n, 2, 32), np.uint8)
    for k in range(4):
        np.right_shift(qh, np.uint8(2 * k), out=t)
        t &= np.uint8(3)
        t <<= np.uint8(4)
        q[:, :, k] |= t
    return q.reshape(n, 256)


def _pack6(codes: np.ndarray, out32: np.ndarray) -> None:
    """(n, 4m) 6-bit codes -> out32: the stream, 4 codes in 3 bytes (code j at bit 6j)."""
    c = codes.reshape(-1, 4)
    o = out32.view(np.uint8).reshape(-1, 3)
    np.bitwise_or(c[:, 0], c[:, 1] << np.uint8(6), out=o[:, 0])
    np.bitwise_or(c[:, 1] >> np.uint8(2), c[:, 2] << np.uint8(4), out=o[:, 1])
    np.bitwise_or(c[:, 2] >> np.uint8(4), c[:, 3] << np.uint8(2), out=o[:, 2])


@dataclass(frozen=True)
class Super:
    """A K-quant held as its file holds it, for mlxlis's CPU kernels only (runtime/kernels): the
    codes as MLX's affine stream, each group's integer scale sc (and min m), each super-block
    of 256 weights' float16 d (and dmin). The kernels take the group's scale as d·sc and its
    bias as −dmin·m in float32, the values _scale_k computes (exact: 11 × 8 bits), so products
    equal the float32-scale layout's bit for bit, at the file's size (Q4_K: 4.625 bits a
    weight against 6)."""

    bits: int
    pack: Callable[[np.ndarray, np.ndarray], None]  # blocks, w32 (n, words per block)
    ints: Callable[[np.ndarray, np.ndarray, np.ndarray | None], None]  # blocks -> sc, m (n, g)
    d: int  # byte offset of d (float16) in a block; dmin follows it when `biases`
    group: int = 32
    signed: bool = False  # int8 scales (else uint8)
    biases: bool = True  # uint8 mins held; False: symmetric, −2^(bits−1)·scale

    def supers(self, b: np.ndarray, out: np.ndarray) -> None:
        """d and dmin (0 without biases) of each block: out (n, 2) uint16, float16 bits."""
        out[:, 0] = b[:, self.d : self.d + 2].view("<u2")[:, 0]
        out[:, 1] = b[:, self.d + 2 : self.d + 4].view("<u2")[:, 0] if self.biases else 0


def _q6_k_ints(b: np.ndarray, sc: np.ndarray, mn: np.ndarray | None) -> None:
    """Q6_K's int8 sub-block scales, (n, 16) (as bytes: `sc` may be a uint8 view)."""
    sc[...] = b[:, 192:208]


SUPER: dict[str, Super] = {
    "Q4_K": Super(4, _q4_k_pack, _k_ints, d=0),
    "Q5_K": Super(5, lambda b, w: _pack5(_q5_k_codes(b), w), _k_ints, d=0),
    # symmetric (d·sc·(q − 32)): no mins held, the kernels take the bias as −32·d·sc
    "Q6_K": Super(
        6,
        lambda b, w: _pack6(_q6_k_codes(b), w),
        _q6_k_ints,
        d=208,
        group=16,
        signed=True,
        biases=False,
    ),
}


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 16, 16): element 128h + 32k + l is bits 2k..2k+1 of qs[32h + l]."""
    q = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    return (q & 3).reshape(-1, 16, 16)


def _q2_k(b: np.ndarray, out: np.ndarray) -> None:
    """sc[16] (lo: scale, hi: min) qs[64] fp16 d, dmin: d·sc·q − dmin·m per 16 elements."""
    d = f16(b, 80).astype(np.float32)[:, None]
    dmin = f16(b, 82).astype(np.float32)[:, None]
    sc = b[:, 0:16]
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    out[...] = (dl * _two_bit_codes(b[:, 16:80]).astype(np.float32) - ml).reshape(-1, 256)


def _q3_k(b: np.ndarray, out: np.ndarray) -> None:
    """hmask[32] qs[64] 12 bytes of 6-bit scales, fp16 d: d·(s − 32)·(q − 4·!hbit)."""
    n, s = b.shape[0], b[:, 96:108]
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)  # scale i: low 4 bits
    high = s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    sc = (low | ((high.reshape(n, 16) & 3) << 4)).view(np.int8) - np.int8(32)
    dl = (f16(b, 108).astype(np.float32)[:, None] * sc.astype(np.float32))[:, :, None]
    # hmask[l] bit m belongs to element 32m + l; a clear bit subtracts 4
    hbit = np.unpackbits(b[:, 0:32], axis=1, bitorder="little").reshape(n, 32, 8)
    hbit = hbit.transpose(0, 2, 1).reshape(n, 16, 16)
    q = _two_bit_codes(b[:, 32:96]).view(np.int8) - ((hbit ^ 1) << 2).view(np.int8)
    out[...] = (dl * q.astype(np.float32)).reshape(n, 256)


# name -> fn(blocks (n, type_size) uint8, out (n, block) float32)
DENSE: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "Q6_K": _q6_k,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
}
