// AVX2 + FMA kernels (x86-64). This file is compiled with -mavx2 -mfma -mf16c
// and is only entered after a runtime __builtin_cpu_supports check, so it must
// not include headers with inline/template code shared with other TUs (see
// kernels.h).
//
// Unpacking: a chunk of 32 codes is `bits` uint32 words = 4*bits bytes; it is
// handled as 4 sub-blocks of 8 codes (8*bits bits = `bits` bytes each). Each
// sub-block becomes one __m256i of 8 int32 codes in natural order, so x needs
// no permutation:
//  - bits 2,3,4: the sub-block fits in 32 bits: broadcast a 32-bit load to all
//    8 lanes, shift lane i right by i*bits (vpsrlvd), mask.
//  - bits 5,6: 40/48 bits: broadcast a 64-bit load, gather per lane the two
//    bytes holding code i (vpshufb), shift by the remaining bit offset, mask.
//  - bits 8: zero-extend 8 bytes (vpmovzxbd).
// Loads never leave the chunk (the last sub-blocks load from an earlier start
// and shift further), so the last row of the matrix needs no padding.
#include <immintrin.h>
#include <string.h>

#include "kernels.h"

namespace qmv {

namespace {

// Per-bits constant tables, computed at compile time.
template <int B>
struct Tab {
  int start[4];             // byte offset (in the chunk) of the load for sub-block j
  int32_t shift[4][8];      // per-lane right shift after the (shuffled) load
  int8_t ctrl[4][32];       // vpshufb control (bits 5, 6 only)
};

template <int B>
constexpr Tab<B> make_tab() {
  Tab<B> t{};
  const int load_bytes = B <= 4 ? 4 : 8;
  for (int j = 0; j < 4; ++j) {
    int start = j * B;
    if (start > 4 * B - load_bytes) start = 4 * B - load_bytes;
    t.start[j] = start;
    for (int i = 0; i < 8; ++i) {
      int bit = (j * B - start) * 8 + i * B;  // bit offset of code i in the load
      if (B <= 4) {
        t.shift[j][i] = bit;
      } else {
        int byte = bit >> 3;
        t.shift[j][i] = bit & 7;
        for (int h = 0; h < 2; ++h) {  // same control in both 128-bit halves
          int8_t* c = &t.ctrl[j][16 * h + 4 * (i & 3)];
          if ((i >> 2) != h) continue;
          c[0] = int8_t(byte);
          c[1] = byte + 1 < 8 ? int8_t(byte + 1) : int8_t(-128);
          c[2] = int8_t(-128);
          c[3] = int8_t(-128);
        }
      }
    }
  }
  return t;
}

template <int B>
struct Consts {
  static constexpr Tab<B> tab = make_tab<B>();
};

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

// Codes J*8 .. J*8+7 of the chunk at c, as floats.
template <int B, int J>
inline __m256 codes(const uint8_t* c) {
  __m256i v;
  if constexpr (B == 8) {
    v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * J)));
  } else {
    constexpr const Tab<B>& t = Consts<B>::tab;
    const __m256i sh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.shift[J]));
    if constexpr (B <= 4) {
      v = _mm256_set1_epi32(int(load_u32(c + t.start[J])));
    } else {
      v = _mm256_set1_epi64x((long long)load_u64(c + t.start[J]));
      v = _mm256_shuffle_epi8(
          v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.ctrl[J])));
    }
    v = _mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32((1 << B) - 1));
  }
  return _mm256_cvtepi32_ps(v);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// F16C conversion for half scales (sb_load's software path otherwise).
inline float sb_get(const void* base, int type, size_t idx) {
  if (type == SB_F16) return _cvtsh_ss(static_cast<const uint16_t*>(base)[idx]);
  return sb_load(base, type, idx);
}

// Scale of group idx: stored, or d·sc (kernels.h scale_of), with F16C.
inline float scale_get(const Problem& p, size_t idx) {
  if (!sb_super(p.sb_type)) return sb_get(p.scales, p.sb_type, idx);
  return _cvtsh_ss(p.kd[2 * (idx >> p.gshift)]) * sub_scale(p, idx);
}

