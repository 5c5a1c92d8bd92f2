"""mlxlis.runtime.fastmath and the shared attention against float64 numpy references.

Proves: the compiled exp is within 1 ulp of float64 exp over its whole finite range and exact on
the special values the model relies on (−inf → 0 for masked scores, 0 → 1, overflow → inf,
NaN → NaN); SwiGLU, GeGLU(tanh) and softmax match their float64 formulas to float32 rounding;
attention through the explicit path (query-blocked causal, window masks, GQA, softcap, after a
cache offset) matches a float64 reference and MLX's fused kernel; a tiny model gives the same
logits with fastmath on and off (the off path is MLX's own ops, as on Metal).
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import mlxlis
from mlxlis.cache import window_mask
from mlxlis.models import attention
from mlxlis.runtime import backend, fastmath
from mlxlis.settings import settings

import mlx.core as mx
import numpy as np
import pytest

rng = np.random.default_rng(0)


@pytest.fixture(scope="module", autouse=True)
def need_fastmath():
    if not backend.current().fast_math:
        if shutil.which("g++") or shutil.which("c++"):
            from mlxlis.runtime.device import device_name

            if device_name() == "cpu":
                pytest.fail("a C++ compiler is present but fastmath is not enabled on the CPU")
        pytest.skip("fastmath is off here (not the CPU, or MLX cannot compile)")


def ulp_error(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - want) / np.spacing(want.astype(np.float32))


def test_exp_within_one_ulp():
    xs = np.concatenate(
        [np.linspace(-86.0, 88.7, 3_000_001, dtype=np.float32), rng.normal(0, 3, 100_000)]
    ).astype(np.float32)
    got = np.array(fastmath.exp(mx.array(xs)))
    err = ulp_error(got, np.exp(xs.astype(np.float64)))
    assert err.max() <= 1.0, err.max()


def test_exp_special_values():
    x = mx.array([-np.inf, -1000.0, -86.5, 0.0, -0.0, 89.0, np.inf, np.nan], dtype=mx.float32)
    got = np.array(fastmath.exp(x))
    assert got[:3].tolist() == [0.0, 0.0, 0.0]  # masked scores add exactly nothing
    assert got[3] == 1.0 and got[4] == 1.0
    assert np.isposinf(got[5]) and np.isposinf(got[6]) and np.isnan(got[7])
    # the top of the float32 range: finite up to ln(FLT_MAX) = 88.7228391, inf past it
    top = np.array([88.722, 88.7228], np.float32)
    got = np.array(fastmath.exp(mx.array(top)))
    assert np.all(ulp_error(got, np.exp(top.astype(np.float64))) <= 1.0)
    assert np.isposinf(np.array(fastmath.exp(mx.array([88.72285], dtype=mx.float32)))).all()
    # float16 input is computed in float32 (the range-reduction constants need it)
    assert np.array(fastmath.exp(mx.array([1.0, -20.0], dtype=mx.float16))).dtype == np.float32


def swiglu64(g, u):
    return g / (1 + np.exp(-g)) * u, g


def geglu64(g, u):
    # 0.5·(1 + tanh(z/2)) written as 1 / (1 + e^−z), z = 2u: in float64 too, 1 + tanh cancels
    # to 0 for u < −19 while the true value is ~e^z (the float32 kernel gets those right)
    z = 2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)
    return g / (1 + np.exp(-z)) * u, z


@pytest.mark.parametrize("fn,ref", [(fastmath.swiglu, swiglu64), (fastmath.geglu_tanh, geglu64)])
def test_gated_activations(fn, ref):
    g = (rng.normal(0, 4, (3, 257, 96))).astype(np.float32)
    g[0, 0, :4] = [-100.0, 100.0, 0.0, -0.0]  # saturated ends and zero
    u = rng.normal(0, 1, g.shape).astype(np.float32)
    got = np.array(fn(mx.array(g), mx.array(u)))
    with np.errstate(over="ignore"):
        want, z = ref(g.astype(np.float64), u.astype(np.float64))
    # float32 bound: a few ulp, times the condition number (1 + |z|) of g·σ(z) under the
    # rounding of z; results below 1e-30 (e^−z past the exp range) may come out 0
    bound = 4 * 2.0**-24 * (1 + np.abs(z)) * np.abs(want) + 1e-30
    assert np.all(np.abs(got - want) <= bound)
    half = fn(mx.array(g, dtype=mx.float16), mx.array(u, dtype=mx.float16))
    assert half.dtype == mx.float16 and np.isfinite(np.array(half)).all()


def test_erf_and_gelu_against_float64():
    """The rational erf within 4e-7 of math.erf (MLX's own CPU erf: 4.7e-7 in GELU) and GELU
    within 1.2e-6 of float64 (torch's float32 GELU: 1.3e-6), over the float32 range."""
    import math

    x = np.concatenate([np.linspace(-12, 12, 200_001), rng.normal(0, 3, 100_000)])
    x = x.astype(np.float32)
    x64 = x.astype(np.float64)
    erf64 = np.array([math.erf(v) for v in x64])
    got = np.array(fastmath.erf(mx.array(x)), dtype=np.float64)
    assert np.abs(got - erf64).max() <= 4e-7
    gelu64 = 0.5 * x64 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x64]))
    got = np.array(fastmath.gelu(mx.array(x)), dtype=np.float64)
    assert np.abs(got - gelu64).max() <= 1.2e-6
    # the negative tail goes to 0, the positive to x; float16 in, float16 out
    ends = np.array(fastmath.gelu(mx.array([-30.0, 30.0, 0.0], dtype=mx.float32)))
    assert ends.tolist() == [-0.0, 30.0, 0.0]
    assert fastmath.gelu(mx.array([1.0], dtype=mx.float16)).dtype == mx.float16


