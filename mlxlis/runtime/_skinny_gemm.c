/*
 * Products of a few rows by a weight matrix, C (m x n) = A (m x k) B^T with B stored n x k:
 * the projections of a batched decoding step (m = the number of sequences, 2..16).
 *
 * OpenBLAS's sgemm packs the whole of B into a buffer of its own on every call, whatever m is:
 * for 2 to 16 rows that costs ~2.7x the matrix-vector product (sgemv) of one row, so a step
 * of 8 sequences took ~3x a step of one on a 2-core x86 machine. Here each thread streams its
 * share of B's rows once, straight from the weights, and each 8-float slice of a row meets
 * every row of A (A is small and stays in cache): the weights are read once for the whole
 * batch, as sgemv reads them for one row. AVX2 + FMA only (checked at run time); anything else
 * returns 0 and the caller goes to sgemm. Written here because no BLAS on PyPI has such a path
 * for these shapes (MKL's packed sgemm would, but is x86-only and far too large a dependency).
 *
 * The work is split by B's rows over a small pool of threads (one per online CPU, or
 * MLXLIS_SKINNY_THREADS); one product runs at a time and a concurrent caller gets 0 (sgemm).
 */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "_skinny_gemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_KERNEL 1
#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE inline __attribute__((always_inline))
#else
#define HAVE_KERNEL 0
#endif

enum { MAX_THREADS = 64, MT = 4, JT = 3 }; /* a tile: MT rows of A by JT rows of B */

/* products smaller than this (multiply-adds) run on the calling thread alone: waking the pool
 * costs more than they do (a batched step's attention scores: 3 x 64 x ~100 per head group) */
#define POOL_MIN_WORK (1L << 19)

typedef struct {
    const float *a, *b;
    float *c;
    int m, n, k, lda, ldb, ldc;
    float alpha, beta;
} job_t;

#if HAVE_KERNEL
static INLINE AVX2 float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* C[i0 .. i0+mt) x [j0 .. j0+jt): dot products along k; mt <= MT and jt <= JT are constants
 * at each call site, so the loops unroll and the 12 sums stay in registers (AVX-512's wider
 * vectors measured slower here: their horizontal sums cost more than they save) */
static INLINE AVX2 void tile(const job_t *p, int i0, int j0, int mt, int jt) {
    __m256 acc[MT][JT];
    const float *a = p->a + (long)i0 * p->lda, *b = p->b + (long)j0 * p->ldb;
    const int k8 = p->k & ~7;
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++)
#pragma GCC unroll 3
        for (int j = 0; j < jt; j++) acc[i][j] = _mm256_setzero_ps();
    for (int kk = 0; kk < k8; kk += 8) {
        __m256 bv[JT];
#pragma GCC unroll 3
        for (int j = 0; j < jt; j++) bv[j] = _mm256_loadu_ps(b + (long)j * p->ldb + kk);
#pragma GCC unroll 4
        for (int i = 0; i < mt; i++) {
            __m256 av = _mm256_loadu_ps(a + (long)i * p->lda + kk);
#pragma GCC unroll 3
            for (int j = 0; j < jt; j++) acc[i][j] = _mm256_fmadd_ps(av, bv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) {
#pragma GCC unroll 3
        for (int j = 0; j < jt; j++) {
            const float *ar = a + (long)i * p->lda, *br = b + (long)j * p->ldb;
            float s = hsum(acc[i][j]);
            for (int kk = k8; kk < p->k; kk++) s += ar[kk] * br[kk];
            float *out = p->c + (long)(i0 + i) * p->ldc + j0 + j;
            *out = p->alpha * s + (p->beta == 0.0f ? 0.0f : p->beta * *out);
        }
    }
}

/* every row of A against B's rows [j_lo, j_hi) */
static AVX2 void rows(const job_t *p, int j_lo, int j_hi) {
    int j = j_lo;
    for (; j + JT <= j_hi; j += JT) {
        int i = 0;
        for (; i + MT <= p->m; i += MT) tile(p, i, j, MT, JT);
        switch (p->m - i) {
        case 3: tile(p, i, j, 3, JT); break;
        case 2: tile(p, i, j, 2, JT); break;
        case 1: tile(p, i, j, 1, JT); break;
        }
    }
    for (; j < j_hi; j++) {
        int i = 0;
        for (; i + MT <= p->m; i += MT) tile(p, i, j, MT, 1);
        for (; i < p->m; i++) tile(p, i, j, 1, 1);
    }
}
#endif

/* --- the pool: worker t (1..threads-1) takes share t of B's rows, the caller share 0 --- */
static job_t job;
static int threads, started, pending;
static int limit; /* at most this many threads take a share (0: all); set_threads */
static int sharing; /* threads taking a share of the current product */
static unsigned long generation;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER; /* one product at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t go = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;

static void share(int t) {
#if HAVE_KERNEL
    if (t >= sharing) return;
    /* shares of whole tiles, so only the last one has a ragged end */
    long tiles = (job.n + JT - 1) / JT;
    int lo = (int)(tiles * t / sharing) * JT, hi = (int)(tiles * (t + 1) / sharing) * JT;
    if (hi > job.n) hi = job.n;
    if (lo < hi) rows(&job, lo, hi);
#else
    (void)t;
#endif
}

