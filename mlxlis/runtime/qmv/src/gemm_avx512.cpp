// The prefill product on AVX-512 (M >= prefill_min_m rows of x), x86-64. Compiled with the
// AVX-512 flags and entered only after the runtime CPU check (compute.cpp); same rules as
// kernels_avx2.cpp: no headers with inline / template code shared with other TUs.
//
// out (M x N) = x (M x K) @ w.T with w dequantized kKc columns at a time into a buffer that
// stays in cache, never as a whole float copy. The BLAS route (dequantized tiles of ~8 MiB
// into sgemm) writes each weight as a float to memory and reads it back to pack it; at a
// prompt's 64 rows that was ~15% slower than the dense model's one sgemm. Here:
//  - x is packed once a call as panels of 64 rows, transposed (xt[k][64]: row 64·panel + j
//    in lane j; rows past M are zeros), so a k's 64 rows are 4 vector loads;
//  - a task's weight rows (a multiple of 24) are dequantized kKc columns at a time;
//  - a register tile of R weight rows × V vectors of x rows (R·V = 24 accumulators) sums
//    w[r, k] (broadcast) · xt[k] over the kKc columns, in k order, with FMA: each output is
//    one float32 dot product of length K summed in order, whatever the tiling or threads;
//  - the tiles accumulate transposed (ct[r][64]); out is written once, at the end.
#include <immintrin.h>
#include <string.h>

#include "kernels.h"

namespace qmv {

namespace {

constexpr int kP = kGemmPanel;  // x rows a panel (lanes of 4 vectors)

// ct[r][0..16V) += sum over k < kc of w[r·kKc + k] · xt[k·kP + 0..16V), r < R.
template <int V, int R>
inline void tile(const float* w, const float* xt, int kc, float* ct, bool first) {
  __m512 acc[R][V];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(ct + r * kP + 16 * v);
  for (int k = 0; k < kc; ++k) {
    __m512 xv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + size_t(k) * kP + 16 * v);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m512 wr = _mm512_set1_ps(w[r * kGemmKc + k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(wr, xv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(ct + r * kP + 16 * v, acc[r][v]);
}

// Every R-row tile of a panel's nbp rows over one block of kc columns.
template <int V, int R>
void panel(const float* wbuf, int nbp, const float* xt, int kc, float* ct, bool first) {
  for (int r0 = 0; r0 < nbp; r0 += R) tile<V, R>(wbuf + r0 * kGemmKc, xt, kc, ct + r0 * kP, first);
}

}  // namespace

size_t gemm_scratch_avx512(int M, int rows) {
  const size_t nbp = size_t(rows + 23) / 24 * 24, panels = size_t(M + kP - 1) / kP;
  return nbp * kGemmKc + panels * nbp * kP;
}

void pack_x_avx512(const float* x, int M, int K, int pi, int k0, int k1, float* xt) {
  // xt[k·kP + j] = x[(kP·pi + j)·K + k]: a row's 16 columns scattered down a lane
  float* dst = xt + size_t(pi) * K * kP;
  const int rows = M - kP * pi < kP ? M - kP * pi : kP;
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                            5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(kP));
  for (int j = 0; j < rows; ++j) {
    const float* xr = x + size_t(kP * pi + j) * K;
    for (int k = k0; k < k1; k += 16)  // K % 32 == 0
      _mm512_i32scatter_ps(dst + size_t(k) * kP + j, lanes, _mm512_loadu_ps(xr + k), 4);
  }
  for (int k = k0; k < k1; ++k)
    for (int j = rows; j < kP; ++j) dst[size_t(k) * kP + j] = 0.0f;
}

void gemm_avx512(const Problem& p, const float* xt, int n0, int n1, float* scratch) {
  const int nr = n1 - n0, nbp = (nr + 23) / 24 * 24, panels = (p.M + kP - 1) / kP;
  float* wbuf = scratch;               // nbp x kGemmKc: w's rows n0.., kc columns
  float* ct = wbuf + nbp * kGemmKc;    // panels x nbp x kP: out transposed
  memset(wbuf + size_t(nr) * kGemmKc, 0, size_t(nbp - nr) * kGemmKc * 4);  // rows past n1
  for (int k0 = 0; k0 < p.K; k0 += kGemmKc) {
    const int kc = p.K - k0 < kGemmKc ? p.K - k0 : kGemmKc;
    if (k0 + kc < p.K)  // the next block's x into L2 while this one is summed
      for (int pi = 0; pi < panels; ++pi) {
        const char* next = reinterpret_cast<const char*>(xt + (size_t(pi) * p.K + k0 + kc) * kP);
        const int lines = (p.K - k0 - kc < kGemmKc ? p.K - k0 - kc : kGemmKc) * kP * 4 / 64;
        for (int l = 0; l < lines; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
      }
    dequant_cols_avx2(p, n0, n1, k0 / 32, (k0 + kc) / 32, wbuf, kGemmKc);
    for (int pi = 0; pi < panels; ++pi) {
      const float* xp = xt + (size_t(pi) * p.K + k0) * kP;
      float* cp = ct + size_t(pi) * nbp * kP;
      const int rows = p.M - kP * pi, first = k0 == 0;
      // as many vectors as the panel has rows, 24 accumulators either way
      if (rows > 48) panel<4, 6>(wbuf, nbp, xp, kc, cp, first);
      else if (rows > 32) panel<3, 8>(wbuf, nbp, xp, kc, cp, first);
      else if (rows > 16) panel<2, 12>(wbuf, nbp, xp, kc, cp, first);
      else panel<1, 24>(wbuf, nbp, xp, kc, cp, first);
    }
  }
  for (int pi = 0; pi < panels; ++pi) {
    const int rows = p.M - kP * pi < kP ? p.M - kP * pi : kP;
    const float* cp = ct + size_t(pi) * nbp * kP;
    for (int j = 0; j < rows; ++j) {
      float* o = p.out + size_t(kP * pi + j) * p.N + n0;
      for (int r = 0; r < nr; ++r) o[r] = cp[r * kP + j];
    }
  }
}

}  // namespace qmv
