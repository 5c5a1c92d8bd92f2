// The prompt product on AVX-512 (gemm_impl.h): panels of 64 rows of x (4 vectors), 24
// accumulators a tile (6-24 weight rows). Compiled with the AVX-512 flags.
#include "gemm_impl.h"

namespace qmv {

namespace {

struct Avx512 {
  using T = __m512;
  static constexpr int W = 16, P = kPanelAvx512, kAcc = 24;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T set1(float f) { return _mm512_set1_ps(f); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
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
void gemm_avx512(const Problem& p, const float* xt, int n0, int n1, int pa, int pb, float* scratch) {
  gemm<Avx512>(p, xt, n0, n1, pa, pb, scratch);
}

}  // namespace qmv
