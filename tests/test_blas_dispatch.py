"""The Linux CPU gemv dispatch (mlxlis/_blas_dispatch.c) against numpy in float64.

Proves: every matrix-vector product shape MLX produces (M = 1 or N = 1, each operand plain or
transposed, batched, with alpha/beta through addmm) is taken by the dispatch (its call counter
moves) and matches the float64 product within the float32 rounding bound K·u·(|A|·|B|);
products with M, N > 1 still go to sgemm (counter unchanged) and match the same bound.
"""

from __future__ import annotations

import shutil
import sys

from mlxlis import blas

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "gemv dispatch" not in blas.state.name,
    reason=f"the gemv dispatch is not in use here (BLAS: {blas.state.name}; it is built at "
    "install on Linux when a C compiler is present)",
)


@pytest.fixture(scope="module")
def lib():
    if blas.state.dispatch is None:
        if shutil.which("cc") or shutil.which("gcc"):
            pytest.fail("a C compiler is present but the gemv dispatch was not built/loaded")
        pytest.skip("no C compiler: the optional dispatch was not built")
    return blas.state.dispatch


def check(lib, fn, *arrays, k: int, expect_gemv: bool) -> None:
    """fn on MLX arrays vs the same fn on float64 numpy arrays; k = the inner dimension."""
    before = lib.mlxlis_gemv_calls()
    got = fn(*(mx.array(a) for a in arrays))
    mx.eval(got)
    moved = lib.mlxlis_gemv_calls() - before
    want = fn(*(a.astype(np.float64) for a in arrays))
    bound = fn(*(np.abs(a).astype(np.float64) for a in arrays))
    err = np.abs(np.array(got, dtype=np.float64) - want)
    assert np.all(err <= k * 2.0**-24 * bound + 1e-30), float(err.max())
    assert (moved > 0) == expect_gemv, moved


rng = np.random.default_rng(0)


def r(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("k,n", [(1, 7), (64, 1), (576, 1536), (1536, 576), (33, 4097)])
def test_row_times_matrix(lib, k, n):
    x, w = r(1, k), r(n, k)
    check(lib, lambda x, w: x @ w.T, x, w, k=k, expect_gemv=True)  # Linear: W stored (out, in)
    check(lib, lambda x, w: x @ w.T.T.T, x, w, k=k, expect_gemv=True)
    check(lib, lambda x, w: x @ w, x, np.ascontiguousarray(w.T), k=k, expect_gemv=True)  # (in, out)
    # x transposed: a column stored (k, 1)
    check(lib, lambda xt, w: xt.T @ w.T, np.ascontiguousarray(x.T), w, k=k, expect_gemv=True)


@pytest.mark.parametrize("m,k", [(7, 1), (1536, 576), (65, 33)])
def test_matrix_times_column(lib, m, k):
    a, v = r(m, k), r(k, 1)
    check(lib, lambda a, v: a @ v, a, v, k=k, expect_gemv=True)
    check(lib, lambda at, v: at.T @ v, np.ascontiguousarray(a.T), v, k=k, expect_gemv=True)
    check(lib, lambda a, vt: a @ vt.T, a, np.ascontiguousarray(v.T), k=k, expect_gemv=True)


def test_batched_and_attention_shapes(lib):
    # decode attention: one query per head against the cached keys, (B, H, 1, D) @ (B, H, D, L)
    q, keys = r(1, 3, 1, 64), r(1, 3, 37, 64)
    check(lib, lambda q, k: q @ k.swapaxes(-1, -2), q, keys, k=64, expect_gemv=True)
    check(lib, lambda x, w: x @ w.T, r(2, 1, 96), r(50, 96), k=96, expect_gemv=False)  # M = 2 rows


def test_alpha_beta(lib):
    c, x, w = r(1, 40), r(1, 24), r(40, 24)
    check(
        lib,
        lambda c, x, w: (
            mx.addmm(c, x, w.T, alpha=0.5, beta=2.0)
            if isinstance(c, mx.array)
            else 2.0 * c + 0.5 * (x @ w.T)
        ),
        c,
        x,
        w,
        k=24,
        expect_gemv=True,
    )


@pytest.mark.parametrize("m,k,n", [(2, 64, 64), (17, 576, 192), (512, 96, 3)])
def test_general_products_stay_sgemm(lib, m, k, n):
    check(lib, lambda a, w: a @ w.T, r(m, k), r(n, k), k=k, expect_gemv=False)
