/*
 * Matrix-vector products through BLAS gemv on Linux CPUs.
 *
 * MLX's CPU backend sends every float32 matmul to cblas_sgemm, including the M = 1 products
 * of decoding (one token times a weight matrix). OpenBLAS before 0.3.27 runs those through
 * its general kernel, which packs the whole weight matrix first: on a 2-core x86 machine the
 * 30 layers of a 135M model streamed at 9.8 GB/s that way and at 21 GB/s through sgemv.
 * (Newer OpenBLAS builds forward such calls themselves; this does the same for any.)
 *
 * Loaded with RTLD_GLOBAL before mlx.core (mlxlis/blas.py), so MLX's cblas_sgemm resolves
 * here; mlxlis_blas_init hands over the real sgemm and sgemv (a system OpenBLAS's, or the
 * scipy-openblas32 wheel's scipy_cblas_* ones, whose prefixed names MLX cannot reach itself).
 * Products with M = 1 or N = 1 go to sgemv; those of 2..SKINNY_MAX rows by a weight matrix
 * stored (n, k) to the skinny kernel (_skinny_gemm.c); everything else to sgemm unchanged.
 * No Python API: loaded with ctypes.
 */
#include <dlfcn.h>

#include "_skinny_gemm.h"

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static long gemv_calls, skinny_calls; /* products sent to sgemv / the kernel (for tests) */
static int skinny; /* the skinny kernel is on */

enum { SKINNY_MAX = 16 }; /* from 17 rows up sgemm's packing pays for itself */

/* sgemv NULL: no routing at all; skinny 0: none to the skinny kernel */
void mlxlis_blas_init(void *sgemm, void *sgemv, int want_skinny) {
    real_sgemm = (sgemm_fn)sgemm;
    real_sgemv = (sgemv_fn)sgemv;
    skinny = sgemv && want_skinny && mlxlis_skinny_supported();
}

long mlxlis_gemv_calls(void) { return __atomic_load_n(&gemv_calls, __ATOMIC_RELAXED); }

long mlxlis_skinny_calls(void) { return __atomic_load_n(&skinny_calls, __ATOMIC_RELAXED); }

int mlxlis_skinny_on(void) { return skinny; }

static int max1(int n) { return n > 1 ? n : 1; }

/* y = alpha * op(A) x + beta * y for a row-major A of rows x cols (leading dimension ld),
 * when ld is one BLAS accepts; returns 0 (and does nothing) otherwise. */
static int gemv(int trans, int rows, int cols, float alpha, const float *a, int ld,
                const float *x, int incx, float beta, float *y, int incy) {
    if (ld < max1(cols) || incx < 1 || incy < 1) return 0;
    if (beta == 0.0f) { /* y may be uninitialised memory: some sgemv builds scale NaN by 0 */
        int len = trans == NO_TRANS ? rows : cols;
        for (int i = 0; i < len; i++) y[(long)i * incy] = 0.0f;
    }
    real_sgemv(ROW_MAJOR, trans, rows, cols, alpha, a, ld, x, incx, beta, y, incy);
    __atomic_fetch_add(&gemv_calls, 1, __ATOMIC_RELAXED);
    return 1;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    if (!real_sgemm) { /* not initialised: the next library's sgemm, no dispatch */
        real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    }
    if (real_sgemv && order == ROW_MAJOR && m > 0 && n > 0 && k > 0) {
        /* C (1 x n) = a (1 x k) op(B): y = B x (B stored n x k) or B^T x (B stored k x n);
         * a is a row (step 1) or, transposed, a column (step lda). */
        if (m == 1 && (tb == NO_TRANS
                ? gemv(TRANS, k, n, alpha, b, ldb, a, ta == NO_TRANS ? 1 : lda, beta, c, 1)
                : gemv(NO_TRANS, n, k, alpha, b, ldb, a, ta == NO_TRANS ? 1 : lda, beta, c, 1)))
            return;
        /* C (m x 1, step ldc) = op(A) b: A stored m x k, or k x m when transposed. */
        if (n == 1 && (ta == NO_TRANS
                ? gemv(NO_TRANS, m, k, alpha, a, lda, b, tb == NO_TRANS ? ldb : 1, beta, c, ldc)
                : gemv(TRANS, k, m, alpha, a, lda, b, tb == NO_TRANS ? ldb : 1, beta, c, ldc)))
            return;
        /* C (m x n) = A (m x k, rows) B^T (B stored n x k): a batch of rows by a weight */
        if (skinny && m <= SKINNY_MAX && ta == NO_TRANS && tb == TRANS && lda >= k &&
            ldb >= k && ldc >= n &&
            mlxlis_skinny_gemm(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) {
            __atomic_fetch_add(&skinny_calls, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    real_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