// Bias of group idx (scale sv): stored, −dmin·m, else the symmetric −2^(bits−1)·sv
// (kernels.h bias_of).
inline float bias_get(const Problem& p, size_t idx, float sv) {
  if (!p.biases) return bias_of(p, idx, sv);
  if (!sb_super(p.sb_type)) return sb_get(p.biases, p.sb_type, idx);
  return -(_cvtsh_ss(p.kd[2 * (idx >> p.gshift) + 1]) * sub_min(p, idx));
}

// software prefetch distance, bytes ahead of the chunk being summed (the AVX-512 kernels'
// measured best; the hardware prefetcher alone stops at each row's end)
constexpr int kAheadW = 2048;

// A super-block format's row n: each group's scale d·sc and bias −dmin·m (zero without
// biases: the symmetric bias is then bias_of's) in float32 into s and b, 8 groups at a time,
// the values scale_get / bias_get give one by one (the same products, so the same bits).
template <int ST>
inline void expand_row(const Problem& p, int n, float* s, float* b) {
  const int G = p.K / p.group, per = 256 / p.group;  // groups a row, a super-block (8 or 16)
  const size_t g0 = size_t(n) * G;
  const uint16_t* kd = p.kd + 2 * (g0 / per);
  const auto* sc = static_cast<const uint8_t*>(p.scales) + g0;
  const auto* mn = p.biases ? static_cast<const uint8_t*>(p.biases) + g0 : nullptr;
  for (int g = 0; g < G; g += 8) {  // 8 groups share one super-block (per >= 8, G % 8 == 0)
    const int sbk = g / per;
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(kd[2 * sbk]));
    const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + g));
    const __m256i q = ST == SB_U8 ? _mm256_cvtepu8_epi32(q8) : _mm256_cvtepi8_epi32(q8);
    _mm256_storeu_ps(s + g, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
    if (mn) {  // −(dmin·m): the product, then its sign (exact)
      const __m256 dm = _mm256_set1_ps(_cvtsh_ss(kd[2 * sbk + 1]));
      const __m256i m = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + g)));
      const __m256 prod = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(m));
      _mm256_storeu_ps(b + g, _mm256_xor_ps(prod, _mm256_set1_ps(-0.0f)));
    }
  }
}

// out[m0..m0+MB, n0..n1]. Per group: t_m = sum q*x (FMA, 8 lanes), then
// acc_m += t_m * scale; the bias term is bias * (sum of x over the group).
// The weight bytes of a row are read once for all MB rows of x.
// A row's group scales and biases as the kernels read them: a super-block format's expanded
// once a row (expand_row: vector work, no per-group conversions), the others read a group
// at a time.
struct RowScales {
  alignas(32) float s[kMaxSuperGroups], b[kMaxSuperGroups];
  bool expanded = false;

  void load(const Problem& p, int n) {
    expanded = sb_super(p.sb_type) && p.K / p.group <= kMaxSuperGroups;
    if (!expanded) return;
    if (p.sb_type == SB_U8) {
      expand_row<SB_U8>(p, n, s, b);
    } else {
      expand_row<SB_I8>(p, n, s, b);
    }
  }
  // group g of row n (gi = n·G + g, flat): its scale, then its bias given the scale
  float scale(const Problem& p, size_t gi, int g) const {
    return expanded ? s[g] : scale_get(p, gi);
  }
  float bias(const Problem& p, size_t gi, int g, float sv) const {
    return expanded && p.biases ? b[g] : bias_get(p, gi, sv);
  }
};

// Prefetches the line kAheadW bytes past the chunk at cp once a line: from the chunk that
// starts within the line's first `bytes` bytes (a chunk's size).
inline void prefetch_ahead(const uint8_t* base, const uint8_t* cp, int bytes) {
  if (size_t(cp - base) % 64 < size_t(bytes))
    _mm_prefetch(reinterpret_cast<const char*>(cp + kAheadW), _MM_HINT_T0);
}

