// NEON kernels (arm64; NEON is baseline there, so no runtime check).
// UNTESTED on hardware: written to mirror kernels_avx2.cpp (same sub-block
// scheme, same summation order per lane); only compile-checked, if at all (see
// README). Built only when __aarch64__ is defined.
#if defined(__aarch64__)
#include <arm_neon.h>
#include <string.h>

#include "kernels.h"

namespace qmv {

namespace {

// Codes j*8 .. j*8+7 of the 32-code chunk at c (4*B bytes) as two float32x4.
template <int B>
inline void codes8(const uint8_t* c, int j, float32x4_t& lo, float32x4_t& hi) {
  if constexpr (B == 8) {
    uint16x8_t h = vmovl_u8(vld1_u8(c + 8 * j));
    lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(h)));
    hi = vcvtq_f32_u32(vmovl_u16(vget_high_u16(h)));
  } else if constexpr (B <= 4) {
    // 8 codes fit in one 32-bit load; vshlq by a negative count shifts right
    int start = j * B;
    if (start > 4 * B - 4) start = 4 * B - 4;
    const int base = (j * B - start) * 8;
    uint32_t u;
    memcpy(&u, c + start, 4);
    const uint32x4_t v = vdupq_n_u32(u), mask = vdupq_n_u32((1u << B) - 1);
    const int32_t s0[4] = {-(base + 0 * B), -(base + 1 * B), -(base + 2 * B), -(base + 3 * B)};
    const int32_t s1[4] = {-(base + 4 * B), -(base + 5 * B), -(base + 6 * B), -(base + 7 * B)};
    lo = vcvtq_f32_u32(vandq_u32(vshlq_u32(v, vld1q_s32(s0)), mask));
    hi = vcvtq_f32_u32(vandq_u32(vshlq_u32(v, vld1q_s32(s1)), mask));
  } else {
    // bits 5, 6: one 64-bit load, codes extracted with scalar shifts
    int start = j * B;
    if (start > 4 * B - 8) start = 4 * B - 8;
    const int base = (j * B - start) * 8;
    uint64_t u;
    memcpy(&u, c + start, 8);
    uint32_t q[8];
    for (int i = 0; i < 8; ++i) q[i] = uint32_t(u >> (base + i * B)) & ((1u << B) - 1);
    lo = vcvtq_f32_u32(vld1q_u32(q));
    hi = vcvtq_f32_u32(vld1q_u32(q + 4));
  }
}

template <int B, int MB>
void rows(const Problem& p, int m0, int n0, int n1) {
  const int K = p.K, G = K / p.group, cpg = p.group / 32;
  const size_t row_bytes = size_t(K) * B / 8;
  const float* x0 = p.x + size_t(m0) * K;
  const float* xs0 = p.xsum + size_t(m0) * G;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = reinterpret_cast<const uint8_t*>(p.wq) + size_t(n) * row_bytes;
    float32x4_t acc[MB][2];
    float bsum[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m][0] = acc[m][1] = vdupq_n_f32(0.0f);
      bsum[m] = 0.0f;
    }
    for (int g = 0; g < G; ++g) {
      float32x4_t t[MB][2];
      for (int m = 0; m < MB; ++m) t[m][0] = t[m][1] = vdupq_n_f32(0.0f);
      for (int c = 0; c < cpg; ++c) {
        const int chunk = g * cpg + c;
        const uint8_t* cp = wrow + size_t(chunk) * 4 * B;
        const float* xk = x0 + chunk * 32;
        for (int j = 0; j < 4; ++j) {
          float32x4_t lo, hi;
          codes8<B>(cp, j, lo, hi);
          for (int m = 0; m < MB; ++m) {
            const float* xm = xk + size_t(m) * K + 8 * j;
            t[m][0] = vfmaq_f32(t[m][0], lo, vld1q_f32(xm));
            t[m][1] = vfmaq_f32(t[m][1], hi, vld1q_f32(xm + 4));
          }
        }
      }
      const size_t gi = size_t(n) * G + g;
      const float s = sb_load(p.scales, p.sb_type, gi);
      const float b = sb_load(p.biases, p.sb_type, gi);
      for (int m = 0; m < MB; ++m) {
        acc[m][0] = vfmaq_n_f32(acc[m][0], t[m][0], s);
        acc[m][1] = vfmaq_n_f32(acc[m][1], t[m][1], s);
        bsum[m] += b * xs0[size_t(m) * G + g];
      }
    }
    for (int m = 0; m < MB; ++m)
      p.out[size_t(m0 + m) * p.N + n] = vaddvq_f32(vaddq_f32(acc[m][0], acc[m][1])) + bsum[m];
  }
}

template <int B>
void rows_b(const Problem& p, int m0, int mb, int n0, int n1) {
  switch (mb) {
    case 1: return rows<B, 1>(p, m0, n0, n1);
    case 2: return rows<B, 2>(p, m0, n0, n1);
    case 3: return rows<B, 3>(p, m0, n0, n1);
    default: return rows<B, 4>(p, m0, n0, n1);
  }
}

template <int B>
void dequant(const Problem& p, int n0, int n1, float* dst) {
  const int K = p.K, G = K / p.group, cpg = p.group / 32;
  const size_t row_bytes = size_t(K) * B / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = reinterpret_cast<const uint8_t*>(p.wq) + size_t(n) * row_bytes;
    float* d = dst + size_t(n - n0) * K;
    for (int chunk = 0; chunk < K / 32; ++chunk) {
      const size_t gi = size_t(n) * G + chunk / cpg;
      const float32x4_t s = vdupq_n_f32(sb_load(p.scales, p.sb_type, gi));
      const float32x4_t b = vdupq_n_f32(sb_load(p.biases, p.sb_type, gi));
      for (int j = 0; j < 4; ++j) {
        float32x4_t lo, hi;
        codes8<B>(wrow + size_t(chunk) * 4 * B, j, lo, hi);
        vst1q_f32(d + chunk * 32 + 8 * j, vfmaq_f32(b, lo, s));
        vst1q_f32(d + chunk * 32 + 8 * j + 4, vfmaq_f32(b, hi, s));
      }
    }
  }
}

}  // namespace

void rows_neon(const Problem& p, int m0, int mb, int n0, int n1) {
  switch (p.bits) {
    case 2: return rows_b<2>(p, m0, mb, n0, n1);
    case 3: return rows_b<3>(p, m0, mb, n0, n1);
    case 4: return rows_b<4>(p, m0, mb, n0, n1);
    case 5: return rows_b<5>(p, m0, mb, n0, n1);
    case 6: return rows_b<6>(p, m0, mb, n0, n1);
    default: return rows_b<8>(p, m0, mb, n0, n1);
  }
}

void dequant_neon(const Problem& p, int n0, int n1, float* dst) {
  switch (p.bits) {
    case 2: return dequant<2>(p, n0, n1, dst);
    case 3: return dequant<3>(p, n0, n1, dst);
    case 4: return dequant<4>(p, n0, n1, dst);
    case 5: return dequant<5>(p, n0, n1, dst);
    case 6: return dequant<6>(p, n0, n1, dst);
    default: return dequant<8>(p, n0, n1, dst);
  }
}

}  // namespace qmv
#endif  // __aarch64__
