"""The fused CPU operations (mlxlis/runtime/nodes.py, runtime/kernels/src/fused*.cpp, through the
CPU backend that runtime/fused.py forwards to) against
independent references: float64 numpy formulas (transformers' definitions) within float32
rounding bounds, and MLX's own operations on the same inputs. Inputs take the forms a decode
step gives them: a cache's keys as a strided slice of a longer buffer, grouped heads, per-row
RoPE offsets (the server's batched step), boolean masks, a chunk of a few causal queries.

The model-level proof is elsewhere: the transformers parity tests run with these on (the
default on the CPU); the last test here checks that a real model's decode steps with them
equal MLX's operations within float32 rounding.
"""

from __future__ import annotations

import mlxlis  # noqa: F401  (the BLAS routing first, as the engine runs)
from mlxlis.runtime import backend, fused, kernels, nodes

import mlx.core as mx
import numpy as np
import pytest

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"kernels not built: {kernels.why()}")
U = 2.0**-24  # float32 unit roundoff
rng = np.random.default_rng(7)


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 4, 64), (2, 7, 130)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(shape, weighted):
    x = mx.array(rng.standard_normal(shape).astype(np.float32) * 3)
    w = mx.array(rng.standard_normal(shape[-1]).astype(np.float32)) if weighted else None
    got = f64(ext.rms_norm(x, w, 1e-6))
    xd = f64(x)
    ref = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6)
    if w is not None:
        ref = ref * f64(w)
    d = shape[-1]
    # the sum of squares (d terms), the root, the two products: each a float32 rounding
    assert np.all(np.abs(got - ref) <= (d + 8) * U * np.abs(ref) + 1e-30)
    np.testing.assert_allclose(got, f64(mx.fast.rms_norm(x, w, 1e-6)), rtol=(d + 8) * U * 2)