// out[m0..m0+MB, n0..n1]. Per group: t_m = sum q*x (FMA, 8 lanes), then
// acc_m += t_m * scale; the bias term is bias * (sum of x over the group).
// The weight bytes of a row are read once for all MB rows of x.
template <int B, int MB>
void rows(const Problem& p, int m0, int n0, int n1) {
  const int K = p.K, G = K / p.group, cpg = p.group / 32;
  const size_t row_bytes = size_t(K) * B / 8;
  const float* x0 = p.x + size_t(m0) * K;
  const float* xs0 = p.xsum + size_t(m0) * G;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.wq);
  RowScales rs;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = base + size_t(n) * row_bytes;
    rs.load(p, n);
    __m256 acc[MB];
    float bsum[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_setzero_ps();
      bsum[m] = 0.0f;
    }
    for (int g = 0; g < G; ++g) {
      __m256 t[MB];
      for (int m = 0; m < MB; ++m) t[m] = _mm256_setzero_ps();
      for (int c = 0; c < cpg; ++c) {
        const int chunk = g * cpg + c;
        const uint8_t* cp = wrow + size_t(chunk) * 4 * B;
        prefetch_ahead(base, cp, 4 * B);
        const float* xk = x0 + chunk * 32;
#define QMV_SUB(J)                                                          \
  {                                                                         \
    const __m256 q = codes<B, J>(cp);                                       \
    for (int m = 0; m < MB; ++m)                                            \
      t[m] = _mm256_fmadd_ps(q, _mm256_loadu_ps(xk + size_t(m) * K + 8 * J), t[m]); \
  }
        QMV_SUB(0) QMV_SUB(1) QMV_SUB(2) QMV_SUB(3)
#undef QMV_SUB
      }
      const size_t gi = size_t(n) * G + g;
      const float sv = rs.scale(p, gi, g);
      const __m256 s = _mm256_set1_ps(sv);
      const float b = rs.bias(p, gi, g, sv);
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm256_fmadd_ps(t[m], s, acc[m]);
        bsum[m] += b * xs0[size_t(m) * G + g];
      }
    }
    for (int m = 0; m < MB; ++m) p.out[size_t(m0 + m) * p.N + n] = hsum(acc[m]) + bsum[m];
  }
}

// Groups of 16 (Q6_K's sub-blocks): a chunk's sub-blocks 0-1 are group 2c, 2-3 group 2c + 1.
template <int B, int MB>
void rows16(const Problem& p, int m0, int n0, int n1) {
  const int K = p.K, G = K / 16;
  const size_t row_bytes = size_t(K) * B / 8;
  const float* x0 = p.x + size_t(m0) * K;
  const float* xs0 = p.xsum + size_t(m0) * G;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.wq);
  RowScales rs;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = base + size_t(n) * row_bytes;
    rs.load(p, n);
    __m256 acc[MB];
    float bsum[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_setzero_ps();
      bsum[m] = 0.0f;
    }
    for (int chunk = 0; chunk < K / 32; ++chunk) {
      const uint8_t* cp = wrow + size_t(chunk) * 4 * B;
      prefetch_ahead(base, cp, 4 * B);
      const float* xk = x0 + chunk * 32;
      const __m256 q0 = codes<B, 0>(cp), q1 = codes<B, 1>(cp);
      const __m256 q2 = codes<B, 2>(cp), q3 = codes<B, 3>(cp);
      const size_t gi = size_t(n) * G + 2 * chunk;
      const float sv0 = rs.scale(p, gi, 2 * chunk), sv1 = rs.scale(p, gi + 1, 2 * chunk + 1);
      const __m256 s0 = _mm256_set1_ps(sv0), s1 = _mm256_set1_ps(sv1);
      const float b0 = rs.bias(p, gi, 2 * chunk, sv0), b1 = rs.bias(p, gi + 1, 2 * chunk + 1, sv1);
      for (int m = 0; m < MB; ++m) {
        const float* xm = xk + size_t(m) * K;
        const __m256 t0 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xm + 8),
                                          _mm256_mul_ps(q0, _mm256_loadu_ps(xm)));
        const __m256 t1 = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xm + 24),
                                          _mm256_mul_ps(q2, _mm256_loadu_ps(xm + 16)));
        acc[m] = _mm256_fmadd_ps(t1, s1, _mm256_fmadd_ps(t0, s0, acc[m]));
        bsum[m] += b0 * xs0[size_t(m) * G + 2 * chunk] + b1 * xs0[size_t(m) * G + 2 * chunk + 1];
      }
    }
    for (int m = 0; m < MB; ++m) p.out[size_t(m0 + m) * p.N + n] = hsum(acc[m]) + bsum[m];
  }
}

