// The prompt product on AVX-512 (gemm_impl.h): panels of 64 rows of x (4 vectors), 24
// accumulators a tile (6-24 weight rows). Compiled with the AVX-512 flags.
#include "gemm_impl.h"

namespace qmv {

namespace {

// Where code 16h + i of a chunk of 32 (bits B, code j at bit j·B of the chunk's bytes) lies:
// its two bytes brought to lane i's low half (vpermb), then a shift. Past the code: byte 63,
// a zero of the chunk's masked load (a chunk is at most 32 bytes).
template <int B>
struct Unpack {
  alignas(64) uint8_t idx[2][64];
  alignas(64) uint32_t shift[2][16];
};

template <int B>
constexpr Unpack<B> make_unpack() {
  Unpack<B> u{};
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 16; ++i) {
      const int bit = (16 * h + i) * B, byte = bit >> 3;
      u.idx[h][4 * i] = uint8_t(byte);
      u.idx[h][4 * i + 1] = uint8_t(byte + 1 < 4 * B ? byte + 1 : 63);
      u.idx[h][4 * i + 2] = u.idx[h][4 * i + 3] = 63;
      u.shift[h][i] = uint32_t(bit & 7);
    }
  return u;
}

template <int B>
struct UnpackTab {
  static constexpr Unpack<B> tab = make_unpack<B>();
};

// The scales and biases of groups g..g + ng (flat over rows; ng <= 8, of one super-block in
// the super-block formats) into sc and bi, as scale_of / bias_of (kernels.h) form them: the
// same float32 products (−(dmin·m) is −dmin·m exactly), eight at a time.
inline void group_scales(const Problem& p, size_t g, int ng, float* sc, float* bi) {
  const __mmask8 m = __mmask8((1u << ng) - 1);
  __m256 s, b = _mm256_setzero_ps();
  const auto half = [&](const void* base) {  // float16 / bfloat16 -> float32, exact
    const __m128i h = _mm_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + g);
    if (p.sb_type == SB_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  if (sb_super(p.sb_type)) {
    const size_t sup = g >> p.gshift;
    const __m128i q = _mm_maskz_loadu_epi8(m, static_cast<const uint8_t*>(p.scales) + g);
    const __m256i qi = p.sb_type == SB_U8 ? _mm256_cvtepu8_epi32(q) : _mm256_cvtepi8_epi32(q);
    s = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(p.kd[2 * sup])), _mm256_cvtepi32_ps(qi));
    if (p.biases) {
      const __m128i mn = _mm_maskz_loadu_epi8(m, static_cast<const uint8_t*>(p.biases) + g);
      const __m256 dmin = _mm256_set1_ps(-_cvtsh_ss(p.kd[2 * sup + 1]));
      b = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
    }
  } else if (p.sb_type == SB_F32) {
    s = _mm256_maskz_loadu_ps(m, static_cast<const float*>(p.scales) + g);
    if (p.biases) b = _mm256_maskz_loadu_ps(m, static_cast<const float*>(p.biases) + g);
  } else {
    s = half(p.scales);
    if (p.biases) b = half(p.biases);
  }
  if (!p.biases) b = _mm256_mul_ps(_mm256_set1_ps(-float(1 << (p.bits - 1))), s);
  _mm256_storeu_ps(sc, s);
  _mm256_storeu_ps(bi, b);
}

