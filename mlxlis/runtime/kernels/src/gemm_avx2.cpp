// The prompt product on AVX2 + FMA (gemm_impl.h): panels of 24 rows of x (3 vectors), 12
// accumulators a tile (4-12 weight rows; 16 registers). Compiled with the AVX2 flags.
#include "gemm_impl.h"

namespace qmv {

namespace {

struct Avx2 {
  using T = __m256;
  static constexpr int W = 8, P = kPanelAvx2, kAcc = 12;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T set1(float f) { return _mm256_set1_ps(f); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static void dequant(const Problem& p, int n0, int n1, int c0, int c1, float* dst, int ld) {
    dequant_cols_avx2(p, n0, n1, c0, c1, dst, ld);
  }
  // d[k·ldd + i] = s[i·lds + k] for k < cols (a multiple of 8), i < 8 (rows past `rows`:
  // zeros): 8 x 8 blocks transposed in registers (2-float, 4-float, then 128-bit interleaves)
  static void transpose(const float* s, size_t lds, int rows, float* d, size_t ldd, int cols) {
    for (int k = 0; k < cols; k += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i)
        r[i] = i < rows ? _mm256_loadu_ps(s + i * lds + k) : _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {  // r[4i + c], lane L: column 4L + c of rows 4i..4i+3
        r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
      }
      for (int c = 0; c < 4; ++c) {
        _mm256_storeu_ps(d + (k + c) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
        _mm256_storeu_ps(d + (k + 4 + c) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
      }
    }
  }
};

}  // namespace

void pack_x_avx2(const float* x, int M, int K, int pi, int k0, int k1, float* xt) {
  pack_x<Avx2>(x, M, K, pi, k0, k1, xt);
}
size_t gemm_scratch_avx2(int panels, int rows) { return gemm_scratch<Avx2>(panels, rows); }
void gemm_avx2(const Problem& p, const float* xt, int n0, int n1, int pa, int pb, float* scratch) {
  gemm<Avx2>(p, xt, n0, n1, pa, pb, scratch);
}

}  // namespace qmv
