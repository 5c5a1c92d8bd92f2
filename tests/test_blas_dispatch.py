"""The Linux CPU BLAS dispatch (mlxlis/_blas_dispatch.c, _skinny_gemm.c) against numpy in
float64.

Proves: every matrix-vector product shape MLX produces (M = 1 or N = 1, each operand plain or
transposed, batched, with alpha/beta through addmm) is taken by the gemv route (its call
counter moves); products of 2..16 rows by a weight stored (out, in) — a batched decoding
step's projections — by the batch kernel, at every remainder of its 4-row x 3-column tiles and
8-float vectors, with alpha/beta, with leading dimensions wider than the rows, split over any
number of threads, and in a fork()ed child; everything else still goes to sgemm (no counter
moves). Each result matches the float64 product within the float32 rounding bound
K·u·(|A|·|B|).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

from mlxlis.runtime import blas

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


def check(lib, fn, *arrays, k: int, expect_gemv: bool = False, expect_kernel: bool = False):
    """fn on MLX arrays vs the same fn on float64 numpy arrays; k = the inner dimension; which
    route took it (gemv, the batch kernel, or neither: sgemm)."""
    before = lib.mlxlis_gemv_calls(), lib.mlxlis_skinny_calls()
    got = fn(*(mx.array(a) for a in arrays))
    mx.eval(got)
    gemv, kernel = lib.mlxlis_gemv_calls() - before[0], lib.mlxlis_skinny_calls() - before[1]
    within_bound(
        np.array(got),
        fn(*(a.astype(np.float64) for a in arrays)),
        fn(*(np.abs(a).astype(np.float64) for a in arrays)),
        k,
    )
    assert (gemv > 0, kernel > 0) == (expect_gemv, expect_kernel), (gemv, kernel)


def within_bound(got: np.ndarray, want: np.ndarray, bound: np.ndarray, k: int) -> None:
    """|got - want| <= K·u·(|A|·|B|): what any float32 summation order guarantees."""
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= k * 2.0**-24 * bound + 1e-30), float(err.max())


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
    check(lib, lambda x, w: x @ w.T, r(2, 1, 96), r(50, 96), k=96, expect_kernel=True)  # 2 rows


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


@pytest.mark.parametrize("m,k,n", [(17, 576, 192), (512, 96, 3), (4, 64, 64)])
def test_general_products_stay_sgemm(lib, m, k, n):
    if m == 4:  # a weight stored (in, out): not the kernel's layout
        check(lib, lambda a, w: a @ w, r(m, k), r(k, n), k=k)
    else:
        check(lib, lambda a, w: a @ w.T, r(m, k), r(n, k), k=k)


needs_kernel = pytest.mark.skipif(
    "batch kernel" not in blas.state.name, reason="no AVX2 + FMA here: the batch kernel is off"
)


@needs_kernel
@pytest.mark.parametrize("m", [2, 3, 4, 5, 7, 8, 11, 16])
@pytest.mark.parametrize("k,n", [(1, 2), (7, 5), (8, 3), (9, 4), (576, 1536), (1000, 101)])
def test_batch_rows_take_the_kernel(lib, m, k, n):
    """Every remainder: m mod 4 (tile rows), n mod 3 (tile columns), k mod 8 (vector tail)."""
    check(lib, lambda x, w: x @ w.T, r(m, k), r(n, k), k=k, expect_kernel=True)


@needs_kernel
def test_batch_kernel_alpha_beta_and_batches(lib):
    c, x, w = r(3, 40), r(3, 24), r(40, 24)
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
        expect_kernel=True,
    )
    # a decoding batch as the network shapes it: (B, 1, hidden) by (out, hidden)
    check(lib, lambda x, w: x @ w.T, r(8, 1, 576), r(192, 576), k=576, expect_kernel=True)


def kernel_call(lib, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha=1.0, beta=0.0) -> int:
    """mlxlis_skinny_gemm on numpy arrays whose rows may be wider than the product's (a[:, :k]
    of a wider array: leading dimensions larger than the sizes)."""
    f32p = ctypes.POINTER(ctypes.c_float)
    lib.mlxlis_skinny_gemm.argtypes = [ctypes.c_int] * 3 + [
        ctypes.c_float,
        f32p,
        ctypes.c_int,
        f32p,
        ctypes.c_int,
        ctypes.c_float,
        f32p,
        ctypes.c_int,
    ]
    ptr = lambda x: x.ctypes.data_as(f32p)  # noqa: E731
    (m, k), n = a.shape, b.shape[0]
    return lib.mlxlis_skinny_gemm(
        m,
        n,
        k,
        alpha,
        ptr(a),
        a.strides[0] // 4,
        ptr(b),
        b.strides[0] // 4,
        beta,
        ptr(c),
        c.strides[0] // 4,
    )


@needs_kernel
def test_batch_kernel_wide_leading_dimensions(lib):
    """Rows read and written through leading dimensions wider than k and n (the columns
    beyond the product stay untouched)."""
    a_full, b_full, c_full = r(6, 70), r(29, 90), r(6, 40)
    a, b, c = a_full[:, :61], b_full[:, :61], c_full[:, :29]
    before = c_full.copy()
    assert kernel_call(lib, a, b, c, alpha=1.5, beta=-0.5) == 1
    want = 1.5 * (a.astype(np.float64) @ b.T.astype(np.float64)) - 0.5 * before[:, :29]
    bound = 1.5 * (np.abs(a).astype(np.float64) @ np.abs(b).T) + 0.5 * np.abs(before[:, :29])
    within_bound(c, want, bound, 61 + 1)
    assert np.array_equal(c_full[:, 29:], before[:, 29:])


SHARES = """
import ctypes, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_blas_dispatch import kernel_call, within_bound
from mlxlis.runtime import blas
lib = blas.state.dispatch
rng = np.random.default_rng(1)
# small products run on the calling thread; from 2**19 multiply-adds the pool shares them
for m, k, n in [(5, 33, 1), (3, 100, 200), (4, 576, 1536), (9, 300, 301), (16, 64, 1000)]:
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    def run():
        c = np.full((m, n), np.nan, np.float32)  # beta 0: never read
        assert kernel_call(lib, a, b, c) == 1
        within_bound(c, a.astype(np.float64) @ b.T.astype(np.float64),
                     np.abs(a).astype(np.float64) @ np.abs(b).T.astype(np.float64), k)
    for limit in (1, 2, 0):  # at most 1 or 2 of the pool's threads share it, then all again
        lib.mlxlis_skinny_set_threads(limit)
        run()
    if os.fork() == 0:  # the child has none of the parent's workers: it starts its own
        run()
        os._exit(0)
    assert os.wait()[1] == 0
print("ok")
"""


@needs_kernel
@pytest.mark.parametrize("threads", ["1", "3", "7"])
def test_batch_kernel_shares_and_fork(threads):
    """Shares of B's rows over 1, 3 or 7 threads (ragged shares for n = 301), with
    fewer of them taking a share (as ranks sharing a machine's cores set), before and after
    fork() (a child process builds its own pool)."""
    env = {**os.environ, "MLXLIS_SKINNY_THREADS": threads}
    res = subprocess.run(
        [sys.executable, "-c", SHARES, os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