// dequant_cols_avx2's result (the same fma(q, scale, bias) of every weight), 16 codes at a
// time: a chunk's bytes in one masked load, each half's codes gathered by vpermb (VBMI); the
// scales of each 128 columns (at most 8 groups, one super-block) formed together first.
template <int B>
void dequant_cols(const Problem& p, int n0, int n1, int c0, int c1, float* dst, int ld) {
  constexpr const Unpack<B>& u = UnpackTab<B>::tab;
  const __m512i idx0 = _mm512_load_si512(u.idx[0]), idx1 = _mm512_load_si512(u.idx[1]);
  const __m512i sh0 = _mm512_load_si512(u.shift[0]), sh1 = _mm512_load_si512(u.shift[1]);
  const __m512i mask = _mm512_set1_epi32((1 << B) - 1);
  const __mmask64 bytes = (__mmask64(1) << (4 * B)) - 1;  // (B <= 8: at most 32 bytes)
  const int G = p.K / p.group, gl = __builtin_ctz(p.group);
  const size_t row_bytes = size_t(p.K) * B / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = reinterpret_cast<const uint8_t*>(p.wq) + size_t(n) * row_bytes;
    float* d = dst + size_t(n - n0) * ld;
    for (int c = c0; c < c1;) {
      const int ce = c1 < (c / 4 + 1) * 4 ? c1 : (c / 4 + 1) * 4;  // to a multiple of 128 columns
      const int ga = (c * 32) >> gl, ge = (ce * 32 + p.group - 1) >> gl;
      alignas(32) float sc[8], bi[8];
      group_scales(p, size_t(n) * G + ga, ge - ga, sc, bi);
      for (; c < ce; ++c) {
        const int i0 = ((c * 32) >> gl) - ga, i1 = ((c * 32 + 16) >> gl) - ga;  // codes 0-15, 16-31
        const __m512i raw = _mm512_maskz_loadu_epi8(bytes, wrow + size_t(c) * 4 * B);
        const __m512i q0 =
            _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(idx0, raw), sh0), mask);
        const __m512i q1 =
            _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(idx1, raw), sh1), mask);
        float* dk = d + (c - c0) * 32;
        _mm512_storeu_ps(dk, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), _mm512_set1_ps(sc[i0]),
                                             _mm512_set1_ps(bi[i0])));
        _mm512_storeu_ps(dk + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_set1_ps(sc[i1]),
                                                  _mm512_set1_ps(bi[i1])));
      }
    }
  }
}

struct Avx512 {
  using T = __m512;
  static constexpr int W = 16, P = kPanelAvx512, kAcc = 24;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T set1(float f) { return _mm512_set1_ps(f); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static void dequant(const Problem& p, int n0, int n1, int c0, int c1, float* dst, int ld) {
    switch (p.bits) {
      case 2: return dequant_cols<2>(p, n0, n1, c0, c1, dst, ld);
      case 3: return dequant_cols<3>(p, n0, n1, c0, c1, dst, ld);
      case 4: return dequant_cols<4>(p, n0, n1, c0, c1, dst, ld);
      case 5: return dequant_cols<5>(p, n0, n1, c0, c1, dst, ld);
      case 6: return dequant_cols<6>(p, n0, n1, c0, c1, dst, ld);
      default: return dequant_cols<8>(p, n0, n1, c0, c1, dst, ld);
    }
  }
  // d[k·ldd + i] = s[i·lds + k] for k < cols (a multiple of 16), i < 16 (rows past `rows`:
  // zeros): 16 x 16 blocks transposed in registers (2-float, 4-float, then 128-bit interleaves)
  static void transpose(const float* s, size_t lds, int rows, float* d, size_t ldd, int cols) {
    for (int k = 0; k < cols; k += 16) {
      __m512 r[16], t[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_loadu_ps(s + i * lds + k) : _mm512_setzero_ps();
      for (int i = 0; i < 8; ++i) {  // per 128-bit lane: a0 b0 a1 b1 / a2 b2 a3 b3
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 4; ++i) {  // r[4i + c], lane L: column 4L + c of rows 4i..4i+3
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
      }
      for (int c = 0; c < 4; ++c) {  // lane L of r[c], r[4 + c], r[8 + c], r[12 + c]: column 4L + c
        const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
        const __m512 u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        _mm512_storeu_ps(d + (k + c) * ldd, _mm512_shuffle_f32x4(u0, u2, 0x88));
        _mm512_storeu_ps(d + (k + 4 + c) * ldd, _mm512_shuffle_f32x4(u0, u2, 0xDD));
        _mm512_storeu_ps(d + (k + 8 + c) * ldd, _mm512_shuffle_f32x4(u1, u3, 0x88));
        _mm512_storeu_ps(d + (k + 12 + c) * ldd, _mm512_shuffle_f32x4(u1, u3, 0xDD));
      }
    }
  }
};

}  // namespace

void pack_x_avx512(const float* x, int M, int K, int pi, int k0, int k1, float* xt) {
  pack_x<Avx512>(x, M, K, pi, k0, k1, xt);
}
size_t gemm_scratch_avx512(int panels, int rows) { return gemm_scratch<Avx512>(panels, rows); }
void gemm_avx512(const Problem& p, const float* xt, int n0, int n1, int pa, int pb,
                 float* scratch) {
  gemm<Avx512>(p, xt, n0, n1, pa, pb, scratch);
}

}  // namespace qmv
