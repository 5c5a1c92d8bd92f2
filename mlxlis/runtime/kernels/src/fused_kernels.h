// Plain-C++ loops behind the fused CPU primitives (fused.h): one pass over the data
// where MLX's CPU backend runs a chain of small operations (a RoPE was ~15 of them,
// ~135 us a call at decode). No MLX here; every array is float32 unless said.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>

// The loops of fused_kernels.cpp and fused_flash.cpp are compiled for the baseline x86-64 (this file must load on any CPU)
// and, with GCC, cloned for AVX2 and AVX-512 machines, the copy picked at load time by the
// CPU (ifunc): the attention of one query over a few hundred keys was ~8% of a decoding
// step in 4-wide SSE.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define QMV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QMV_CLONES
#endif

namespace qmv {

// A 4-D float32 view with element strides (the last one must be 1).
struct View4 {
  const float* p;
  int n[4];
  int64_t s[4];
  const float* row(int a, int b, int c) const { return p + a * s[0] + b * s[1] + c * s[2]; }
};

// out (rows x D, dense) = x * 1/sqrt(mean(x^2) + eps) * w  (w null: no weight)
void rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int D, float* out);

// RoPE of x (B, H, T, D) into out (dense), the first `dims` of each head turned:
// position of (b, t) = offsets[b or 0] + t, angle = (pos * scale) * inv[i],
// inv[i] = 1 / periods[i], or 1 / base^(2i / dims) (transformers' float32 formula).
// `traditional`: pairs (2i, 2i+1); else halves (i, i + dims/2).
struct RopeArgs {
  View4 x;
  int dims;
  bool traditional;
  float base, scale;
  const int32_t* offsets;  // B entries, or one (offset_count 1)
  int offset_count;
  const float* periods;    // dims/2 or null
  float* out;
};
void rope(const RopeArgs& a);

// Attention of few queries: q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)
// (H a multiple of Hkv), out (B, H, T, Dv) dense (or (B, T, H, Dv): heads_last). Scores (q * scale) . k, query t of
// a causal chunk sees keys [0, S - T + t]; mask (uint8, B or 1, T, S with strides)
// where 0 hides a key. Softmax in float32; probabilities times v.
struct AttendArgs {
  View4 q, k, v;
  float scale;
  bool causal;
  const uint8_t* mask;  // null: none
  int64_t mask_s[3];    // strides of (B, T, S); 0 broadcasts
  bool heads_last;      // out (B, T, H, Dv) (what the output projection reads) if set
  float* out;
};
void attend(const AttendArgs& a);

// The same attention for a chunk of many queries (a prompt being read; fused_flash.cpp):
// blocks of kQueryBlock query positions of one KV head's query heads against blocks of
// kKeyBlock keys, an online softmax (a running maximum and denominator per query, the
// output rescaled when the maximum grows), so no T x S scores are kept; the pool runs the
// (row, KV head, query block) items, the longest (the causal chunk's last) first.
constexpr int kQueryBlock = 16, kKeyBlock = 64;
constexpr int kFewQueries = 16;  // more queries than this take attend_blocks (nodes.py)
void attend_blocks(const AttendArgs& a);

// out = act(g) * u elementwise: act 0 silu (g / (1 + e^-g)), 1 gelu_tanh
// (g / (1 + e^(-2 sqrt(2/pi) (g + 0.044715 g^3)))).
void gated(const float* g, const float* u, int64_t n, int act, float* out);

// e^x in float32, Cody-Waite + the Cephes polynomial (as runtime/fastmath.py): within
// 1 ulp of float64 exp; below -86 gives 0, above ln(FLT_MAX) inf.
float exp_f32(float x);

// exp_f32's body, inlined where a loop of them is to be vectorised
inline float exp_inline(float x) {
  // branch-free like fastmath._exp_parts: clip, n = round(x log2 e), r = x - n ln2 (two
  // parts), e^r by the polynomial, times 2^(n-1) * 2 assembled in the exponent bits
  const float xc = std::min(std::max(x, -86.0f), 88.72284f);
  const float n = (xc * 1.4426950408889634f + 12582912.0f) - 12582912.0f;
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float m = (p * r * r + r + 1.0f) * 2.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 126) << 23;
  float two;
  memcpy(&two, &bits, 4);
  const float y = m * two;
  return x < -86.0f ? 0.0f : (x > 88.72284f ? INFINITY : (x != x ? x : y));
}

}  // namespace qmv