def test_softmax():
    x = rng.normal(0, 5, (4, 7, 300)).astype(np.float32)
    x[0, 0, 100:] = -np.inf  # a masked row tail
    got = np.array(fastmath.softmax(mx.array(x)))
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    # float32 bound: the sum of n = 300 terms, n·u relative
    assert np.all(np.abs(got - want) <= 300 * 2.0**-24 * want + 1e-30)
    assert (got[0, 0, 100:] == 0).all()


def reference_attention(q, k, v, scale, keep, softcap=None):
    """float64 numpy: q (B, H, T, D), k/v (B, KV, S, D), keep (T, S) boolean."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * scale
    if softcap is not None:
        s = np.tanh(s / softcap) * softcap
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize(
    "t,offset,window,softcap",
    [
        (1, 40, None, None),  # a decode step
        (300, 0, None, None),  # causal prefill, blocked (T > QUERY_BLOCK)
        (200, 77, None, None),  # a chunk after a cache: keys are offset + T
        (150, 30, 64, None),  # sliding window (array mask)
        (130, 0, None, 20.0),  # Gemma 2 softcap
    ],
)
def test_attention(t, offset, window, softcap):
    assert t < 150 or t > attention.QUERY_BLOCK
    h, kv, d, s = 6, 2, 32, offset + t
    q = rng.normal(0, 1, (1, h, t, d)).astype(np.float32)
    k = rng.normal(0, 1, (1, kv, s, d)).astype(np.float32)
    v = rng.normal(0, 1, (1, kv, s, d)).astype(np.float32)
    keep = np.array(window_mask(offset, t, 0, s, window))
    mask = "causal" if window is None and t > 1 else None
    if window is not None:
        mask = mx.array(keep)
    got = np.array(attention.attend(mx.array(q), mx.array(k), mx.array(v), d**-0.5, mask, softcap))
    want = reference_attention(q, k, v, d**-0.5, keep, softcap)
    assert np.abs(got - want).max() < 2e-6
    if softcap is None:
        fused = mx.fast.scaled_dot_product_attention(
            mx.array(q), mx.array(k), mx.array(v), scale=d**-0.5, mask=mask
        )
        assert np.abs(got - np.array(fused)).max() < 2e-6


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_model_same_with_fastmath_off(tiny, tmp_path, monkeypatch, name):
    """A tiny model's logits with the compiled kernels ≡ with MLX's own ops (< 1e-4, the suite's
    bound for one computation done two ways), over 200 tokens (causal blocks, Gemma 3's window
    masks)."""
    if name == "gemma3":
        from conftest import build_tiny
        from test_gemma_parity import SPECS

        folder = tmp_path / name
        folder.mkdir()
        build_tiny(folder, {"kind": name, "pad_token_id": 0, **SPECS[name]})
    else:
        folder, _ = tiny(name)
    ids = [3 + (i * 37) % 390 for i in range(200)]
    model = mlxlis.load(folder, "float32")
    on = np.array(model.logits(ids))
    backend.select("cpu", replace(settings(), fast_math=False))
    off = np.array(model.logits(ids))
    assert np.abs(on - off).max() < 1e-4