template <int B>
void rows_b(const Problem& p, int m0, int mb, int n0, int n1) {
  if (p.group == 16) {
    switch (mb) {
      case 1: return rows16<B, 1>(p, m0, n0, n1);
      case 2: return rows16<B, 2>(p, m0, n0, n1);
      case 3: return rows16<B, 3>(p, m0, n0, n1);
      default: return rows16<B, 4>(p, m0, n0, n1);
    }
  }
  switch (mb) {
    case 1: return rows<B, 1>(p, m0, n0, n1);
    case 2: return rows<B, 2>(p, m0, n0, n1);
    case 3: return rows<B, 3>(p, m0, n0, n1);
    default: return rows<B, 4>(p, m0, n0, n1);
  }
}

template <int B>
void dequant(const Problem& p, int n0, int n1, int c0, int c1, float* dst, int ld) {
  const int K = p.K, G = K / p.group, cpg = p.group / 32;
  const size_t row_bytes = size_t(K) * B / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = reinterpret_cast<const uint8_t*>(p.wq) + size_t(n) * row_bytes;
    float* d = dst + size_t(n - n0) * ld;
    for (int chunk = c0; chunk < c1; ++chunk) {
      // the group of sub-blocks 0-1 and of 2-3 (different ones for groups of 16)
      const size_t g0 = size_t(n) * G + (cpg ? chunk / cpg : 2 * chunk), g1 = g0 + (cpg ? 0 : 1);
      const float sv0 = scale_get(p, g0), sv1 = scale_get(p, g1);
      const __m256 s0 = _mm256_set1_ps(sv0), s1 = _mm256_set1_ps(sv1);
      const __m256 b0 = _mm256_set1_ps(bias_get(p, g0, sv0));
      const __m256 b1 = _mm256_set1_ps(bias_get(p, g1, sv1));
      const uint8_t* cp = wrow + size_t(chunk) * 4 * B;
      float* dk = d + (chunk - c0) * 32;
      _mm256_storeu_ps(dk + 0, _mm256_fmadd_ps(codes<B, 0>(cp), s0, b0));
      _mm256_storeu_ps(dk + 8, _mm256_fmadd_ps(codes<B, 1>(cp), s0, b0));
      _mm256_storeu_ps(dk + 16, _mm256_fmadd_ps(codes<B, 2>(cp), s1, b1));
      _mm256_storeu_ps(dk + 24, _mm256_fmadd_ps(codes<B, 3>(cp), s1, b1));
    }
  }
}

}  // namespace

void rows_avx2(const Problem& p, int m0, int mb, int n0, int n1) {
  switch (p.bits) {
    case 2: return rows_b<2>(p, m0, mb, n0, n1);
    case 3: return rows_b<3>(p, m0, mb, n0, n1);
    case 4: return rows_b<4>(p, m0, mb, n0, n1);
    case 5: return rows_b<5>(p, m0, mb, n0, n1);
    case 6: return rows_b<6>(p, m0, mb, n0, n1);
    default: return rows_b<8>(p, m0, mb, n0, n1);
  }
}

void dequant_avx2(const Problem& p, int n0, int n1, float* dst) {
  dequant_cols_avx2(p, n0, n1, 0, p.K / 32, dst, p.K);
}

void dequant_cols_avx2(const Problem& p, int n0, int n1, int c0, int c1, float* dst, int ld) {
  switch (p.bits) {
    case 2: return dequant<2>(p, n0, n1, c0, c1, dst, ld);
    case 3: return dequant<3>(p, n0, n1, c0, c1, dst, ld);
    case 4: return dequant<4>(p, n0, n1, c0, c1, dst, ld);
    case 5: return dequant<5>(p, n0, n1, c0, c1, dst, ld);
    case 6: return dequant<6>(p, n0, n1, c0, c1, dst, ld);
    default: return dequant<8>(p, n0, n1, c0, c1, dst, ld);
  }
}

}  // namespace qmv