def rope_ref(x: np.ndarray, dims: int, trad: bool, inv: np.ndarray, pos: np.ndarray):
    """x (B, H, T, D) float64; pos (B, T) positions (already scaled); inv (dims/2,)."""
    ang = pos[:, None, :, None] * inv  # (B, 1, T, dims/2)
    cos, sin = np.cos(ang), np.sin(ang)
    out = x.copy()
    if trad:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., : dims // 2], x[..., dims // 2 : dims]
        out[..., : dims // 2], out[..., dims // 2 : dims] = a * cos - b * sin, b * cos + a * sin
    return out, ang


@pytest.mark.parametrize(
    "trad,dims,periods,scale,rows",
    [
        (False, 64, False, 1.0, 1),
        (True, 32, False, 1.0, 1),  # interleaved pairs, a partial rotation (dims < head_dim)
        (False, 64, True, 1.0, 3),  # wavelengths given (llama3 / yarn), one offset per row
        (False, 48, False, 0.25, 3),  # linear scaling
    ],
)
def test_rope(trad, dims, periods, scale, rows):
    b, h, t, d = rows, 5, 3, 64
    buf = mx.array(rng.standard_normal((b, t, h, d)).astype(np.float32))
    x = buf.transpose(0, 2, 1, 3)  # (B, H, T, D) as the projections give it: strided
    base = 10000.0
    per = mx.array(rng.uniform(1.0, 5e4, dims // 2).astype(np.float32)) if periods else None
    offs = [900, 3, 57][:rows]
    offset = mx.array(offs) if rows > 1 else offs[0]
    args = dict(traditional=trad, base=None if periods else base, scale=scale, offset=offset)
    got = f64(fused.rope(x, dims, **args, freqs=per))
    if periods:
        inv = 1.0 / f64(per)
    else:  # transformers: 1 / base ** (arange(0, dims, 2) / dims)
        inv = 1.0 / base ** (np.arange(0, dims, 2) / dims)
    pos = (np.array(offs)[:, None] + np.arange(t)) * scale
    ref, ang = rope_ref(f64(x), dims, trad, inv, pos.astype(np.float64))
    # angle: inv (2 roundings), position·scale·inv (2): relative 4u, so |Δangle| ≤ 4u·angle;
    # cos/sin and the rotation: a few u of the pair's magnitude
    pair = np.abs(f64(x)).max(-1, keepdims=True) * 2
    bound = pair * (8 * U + 4 * U * ang.max())
    assert np.all(np.abs(got - ref) <= bound)
    mine = mx.fast.rope(x, dims, **args, freqs=per)
    assert np.all(np.abs(got - f64(mine)) <= 2 * bound)
    # heads last in, as the projections give them ((B, T, H, D), or flat (B, T, H·D)): the
    # transpose done by the same pass, so the same arithmetic: equal bit for bit
    assert np.array_equal(f64(fused.rope(buf, dims, **args, freqs=per, heads_last=True)), got)
    offs_arr = mx.array(offs, mx.int32) if rows > 1 else None
    flat = ext.rope(
        buf.reshape(b, t, h * d),
        dims,
        trad,
        0.0 if periods else base,
        scale,
        0 if rows > 1 else offs[0],
        offs_arr,
        per,
        heads=h,
    )
    assert flat.shape == (b, h, t, d) and np.array_equal(f64(flat), got)


def test_rope_heads_last_where_the_kernel_does_not_apply():
    """float16 goes to mx.fast.rope, after the transpose the kernel would have done."""
    buf = mx.array(rng.standard_normal((1, 3, 5, 64)).astype(np.float16))
    args = dict(traditional=False, base=10000.0, scale=1.0, offset=7)
    got = fused.rope(buf, 64, **args, heads_last=True)
    assert np.array_equal(f64(got), f64(mx.fast.rope(buf.transpose(0, 2, 1, 3), 64, **args)))


def attend_ref(q, k, v, scale, keep):
    """float64: q (B, H, T, D), k/v (B, Hkv, S, ·), keep (B, 1, T, S) boolean."""
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("bhtd,bhsd->bhts", q * scale, kk)
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bhsd->bhtd", p, vv), np.abs(s[np.isfinite(s)]).max()


@pytest.mark.parametrize(
    "b,t,mask,h,hkv",
    [
        (1, 1, None, 6, 2),
        (1, 4, "causal", 6, 2),
        (3, 1, "rows", 6, 2),
        (2, 5, "causal", 6, 2),
        (2, 3, "array", 6, 2),
        # a KV head's query heads in chunks (fewer KV heads than threads), or all together
        (1, 1, None, 16, 1),
        (1, 1, "causal", 9, 3),
        (2, 2, "causal", 4, 4),
    ],
)
def test_attention(b, t, mask, h, hkv):
    d, s = 64, 70
    # the cache's buffer is longer than its keys: k and v are strided slices of it
    kbuf = mx.array(rng.standard_normal((b, hkv, 128, d)).astype(np.float32))
    vbuf = mx.array(rng.standard_normal((b, hkv, 128, d)).astype(np.float32))
    k, v = kbuf[:, :, :s], vbuf[:, :, :s]
    q = mx.array(rng.standard_normal((b, h, t, d)).astype(np.float32))
    keep = np.ones((b, 1, t, s), bool)
    if mask == "causal":
        keep &= np.arange(s) <= (s - t + np.arange(t))[:, None]
        arg = "causal"
    elif mask == "rows":  # the batched step: each row attends to its own keys only
        lens = np.array([70, 12, 40])[:b]
        keep &= (np.arange(s) < lens[:, None])[:, None, None, :]
        arg = mx.array(keep)
    elif mask == "array":
        keep &= rng.uniform(size=(t, s)) > 0.3
        keep[..., 0] = True
        arg = mx.array(keep[0, 0])  # (T, S): broadcast over rows
    else:
        arg = None
    scale = d**-0.5
    got = fused.attend(q, k, v, scale, arg)
    assert got is not None
    ref, smax = attend_ref(f64(q), f64(k), f64(v), scale, keep)
    # a score's error ≤ d·u·|q||k|scale ≤ d·u·smax·(a few): it moves each probability by that
    # relative amount; the weighted sum of s values adds s·u of the largest |v|
    vmax = np.abs(f64(v)).max()
    bound = (4 * d * U * max(smax, 1.0) + 4 * s * U) * vmax
    assert np.abs(f64(got) - ref).max() <= bound
    # (B, T, H·Dv), as the output projection reads it: the same values, placed there
    flat = fused.attend(q, k, v, scale, arg, heads_last=True)
    assert np.array_equal(f64(flat), f64(got.transpose(0, 2, 1, 3).reshape(b, t, -1)))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated(act):
    g = mx.array(rng.standard_normal((2, 3, 1000)).astype(np.float32) * 6)
    u = mx.array(rng.standard_normal((2, 3, 1000)).astype(np.float32))
    got = f64(fused.gated(act, g, u))
    gd, ud = f64(g), f64(u)
    if act == "silu":
        ref = gd / (1 + np.exp(-gd)) * ud
    else:
        # 0.5·g·(1 + tanh(a)) = g / (1 + e^−2a), the form without float64's cancellation
        ref = gd / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (gd + 0.044715 * gd**3))) * ud
    # exp within 1 ulp; the argument (gelu: cubic, 4 roundings) moves e^a by |a|·4u
    c = 2 * np.sqrt(2 / np.pi)
    arg = np.abs(gd) if act == "silu" else c * (np.abs(gd) + 0.044715 * np.abs(gd) ** 3)
    assert np.all(np.abs(got - ref) <= (8 + 4 * arg) * U * np.abs(ref) + 1e-30)


def test_refused_where_the_kernel_does_not_apply():
    """float16 inputs go to MLX's own operations (a prompt's queries: test_fused_prompt.py)."""
    q = mx.zeros((1, 2, 1, 8), mx.float16)
    assert fused.attend(q, q, q, 1.0, None) is None
    assert nodes.gated("silu", mx.zeros((4,), mx.bfloat16), mx.zeros((4,), mx.bfloat16)) is None
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ext.attend(
            mx.zeros((1, 3, 1, 8)), mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)), 1.0, False, None
        )


@pytest.mark.real
def test_a_real_decode_with_the_fused_operations_equals_mlx_operations(monkeypatch):
    """SmolLM2's prefill and 8 decode steps, fused vs MLX's operations (MLXLIS_FUSED=0), same
    weights and cache contents: logits within 3e-5 × the logit scale, the bound the GGUF
    tests use for float32 reorderings, and the same greedy tokens."""
    from mlxlis.generation.steps import prefill
    from mlxlis.loading import catalog

    model = mlxlis.load(str(catalog.model_path("smollm2-135m")))
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("MLXLIS_FUSED", flag)
        backend.select()  # as a load does (the fixture in conftest.py read the variable again)
        cache = model.make_cache()
        logits = [prefill(model.net, list(range(100, 140)), cache)]  # (1, vocab)
        for _ in range(8):
            tok = mx.argmax(logits[-1], axis=-1)[:, None]
            logits.append(model.net(tok, cache=cache)[:, -1])
        runs.append(np.stack([np.array(a) for a in logits]))
    fast, plain = runs
    assert np.abs(fast - plain).max() <= 3e-5 * np.abs(plain).max()
    assert (fast.argmax(-1) == plain.argmax(-1)).all()
