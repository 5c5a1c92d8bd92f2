// Plain-C++ loops behind the fused CPU primitives (fused.h): one pass over the data
// where MLX's CPU backend runs a chain of small operations (a RoPE was ~15 of them,
// ~135 us a call at decode). No MLX here; every array is float32 unless said.
#pragma once

#include <stddef.h>
#include <stdint.h>

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

// out = act(g) * u elementwise: act 0 silu (g / (1 + e^-g)), 1 gelu_tanh
// (g / (1 + e^(-2 sqrt(2/pi) (g + 0.044715 g^3)))).
void gated(const float* g, const float* u, int64_t n, int act, float* out);

// e^x in float32, Cody-Waite + the Cephes polynomial (as runtime/fastmath.py): within
// 1 ulp of float64 exp; below -86 gives 0, above ln(FLT_MAX) inf.
float exp_f32(float x);

}  // namespace qmv
