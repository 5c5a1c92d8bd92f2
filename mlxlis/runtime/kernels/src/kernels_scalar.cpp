// Portable kernels: the reference for the SIMD ones and the fallback on CPUs
// without AVX2/FMA (or NEON). Same summation structure as the SIMD kernels:
// per group, sum_k q*x, then * scale, plus bias * sum_k x (precomputed). Written for
// clarity (a code at a time), not speed.
#include <string.h>

#include "kernels.h"

namespace qmv {

namespace {

// Code k of a row (its bit stream: code k at bit k * bits, little-endian words).
inline float code_at(const uint32_t* w, int k, int bits) {
  const int pos = k * bits, word = pos >> 5, off = pos & 31;
  uint32_t v = w[word] >> off;
  if (off + bits > 32) v |= w[word + 1] << (32 - off);  // spills into the next word
  return float(v & ((1u << bits) - 1));
}

}  // namespace

// Any group size dividing K (16 included: the 16-element sub-blocks of Q6_K).
void rows_scalar(const Problem& p, int m0, int mb, int n0, int n1) {
  const int K = p.K, G = K / p.group;
  const size_t wpr = size_t(K) * p.bits / 32;  // words per row
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wrow = p.wq + size_t(n) * wpr;
    float acc[kMaxMB] = {0, 0, 0, 0};
    for (int g = 0; g < G; ++g) {
      float t[kMaxMB] = {0, 0, 0, 0};
      for (int k = g * p.group; k < (g + 1) * p.group; ++k) {
        const float q = code_at(wrow, k, p.bits);
        for (int m = 0; m < mb; ++m) t[m] += q * p.x[size_t(m0 + m) * K + k];
      }
      float s = scale_of(p, size_t(n) * G + g);
      float b = bias_of(p, size_t(n) * G + g, s);
      for (int m = 0; m < mb; ++m)
        acc[m] += t[m] * s + b * p.xsum[size_t(m0 + m) * G + g];
    }
    for (int m = 0; m < mb; ++m) p.out[size_t(m0 + m) * p.N + n] = acc[m];
  }
}

void dequant_scalar(const Problem& p, int n0, int n1, float* dst) {
  const int K = p.K, G = K / p.group;
  const size_t wpr = size_t(K) * p.bits / 32;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wrow = p.wq + size_t(n) * wpr;
    float* d = dst + size_t(n - n0) * K;
    for (int k = 0; k < K; ++k) {
      const size_t gi = size_t(n) * G + k / p.group;
      const float s = scale_of(p, gi);
      d[k] = s * code_at(wrow, k, p.bits) + bias_of(p, gi, s);
    }
  }
}

}  // namespace qmv
