"""exp, softmax and the gated activations for MLX's CPU backend, as fused compiled kernels.

MLX's CPU backend evaluates exp, sigmoid, tanh and erf one scalar at a time: 12–29 ns per
float32 element on a 2-core x86 machine, against 0.6 ns for a multiply. In a 512-token prefill
of SmolLM2-135M that made the attention softmax and SiLU about 70% of the time; the matmuls,
through BLAS, were the rest. Written as plain arithmetic inside `mx.compile`, MLX fuses the
whole function into one loop that the C++ compiler vectorises: exp costs ~3.5 ns per element
here, and is accurate to within 1 ulp of float64 exp (MLX's own CPU exp: up to 64 ulp).

exp: Cody–Waite range reduction x = n·ln2 + r (|r| ≤ ln2/2, ln2 split in two so n·ln2_hi is
exact), the classic Cephes degree-7 polynomial for e^r, and 2^n assembled in the exponent bits.
Inputs below −86 give 0 (the true value is < 4.5e-38, at the bottom of the normal range), so
masked scores (−inf) contribute exactly nothing; above ln(FLT_MAX), inf; NaN stays NaN.

Only for the CPU, and only when MLX can compile there (its CPU `compile` builds kernels with
the system C++ compiler at first use): `compiles()` probes once, and runtime/backend.py's CPU
backend uses these unless MLXLIS_FAST_MATH=0. Metal and CUDA keep MLX's own kernels, which are
fast there.
"""

from __future__ import annotations

import math
from functools import cache, partial

import mlx.core as mx

LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125  # ln 2 to 16 bits: n · LN2_HI is exact for |n| < 2^8
LN2_LO = 1.428606765330187045e-06  # ln 2 − LN2_HI
ROUND = 12582912.0  # 1.5 · 2^23: (t + ROUND) − ROUND rounds t to an integer, branch-free
LOW, HIGH = -86.0, 88.72284  # flush-to-zero below; above ln(FLT_MAX) = 88.7228391, inf
# Cephes expf polynomial: e^r ≈ 1 + r + r²·P(r) on |r| ≤ ln2/2
P = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
GELU_C = math.sqrt(2.0 / math.pi)
# erf(z) ≈ z·P(z²)/Q(z²) on |z| ≤ 4 (past it erf is ±1 in float32: 1 − erf(4) = 1.5e-8):
# a rational least-squares fit (Loeb's reweighting, 6000 Chebyshev nodes) whose float64 error
# is ≤ 1.9e-9; evaluated in float32 it is within 3.3e-7 of erf, about MLX's and torch's own
ERF_P = (
    1.1283791792685056,
    0.1847194181700399,
    0.05436672816678566,
    0.0038443978721310777,
    0.0003841549492933241,
    4.818214512802142e-06,
    -1.3858128276935983e-08,
)
ERF_Q = (
    1.0,
    0.49703684999453307,
    0.11385926119268096,
    0.015468002405145271,
    0.00131257781244497,
    6.437118333231321e-05,
)
ERF_CLIP = 4.0
RSQRT2 = 1.0 / math.sqrt(2.0)


@partial(mx.compile, shapeless=True)
def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """e^x as m · 2^(n−1): (m, the int32 bits of 2^(n−1)). 2^n alone would overflow the
    exponent field at n = 128 (x just below HIGH). The bit view cannot be compiled shapeless."""
    xc = mx.clip(x, LOW, HIGH)
    n = (xc * LOG2E + ROUND) - ROUND
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = P[0]
    for c in P[1:]:
        p = p * r + c
    m = (p * r * r + r + 1.0) * 2.0
    m = mx.where(x < LOW, 0.0, mx.where(x > HIGH, math.inf, m))
    return m, mx.left_shift(n.astype(mx.int32) + 126, 23)


def exp(x: mx.array) -> mx.array:
    """e^x in float32 (any float input; the constants need float32)."""
    m, bits = _exp_parts(x.astype(mx.float32))
    return m * bits.view(mx.float32)


@partial(mx.compile, shapeless=True)
def _gated(gate: mx.array, e: mx.array, up: mx.array) -> mx.array:
    return gate / (1.0 + e) * up


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) · up, silu(g) = g / (1 + e^−g); computed in float32, returned in gate's dtype."""
    g = gate.astype(mx.float32)
    return _gated(g, exp(-g), up.astype(mx.float32)).astype(gate.dtype)


@partial(mx.compile, shapeless=True)
def _gelu_exponent(g: mx.array) -> mx.array:
    return (-2.0 * GELU_C) * (g + 0.044715 * g * g * g)


def geglu_tanh(gate: mx.array, up: mx.array) -> mx.array:
    """gelu_tanh(gate) · up: 0.5·g·(1 + tanh(u)) = g / (1 + e^−2u), u = √(2/π)(g + 0.044715g³)."""
    g = gate.astype(mx.float32)
    return _gated(g, exp(_gelu_exponent(g)), up.astype(mx.float32)).astype(gate.dtype)


def _horner(coefs: tuple[float, ...], u: mx.array) -> mx.array:
    acc = coefs[-1]
    for c in reversed(coefs[:-1]):
        acc = acc * u + c
    return acc


@partial(mx.compile, shapeless=True)
def erf(x: mx.array) -> mx.array:
    """erf in float32 by the rational fit above: one fused loop, no exp (MLX's own CPU erf is
    evaluated one scalar at a time: ~28 ns per element here)."""
    z = mx.clip(x, -ERF_CLIP, ERF_CLIP)
    u = z * z
    return mx.clip(z * _horner(ERF_P, u) / _horner(ERF_Q, u), -1.0, 1.0)


@partial(mx.compile, shapeless=True)
def _gelu(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + erf(x * RSQRT2))


def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU, x·Φ(x) = x·(1 + erf(x/√2))/2 as transformers' GELUActivation,
    computed in float32 and returned in x's dtype."""
    return _gelu(x.astype(mx.float32)).astype(x.dtype)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """Softmax in float32 (the reductions stay MLX's; the exp is the one above)."""
    x = x.astype(mx.float32)
    e = exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@cache
def compiles() -> bool:
    """True when MLX's compiler works for the default device (probed once: runtime/backend.py
    asks only for the CPU, where MLXLIS_FAST_MATH is not 0)."""
    try:
        x = mx.array([-math.inf, -1.0, 0.0, 1.0])
        got = exp(x)
        mx.eval(got)
    except Exception:  # noqa: BLE001  (no C++ compiler, or MLX refused: keep MLX's own ops)
        return False
    return got.tolist()[0] == 0.0 and abs(got.tolist()[3] - math.e) < 1e-6
