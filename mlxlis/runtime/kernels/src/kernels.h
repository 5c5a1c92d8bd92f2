// Plain-C++ interface of the quantized matrix-vector kernels (no MLX, no std
// templates), so that the ISA-specific translation units (kernels_avx2.cpp is
// compiled with -mavx2 -mfma -mf16c) share no inline code with the rest of the
// module: a std:: template instantiated there with AVX2 enabled could otherwise
// be picked by the linker for the whole library and fault on an older CPU.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace qmv {

// dtype of scales and biases. SB_U8 / SB_I8: a super-block format (GGUF's K-quants held as
// the file has them): the scale of a group is d·sc and its bias −dmin·m, sc the group's
// integer (uint8 / int8 scales), m its uint8 min (biases), d and dmin the float16 pair of its
// super-block of 256 weights (Problem.kd); each product is exact in float32 (11 x 8 bits).
enum ScaleType : int { SB_F32 = 0, SB_F16 = 1, SB_BF16 = 2, SB_U8 = 3, SB_I8 = 4 };

constexpr bool sb_super(int type) { return type == SB_U8 || type == SB_I8; }

// One product out (M x N) = x (M x K) @ w.T, w (N x K) in MLX's affine layout:
// row n of wq is the little-endian bit stream of its K codes (code k at bit
// k * bits), w[n, k] = scales[n, k / group] * q[n, k] + biases[n, k / group].
// All arrays are dense row-major. K % group == 0 and K % 32 == 0, so every 32 codes
// occupy exactly `bits` whole uint32 words ("a chunk"); group is 16 (two groups a
// chunk: Q6_K's sub-blocks), 32, 64 or 128. The NEON kernels take group >= 32 only
// (compute.cpp sends groups of 16 to the scalar ones there).
struct Problem {
  const float* x;      // M x K
  const float* xsum;   // M x G, G = K / group: sums of x over each group
  int M, N, K, group, bits;
  const uint32_t* wq;  // N x (K * bits / 32)
  const void* scales;  // N x G, of sb_type
  const void* biases;  // N x G, of sb_type; null: a symmetric format (bias_of)
  int sb_type;
  const uint16_t* kd;  // SB_U8 / SB_I8: N x K/256 x 2 float16 (d, dmin) of the super-blocks
  int gshift;          // SB_U8 / SB_I8: log2 of the groups a super-block (256 / group)
  float* out;          // M x N (ldo = N)
  // x as integers for the AVX-512 kernels (prep_x_avx512), per row and block of 64:
  const int8_t* xd;    // M x ceil(K/64) x 192: digits d2, d1, d0 (64 bytes each)
  const float* xe;     // M x ceil(K/64) x 16: 2^E of each lane of 4 x
  const float* xs4;    // M x ceil(K/64) x 16: each lane's sum of x
};

// out[m, n] for m in [m0, m0 + mb), n in [n0, n1); mb <= kMaxMB.
constexpr int kMaxMB = 4;
// groups of a row the AVX-512 kernels take in a super-block format (K <= 65536 at group 32)
constexpr int kMaxSuperGroups = 2048;
void rows_scalar(const Problem& p, int m0, int mb, int n0, int n1);
// rows n0..n1 of w, dequantized to float32 into dst ((n1 - n0) x K, ld K)
void dequant_scalar(const Problem& p, int n0, int n1, float* dst);

#if defined(__x86_64__) || defined(_M_X64)
void rows_avx2(const Problem& p, int m0, int mb, int n0, int n1);
void dequant_avx2(const Problem& p, int n0, int n1, float* dst);
// the 32-column chunks c0..c1 of rows n0..n1 of w into dst ((n1 - n0) x 32 (c1 - c0), ld ld)
void dequant_cols_avx2(const Problem& p, int n0, int n1, int c0, int c1, float* dst, int ld);
// The prompt product (gemm_impl.h) of each ISA: x packed as panels of kPanel* rows,
// transposed (pack_x_*: panel pi's columns k0..k1, multiples of 16, into xt, ceil(M / panel)
// x K x panel floats); then out's rows of panels pa..pb, columns n0..n1 by gemm_* with
// gemm_scratch_*(pb - pa, n1 - n0) floats of scratch of its own. w dequantized kGemmKc columns
// at a time.
constexpr int kGemmKc = 128, kPanelAvx512 = 64, kPanelAvx2 = 24;
void pack_x_avx512(const float* x, int M, int K, int pi, int k0, int k1, float* xt);
size_t gemm_scratch_avx512(int panels, int rows);
void gemm_avx512(const Problem& p, const float* xt, int n0, int n1, int pa, int pb, float* scratch);
void pack_x_avx2(const float* x, int M, int K, int pi, int k0, int k1, float* xt);
size_t gemm_scratch_avx2(int panels, int rows);
void gemm_avx2(const Problem& p, const float* xt, int n0, int n1, int pa, int pb, float* scratch);
void rows_avx512(const Problem& p, int m0, int mb, int n0, int n1);
// x (M x K) as rows_avx512 takes it
void prep_x_avx512(const float* x, int M, int K, int8_t* xd, float* xe, float* xs4);
#endif
#if defined(__aarch64__)
void rows_neon(const Problem& p, int m0, int mb, int n0, int n1);
void dequant_neon(const Problem& p, int n0, int n1, float* dst);
#endif

// Scale / bias element idx of an array of the given type, as float32.
static inline float sb_load(const void* base, int type, size_t idx) {
  if (type == SB_F32) return static_cast<const float*>(base)[idx];
  uint16_t h = static_cast<const uint16_t*>(base)[idx];
  uint32_t bits;
  if (type == SB_BF16) {
    bits = uint32_t(h) << 16;
  } else {  // IEEE half -> float, subnormals included
    uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) {
      bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
      bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3ff) << 13);
    }
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// A super-block format's integers of group idx (flat over rows): its scale sc and min m.
static inline float sub_scale(const Problem& p, size_t idx) {
  return p.sb_type == SB_U8 ? float(static_cast<const uint8_t*>(p.scales)[idx])
                            : float(static_cast<const int8_t*>(p.scales)[idx]);
}
static inline float sub_min(const Problem& p, size_t idx) {
  return float(static_cast<const uint8_t*>(p.biases)[idx]);
}

// The scale of group idx (flat over rows): stored, or d·sc (super-block formats).
static inline float scale_of(const Problem& p, size_t idx) {
  if (!sb_super(p.sb_type)) return sb_load(p.scales, p.sb_type, idx);
  return sb_load(p.kd, SB_F16, 2 * (idx >> p.gshift)) * sub_scale(p, idx);
}

// The bias of group idx whose scale is `scale`: the stored one, −dmin·m (super-block
// formats), or, without biases (a symmetric format: Q6_K, w = d·sc·(q − 32)),
// −2^(bits−1)·scale, exact.
static inline float bias_of(const Problem& p, size_t idx, float scale) {
  if (!p.biases) return -float(1 << (p.bits - 1)) * scale;
  if (!sb_super(p.sb_type)) return sb_load(p.biases, p.sb_type, idx);
  return -(sb_load(p.kd, SB_F16, 2 * (idx >> p.gshift) + 1) * sub_min(p, idx));
}

}  // namespace qmv