static void *worker(void *arg) {
    int t = (int)(long)arg;
    unsigned long seen = 0;
    for (;;) {
        pthread_mutex_lock(&mu);
        while (generation == seen) pthread_cond_wait(&go, &mu);
        seen = generation;
        pthread_mutex_unlock(&mu);
        share(t);
        pthread_mutex_lock(&mu);
        if (--pending == 0) pthread_cond_signal(&done);
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

/* a child of fork() has none of the workers: it starts its own pool when it needs one */
static void after_fork_child(void) {
    pthread_mutex_init(&busy, NULL);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&go, NULL);
    pthread_cond_init(&done, NULL);
    started = 0;
    generation = 0;
}

static int start_pool(void) {
    static int atfork;
    if (!atfork) atfork = pthread_atfork(NULL, NULL, after_fork_child) == 0;
    const char *env = getenv("MLXLIS_SKINNY_THREADS");
    long want = env && *env ? atol(env) : sysconf(_SC_NPROCESSORS_ONLN);
    threads = want < 1 ? 1 : want > MAX_THREADS ? MAX_THREADS : (int)want;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int t = 1; t < threads; t++) {
        pthread_t id;
        if (pthread_create(&id, &attr, worker, (void *)(long)t) != 0) threads = t;
    }
    pthread_attr_destroy(&attr);
    started = 1;
    return 1;
}

/* Use at most n threads (n < 1: every one), as the BLAS is told when several processes
 * share a machine's cores (ranks of a pipeline on one host) */
void mlxlis_skinny_set_threads(int n) { __atomic_store_n(&limit, n, __ATOMIC_RELAXED); }

static int supported; /* set by mlxlis_skinny_supported: the kernel may run here */

int mlxlis_skinny_supported(void) {
#if HAVE_KERNEL
    __builtin_cpu_init();
    supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return supported;
#else
    return 0;
#endif
}

int mlxlis_skinny_gemm(int m, int n, int k, float alpha, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc) {
    if (!supported) return 0; /* not checked, or no AVX2 + FMA on this CPU */
    if (pthread_mutex_trylock(&busy) != 0) return 0; /* another thread's product is running */
    if (!started) start_pool();
    job = (job_t){a, b, c, m, n, k, lda, ldb, ldc, alpha, beta};
    sharing = limit > 0 && limit < threads ? limit : threads;
    if ((long)m * n * k < POOL_MIN_WORK) sharing = 1;
    if (sharing > 1) {
        pthread_mutex_lock(&mu);
        pending = threads - 1;
        generation++;
        pthread_cond_broadcast(&go);
        pthread_mutex_unlock(&mu);
    }
    share(0);
    if (sharing > 1) {
        pthread_mutex_lock(&mu);
        while (pending) pthread_cond_wait(&done, &mu);
        pthread_mutex_unlock(&mu);
    }
    pthread_mutex_unlock(&busy);
    return 1;
}
