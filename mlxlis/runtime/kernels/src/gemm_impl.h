// The prompt product (M >= the prefill threshold rows of x) for one vector width: included by
// gemm_avx512.cpp and gemm_avx2.cpp, each compiled for its ISA and entered only after the
// runtime CPU check (compute.cpp). Everything here has internal linkage (an anonymous
// namespace), so no instantiation is shared between the two: see kernels.h.
//
// out (M x N) = x (M x K) @ w.T with w dequantized kGemmKc columns at a time into a buffer that
// stays in cache, never as a whole float copy. The BLAS route (dequantized tiles of ~8 MiB
// into sgemm) writes each weight as a float to memory and reads it back to pack it; at a
// prompt's 64 rows that was ~15% slower than the dense model's one sgemm. Here:
//  - x is packed once a call as panels of P rows, transposed (xt[k][P]: row P·panel + j in
//    lane j; rows past M are zeros), so a k's rows are P / W vector loads;
//  - a task (some of w's rows, a multiple of 24, by a group of x's panels: compute.cpp) has
//    its weight rows dequantized kGemmKc columns at a time (Vec::dequant);
//  - a register tile of R weight rows × V vectors of x rows (R·V = Vec::kAcc accumulators)
//    sums w[r, k] (broadcast) · xt[k] over the block's columns, in k order, with FMA, and
//    adds that to the sums of the blocks before: each output the same float32 sums in the
//    same order whatever the tiling, the tasks, the threads or the vector width;
//  - the tiles accumulate transposed (ct[r][P]); out is written once, at the end, transposed
//    back W x W in registers.
#pragma once

#include <immintrin.h>
#include <string.h>

#include "kernels.h"

