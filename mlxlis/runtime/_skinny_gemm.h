/* C (m x n) = alpha A (m x k) B^T + beta C, row-major, B stored n x k (see _skinny_gemm.c) */
#ifndef MLXLIS_SKINNY_GEMM_H
#define MLXLIS_SKINNY_GEMM_H

/* whether this CPU runs the kernel (AVX2 + FMA) */
int mlxlis_skinny_supported(void);

/* use at most n threads (n < 1: one per online CPU, or MLXLIS_SKINNY_THREADS) */
void mlxlis_skinny_set_threads(int n);

/* 1 when done; 0 when not taken (no AVX2 + FMA here, or another product is running):
 * the caller uses sgemm */
int mlxlis_skinny_gemm(int m, int n, int k, float alpha, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc);

#endif
