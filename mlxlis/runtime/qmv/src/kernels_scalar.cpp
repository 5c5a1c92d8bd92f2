// Portable kernels: the reference for the SIMD ones and the fallback on CPUs
// without AVX2/FMA (or NEON). Same summation structure as the SIMD kernels:
// per group, sum_k q*x, then * scale, plus bias * sum_k x (precomputed).
#include <string.h>

#include "kernels.h"

namespace qmv {

namespace {

// The 32 codes of one chunk (`bits` words) as floats.
inline void unpack_chunk(const uint32_t* w, int bits, float* q) {
  const uint32_t mask = (1u << bits) - 1;
  for (int j = 0; j < 32; ++j) {
    int pos = j * bits, word = pos >> 5, off = pos & 31;
    uint32_t v = w[word] >> off;
    if (off + bits > 32) v |= w[word + 1] << (32 - off);  // spills into next word
    q[j] = float(v & mask);
  }
}

}  // namespace

void rows_scalar(const Problem& p, int m0, int mb, int n0, int n1) {
  const int K = p.K, G = K / p.group, cpg = p.group / 32;
  const size_t wpr = size_t(K) * p.bits / 32;  // words per row
  float q[32];
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wrow = p.wq + size_t(n) * wpr;
    float acc[kMaxMB] = {0, 0, 0, 0};
    for (int g = 0; g < G; ++g) {
      float t[kMaxMB] = {0, 0, 0, 0};
      for (int c = 0; c < cpg; ++c) {
        int chunk = g * cpg + c;
        unpack_chunk(wrow + size_t(chunk) * p.bits, p.bits, q);
        for (int m = 0; m < mb; ++m) {
          const float* xk = p.x + size_t(m0 + m) * K + chunk * 32;
          for (int j = 0; j < 32; ++j) t[m] += q[j] * xk[j];
        }
      }
      float s = sb_load(p.scales, p.sb_type, size_t(n) * G + g);
      float b = sb_load(p.biases, p.sb_type, size_t(n) * G + g);
      for (int m = 0; m < mb; ++m)
        acc[m] += t[m] * s + b * p.xsum[size_t(m0 + m) * G + g];
    }
    for (int m = 0; m < mb; ++m) p.out[size_t(m0 + m) * p.N + n] = acc[m];
  }
}

void dequant_scalar(const Problem& p, int n0, int n1, float* dst) {
  const int K = p.K, G = K / p.group, cpg = p.group / 32;
  const size_t wpr = size_t(K) * p.bits / 32;
  float q[32];
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wrow = p.wq + size_t(n) * wpr;
    float* d = dst + size_t(n - n0) * K;
    for (int chunk = 0; chunk < K / 32; ++chunk) {
      int g = chunk / cpg;
      float s = sb_load(p.scales, p.sb_type, size_t(n) * G + g);
      float b = sb_load(p.biases, p.sb_type, size_t(n) * G + g);
      unpack_chunk(wrow + size_t(chunk) * p.bits, p.bits, q);
      for (int j = 0; j < 32; ++j) d[chunk * 32 + j] = s * q[j] + b;
    }
  }
}

}  // namespace qmv