namespace qmv {

namespace {

constexpr int kRowsMultiple = 24;  // a task's rows are padded to this: every tile's R divides it

// ct[r][0..W·V) (+)= the sum over k < kc of w[r·kGemmKc + k] · xt[k·P + 0..W·V), r < R: a
// block's sum on its own, then added (blocked summation: rounding grows with 128 + K / 128
// terms, not with K, as BLAS's blocked sums do).
template <class Vec, int V, int R>
inline void tile(const float* w, const float* xt, int kc, float* ct, bool first) {
  constexpr int P = Vec::P, W = Vec::W;
  typename Vec::T acc[R][V];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = Vec::zero();
  for (int k = 0; k < kc; ++k) {
    typename Vec::T xv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) xv[v] = Vec::load(xt + size_t(k) * P + W * v);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const typename Vec::T wr = Vec::set1(w[r * kGemmKc + k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = Vec::fma(wr, xv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      float* c = ct + r * P + W * v;
      Vec::store(c, first ? acc[r][v] : Vec::add(Vec::load(c), acc[r][v]));
    }
}

// Every tile of a panel's nbp rows over one block of kc columns: V vectors (as many as the
// panel's rows need), R = kAcc / V weight rows a tile.
template <class Vec, int V>
void panel(const float* wbuf, int nbp, const float* xt, int kc, float* ct, bool first) {
  constexpr int R = Vec::kAcc / V;
  static_assert(kRowsMultiple % R == 0, "a tile's rows must divide a task's padding");
  for (int r0 = 0; r0 < nbp; r0 += R)
    tile<Vec, V, R>(wbuf + r0 * kGemmKc, xt, kc, ct + r0 * Vec::P, first);
}

template <class Vec>
size_t gemm_scratch(int panels, int rows) {
  const size_t nbp = size_t(rows + kRowsMultiple - 1) / kRowsMultiple * kRowsMultiple;
  return nbp * kGemmKc + size_t(panels) * nbp * Vec::P;
}

// Panel pi's columns k0..k1 (multiples of 16) of x, transposed into xt: W rows at a time
// (Vec::transpose: a W x W block transposed in registers; rows past M as zeros).
template <class Vec>
void pack_x(const float* x, int M, int K, int pi, int k0, int k1, float* xt) {
  constexpr int P = Vec::P, W = Vec::W;
  float* dst = xt + (size_t(pi) * K + k0) * P;
  for (int j0 = 0; j0 < P; j0 += W) {
    const int left = M - P * pi - j0, rows = left < 0 ? 0 : left < W ? left : W;
    Vec::transpose(rows ? x + size_t(P * pi + j0) * K + k0 : x, K, rows, dst + j0, P, k1 - k0);
  }
}

// out[j·N + r] = ct[r·P + j] for a panel's rows j < rows and a task's weight rows r < nr, W x W
// blocks transposed in registers; an edge block (fewer than W of either) through a buffer, so
// nothing past row `rows` or column nr is written.
template <class Vec>
void unpack_out(const float* ct, int nr, int rows, float* out, size_t N) {
  constexpr int P = Vec::P, W = Vec::W;
  for (int r0 = 0; r0 < nr; r0 += W) {
    const int nw = nr - r0 < W ? nr - r0 : W;
    for (int j0 = 0; j0 < rows; j0 += W) {
      const float* src = ct + r0 * P + j0;
      if (nw == W && j0 + W <= rows) {
        Vec::transpose(src, P, W, out + j0 * N + r0, N, W);
        continue;
      }
      alignas(64) float edge[W * W];
      Vec::transpose(src, P, nw, edge, W, W);
      for (int j = 0; j < W && j0 + j < rows; ++j)
        memcpy(out + (j0 + j) * N + r0, edge + j * W, size_t(nw) * 4);
    }
  }
}

// out[P·pa.., n0..n1): x's panels pa..pb by w's rows n0..n1
template <class Vec>
void gemm(const Problem& p, const float* xt, int n0, int n1, int pa, int pb, float* scratch) {
  constexpr int P = Vec::P, W = Vec::W;
  const int nr = n1 - n0, nbp = (nr + kRowsMultiple - 1) / kRowsMultiple * kRowsMultiple;
  float* wbuf = scratch;             // nbp x kGemmKc: w's rows n0.., kc columns
  float* ct = wbuf + nbp * kGemmKc;  // (pb - pa) x nbp x P: out transposed
  memset(wbuf + size_t(nr) * kGemmKc, 0, size_t(nbp - nr) * kGemmKc * 4);  // rows past n1
  for (int k0 = 0; k0 < p.K; k0 += kGemmKc) {
    const int kc = p.K - k0 < kGemmKc ? p.K - k0 : kGemmKc;
    Vec::dequant(p, n0, n1, k0 / 32, (k0 + kc) / 32, wbuf, kGemmKc);
    for (int pi = pa; pi < pb; ++pi) {
      const float* xp = xt + (size_t(pi) * p.K + k0) * P;
      float* cp = ct + size_t(pi - pa) * nbp * P;
      const int rows = p.M - P * pi, first = k0 == 0;
      // as many vectors as the panel has rows, kAcc accumulators either way
      const int vecs = rows >= P ? P / W : (rows + W - 1) / W;
      if constexpr (P / W == 4) {
        if (vecs == 4) {
          panel<Vec, 4>(wbuf, nbp, xp, kc, cp, first);
          continue;
        }
      }
      if (vecs == 3) panel<Vec, 3>(wbuf, nbp, xp, kc, cp, first);
      else if (vecs == 2) panel<Vec, 2>(wbuf, nbp, xp, kc, cp, first);
      else panel<Vec, 1>(wbuf, nbp, xp, kc, cp, first);
    }
  }
  for (int pi = pa; pi < pb; ++pi) {
    const int rows = p.M - P * pi < P ? p.M - P * pi : P;
    unpack_out<Vec>(ct + size_t(pi - pa) * nbp * P, nr, rows, p.out + size_t(P * pi) * p.N + n0,
                    p.N);
  }
}

}  // namespace

}  // namespace qmv
