// AVX-512 kernels with integer dot products (VNNI) and byte permutes (VBMI), x86-64.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512vbmi (and the AVX2
// flags); entered only after a runtime CPU check (compute.cpp). Same rules as kernels_avx2.cpp:
// no headers with inline / template code shared with other TUs.
//
// The float kernels spend a conversion and a multiply-add on every weight. Here x is first
// written as integers, exactly enough that the products are those of float32 arithmetic:
// every 4 consecutive x (a "lane") share a power of two 2^E, chosen so that the largest of
// the 4 is an integer of 23 bits, x_i ~= 2^E * X_i, |X_i| <= 8355711, and X_i is held as
// three signed base-256 digits, X = d0 + 256 d1 + 65536 d2 (each in [-128, 127]). The
// representation error is at most 2^(E-1) <= 2^-23 times the lane's largest |x|: float32's
// own rounding of that element, give or take a factor of 2. Then sum_i q_i X_i over a lane
// is exact in int32 (vpdpbusd: 64 code x digit products an instruction, Horner in the
// digits: ((q.d2) << 8 + q.d1) << 8 + q.d0, below 2^31 for codes of up to 6 bits; 8-bit
// codes keep q.d2 apart), then one conversion to float and a multiply by 2^E per lane of 4
// weights, not per weight. Subnormal x are exact (E is never below -149).
//
// An inf or NaN in x makes its lane's digits garbage but its lane sum (the bias term's
// xs4) inf or NaN, so the result is not finite, as a float product's would be.
//
// Unpacking: 64 codes (8*bits bytes) become 64 bytes in natural order with one byte
// permute (vpermb: the bytes of codes 8j..8j+7 into qword j) and one multishift
// (vpmultishiftqb: byte i of qword j = the 8 bits from bit i*bits), masked to `bits`.
#include <immintrin.h>
#include <string.h>

#include "kernels.h"

namespace qmv {

namespace {

// software prefetch distances, bytes ahead of the block being summed: codes, scales / biases
// (the hardware prefetcher alone left products from memory ~20% slower; measured best)
constexpr int kAheadW = 2048, kAheadS = 256;
constexpr int kMaxX = 8355711;  // 127 * (1 + 256 + 65536): the largest 3-digit value

// Byte-permute and multishift controls for `bits`.
template <int B>
struct Unpack {
  alignas(64) uint8_t perm[64];
  alignas(64) uint8_t shift[64];
};

template <int B>
constexpr Unpack<B> make_unpack() {
  Unpack<B> u{};
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 8; ++i) {
      u.perm[8 * j + i] = uint8_t(j * B + (i < B ? i : B - 1));
      u.shift[8 * j + i] = uint8_t(i * B);
    }
  return u;
}

template <int B>
struct UnpackConsts {
  static constexpr Unpack<B> u = make_unpack<B>();
};

// 64 codes (or 32: the tail of a row whose K is not a multiple of 64) as bytes.
template <int B>
inline __m512i codes64(const uint8_t* c, __mmask64 bytes) {
  const __m512i raw = _mm512_maskz_loadu_epi8(bytes, c);
  if constexpr (B == 8) {
    return raw;
  } else {
    constexpr const Unpack<B>& u = UnpackConsts<B>::u;
    const __m512i v = _mm512_permutexvar_epi8(_mm512_loadu_si512(u.perm), raw);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_loadu_si512(u.shift), v),
                            _mm512_set1_epi8(char((1 << B) - 1)));
  }
}

// The 16 lanes' scales (or biases) of one block of 64 weights: lane l holds the value of
// the group of weight 4l. `gi` is the first group of the block, `valid` its groups (fewer
// in a tail block; the others read as 0, never as garbage that could be NaN).
template <int GR, int ST>
inline __m512 lanes_of(const void* base, size_t gi, int valid) {
  static_assert(ST == SB_F32 || ST == SB_F16 || ST == SB_BF16, "super-block rows are expanded");
  if constexpr (GR >= 64) {
    if constexpr (ST == SB_F16) return _mm512_set1_ps(_cvtsh_ss(static_cast<const uint16_t*>(base)[gi]));
    return _mm512_set1_ps(sb_load(base, ST, gi));
  } else {
    const __mmask8 m = __mmask8((1u << valid) - 1);
    __m128 v;
    if constexpr (ST == SB_F32) {
      v = _mm_maskz_loadu_ps(m, static_cast<const float*>(base) + gi);
    } else {
      const __m128i h = _mm_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + gi);
      if constexpr (ST == SB_F16) {
        v = _mm_cvtph_ps(h);
      } else {
        v = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
      }
    }
    const __m512i idx = GR == 16 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
  }
}

// One block of 64 weights (b) of row wrow against MB rows of x: per lane of 4, the exact
// integer sum of code x digits, times 2^E (xe), times the group's scale into acc; bias x the
// lane's sum of x (xs4) into accb (apart: one chain of two multiply-adds a block was the
// kernel's bound, their latency, not the ports).
template <int B, int GR, int MB, int ST, bool PFS>
inline __attribute__((always_inline)) void block(const Problem& p, const void* scales,
                                                 const void* biases, const uint8_t* wrow,
                                                 size_t g0, int b, int nb, const int8_t* xd,
                                                 const float* xe, const float* xs,
                                                 __mmask64 bytes, int valid, __m512* acc,
                                                 __m512* accb) {
  const uint8_t* wb = wrow + size_t(b) * 8 * B;  // the block's codes
  const __m512i q = codes64<B>(wb, bytes);
  const size_t gi = g0 + size_t(b) * 64 / GR;  // the block's first group
  // each 64-byte line prefetched once: by the block that starts within its first 8·B bytes
  if ((size_t(wb - reinterpret_cast<const uint8_t*>(p.wq)) & 63) < 8 * B)
    _mm_prefetch(reinterpret_cast<const char*>(wb + kAheadW), _MM_HINT_T0);
  if constexpr (PFS) {  // not a row expanded on the stack
    constexpr int ss = ST == SB_F32 ? 4 : 2;
    constexpr int sb = (GR >= 64 ? 1 : 64 / GR) * ss;
    if (((gi * ss) & 63) < sb) {
      _mm_prefetch(static_cast<const char*>(scales) + gi * ss + kAheadS, _MM_HINT_T0);
      if (biases) _mm_prefetch(static_cast<const char*>(biases) + gi * ss + kAheadS, _MM_HINT_T0);
    }
  }
  const __m512 s = lanes_of<GR, ST>(scales, gi, valid);
  // no biases: a symmetric format, −2^(B−1)·scale (exact)
  const __m512 bias = biases ? lanes_of<GR, ST>(biases, gi, valid)
                             : _mm512_mul_ps(s, _mm512_set1_ps(-float(1 << (B - 1))));
  for (int m = 0; m < MB; ++m) {
    const size_t xb = size_t(m) * nb + b;
    const int8_t* d = xd + xb * 192;
    const __m512i z = _mm512_setzero_si512();
    __m512 f;
    if constexpr (B < 8) {  // |sum| <= 4 * 63 * kMaxX < 2^31
      __m512i t = _mm512_dpbusd_epi32(z, q, _mm512_loadu_si512(d));
      t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), q, _mm512_loadu_si512(d + 64));
      t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), q, _mm512_loadu_si512(d + 128));
      f = _mm512_cvtepi32_ps(t);
    } else {  // 8-bit codes: 4 * 255 * kMaxX would not fit; d2's part apart
      const __m512i hi = _mm512_dpbusd_epi32(z, q, _mm512_loadu_si512(d));
      __m512i lo = _mm512_dpbusd_epi32(z, q, _mm512_loadu_si512(d + 64));
      lo = _mm512_dpbusd_epi32(_mm512_slli_epi32(lo, 8), q, _mm512_loadu_si512(d + 128));
      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65536.0f),
                          _mm512_cvtepi32_ps(lo));
    }
    f = _mm512_mul_ps(f, _mm512_loadu_ps(xe + xb * 16));
    acc[m] = _mm512_fmadd_ps(f, s, acc[m]);
    accb[m] = _mm512_fmadd_ps(bias, _mm512_loadu_ps(xs + xb * 16), accb[m]);
  }
}

// Row n's scales d·sc and biases −dmin·m in float32 (a super-block format: ST SB_U8 /
// SB_I8), into s and b (G each; b untouched without biases), 16 groups at a time.
template <int GR, int ST>
inline void expand_row(const Problem& p, int n, float* s, float* b) {
  constexpr int per = 256 / GR;  // groups a super-block: 8 or 16
  const int G = p.K / GR;
  const size_t g0 = size_t(n) * G;
  const uint16_t* kd = p.kd + 2 * (g0 / per);
  const auto* sc = static_cast<const uint8_t*>(p.scales) + g0;
  const auto* mn = p.biases ? static_cast<const uint8_t*>(p.biases) + g0 : nullptr;
  // (d, dmin) of the 16 groups' super-blocks, 8 a super-block: [d0, m0, d1, m1] -> lanes
  // 0-7 the first's, 8-15 the second's; 16 a super-block: all the first's
  const __m512i di = per == 8 ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)
                              : _mm512_setzero_si512();
  const __m512i mi = _mm512_add_epi32(di, _mm512_set1_epi32(1));
  for (int g = 0; g < G; g += 64) {  // the next row's integers, a line at a time
    _mm_prefetch(reinterpret_cast<const char*>(sc + G + g), _MM_HINT_T0);
    if (mn) _mm_prefetch(reinterpret_cast<const char*>(mn + G + g), _MM_HINT_T0);
  }
  for (int g = 0; g < G; g += 16) {
    const int left = G - g;
    const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const __mmask8 halves = per == 8 && left > 8 ? 0xF : 0x3;
    const __m512 pair = _mm512_castps128_ps512(
        _mm_cvtph_ps(_mm_maskz_loadu_epi16(halves, kd + 2 * (g / per))));
    const __m128i q8 = _mm_maskz_loadu_epi8(m, sc + g);
    const __m512i q = ST == SB_U8 ? _mm512_cvtepu8_epi32(q8) : _mm512_cvtepi8_epi32(q8);
    _mm512_mask_storeu_ps(s + g, m, _mm512_mul_ps(_mm512_permutexvar_ps(di, pair),
                                                  _mm512_cvtepi32_ps(q)));
    if (mn) {  // −dmin·m as (−dmin)·m: the same float32 value, sign included
      const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(
          _mm512_castps_si512(_mm512_permutexvar_ps(mi, pair)), _mm512_set1_epi32(INT32_MIN)));
      const __m512i mq = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, mn + g));
      _mm512_mask_storeu_ps(b + g, m, _mm512_mul_ps(neg, _mm512_cvtepi32_ps(mq)));
    }
  }
}

// out[m0..m0+MB, n0..n1]; the weight bytes of a row are unpacked once for all MB rows of x.
// A super-block format's row scales are expanded to float32 first (expand_row), then read
// as float32 ones.
template <int B, int GR, int MB, int ST>
void rows(const Problem& p, int m0, int n0, int n1) {
  constexpr bool super = sb_super(ST);
  constexpr int SF = super ? SB_F32 : ST;  // the scales' type as block() reads them
  const int K = p.K, G = K / GR, nb = (K + 63) / 64, full = K / 64;
  const size_t row_bytes = size_t(K) * B / 8;
  const __mmask64 all = B == 8 ? ~__mmask64(0) : (__mmask64(1) << (8 * B)) - 1;
  const __mmask64 half = (__mmask64(1) << (4 * B)) - 1;
  const int per_block = GR >= 64 ? 1 : 64 / GR;
  const int8_t* xd = p.xd + size_t(m0) * nb * 192;
  const float* xe = p.xe + size_t(m0) * nb * 16;
  const float* xs = p.xs4 + size_t(m0) * nb * 16;
  alignas(64) float srow[super ? kMaxSuperGroups : 1], brow[super ? kMaxSuperGroups : 1];
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = reinterpret_cast<const uint8_t*>(p.wq) + size_t(n) * row_bytes;
    if (n + 1 < n1) _mm_prefetch(reinterpret_cast<const char*>(wrow + row_bytes), _MM_HINT_T0);
    __m512 acc[MB], accb[MB];
    for (int m = 0; m < MB; ++m) acc[m] = accb[m] = _mm512_setzero_ps();
    size_t g0 = size_t(n) * G;
    const void* sb = p.scales;
    const void* bb = p.biases;
    if constexpr (super) {
      expand_row<GR, ST>(p, n, srow, brow);
      sb = srow, bb = p.biases ? brow : nullptr, g0 = 0;
    }
    for (int b = 0; b < full; ++b)
      block<B, GR, MB, SF, !super>(p, sb, bb, wrow, g0, b, nb, xd, xe, xs, all, per_block, acc,
                                   accb);
    if (full < nb)  // the last 32 weights of a row (K % 64 == 32: groups of 16 or 32)
      block<B, GR, MB, SF, !super>(p, sb, bb, wrow, g0, full, nb, xd, xe, xs, half,
                                   (per_block + 1) / 2, acc, accb);
    for (int m = 0; m < MB; ++m)
      p.out[size_t(m0 + m) * p.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], accb[m]));
  }
}

template <int B, int GR, int ST>
void rows_m(const Problem& p, int m0, int mb, int n0, int n1) {
  switch (mb) {
    case 1: return rows<B, GR, 1, ST>(p, m0, n0, n1);
    case 2: return rows<B, GR, 2, ST>(p, m0, n0, n1);
    case 3: return rows<B, GR, 3, ST>(p, m0, n0, n1);
    default: return rows<B, GR, 4, ST>(p, m0, n0, n1);
  }
}

template <int B, int GR>
void rows_g(const Problem& p, int m0, int mb, int n0, int n1) {
  switch (p.sb_type) {
    case SB_F32: return rows_m<B, GR, SB_F32>(p, m0, mb, n0, n1);
    case SB_F16: return rows_m<B, GR, SB_F16>(p, m0, mb, n0, n1);
    case SB_BF16: return rows_m<B, GR, SB_BF16>(p, m0, mb, n0, n1);
    default:  // super-block formats: groups of 16 or 32 only (the binding checks)
      if constexpr (GR <= 32) {
        if (p.sb_type == SB_U8) return rows_m<B, GR, SB_U8>(p, m0, mb, n0, n1);
        return rows_m<B, GR, SB_I8>(p, m0, mb, n0, n1);
      }
  }
}

template <int B>
void rows_b(const Problem& p, int m0, int mb, int n0, int n1) {
  switch (p.group) {
    case 16: return rows_g<B, 16>(p, m0, mb, n0, n1);
    case 32: return rows_g<B, 32>(p, m0, mb, n0, n1);
    case 64: return rows_g<B, 64>(p, m0, mb, n0, n1);
    default: return rows_g<B, 128>(p, m0, mb, n0, n1);
  }
}

}  // namespace

void prep_x_avx512(const float* x, int M, int K, int8_t* xd, float* xe, float* xs4) {
  const int nb = (K + 63) / 64;
  const __m512i swap1 = _mm512_set_epi32(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1);
  const __m512i swap2 = _mm512_set_epi32(13, 12, 15, 14, 9, 8, 11, 10, 5, 4, 7, 6, 1, 0, 3, 2);
  const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  for (int m = 0; m < M; ++m) {
    const float* xm = x + size_t(m) * K;
    for (int b = 0; b < nb; ++b) {
      int8_t* d = xd + (size_t(m) * nb + b) * 192;
      float* e = xe + (size_t(m) * nb + b) * 16;
      float* s4 = xs4 + (size_t(m) * nb + b) * 16;
      for (int j = 0; j < 4; ++j) {  // 16 x: lanes 4j..4j+3
        const int k0 = b * 64 + j * 16;
        const int left = K - k0;
        const __mmask16 mk = left >= 16 ? __mmask16(0xffff)
                                        : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(mk, xm + k0);
        const __m512 a = _mm512_abs_ps(v);
        __m512 mx = _mm512_max_ps(a, _mm512_permutexvar_ps(swap1, a));
        mx = _mm512_max_ps(mx, _mm512_permutexvar_ps(swap2, mx));  // each: its 4's largest
        // E: the largest becomes an integer in [2^22, 8355711] (or 2^21.. past that)
        __m512 ex = _mm512_sub_ps(_mm512_getexp_ps(mx), _mm512_set1_ps(22.0f));
        const __mmask16 over =
            _mm512_cmp_ps_mask(_mm512_scalef_ps(mx, _mm512_sub_ps(_mm512_setzero_ps(), ex)),
                               _mm512_set1_ps(float(kMaxX)), _CMP_GT_OQ);
        ex = _mm512_mask_add_ps(ex, over, ex, _mm512_set1_ps(1.0f));
        // a lane of zeros or of subnormals: 2^-149, whose multiples they are (exact)
        ex = _mm512_max_ps(ex, _mm512_set1_ps(-149.0f));
        const __m512i X = _mm512_cvtps_epi32(_mm512_scalef_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), ex)));
        const __m512i d0 = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
        const __m512i r1 = _mm512_srai_epi32(_mm512_sub_epi32(X, d0), 8);
        const __m512i d1 = _mm512_srai_epi32(_mm512_slli_epi32(r1, 24), 24);
        const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(r1, d1), 8);
        // digits in the order the kernel takes them: d2, d1, d0
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16 * j), _mm512_cvtepi32_epi8(d2));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 64 + 16 * j), _mm512_cvtepi32_epi8(d1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 128 + 16 * j), _mm512_cvtepi32_epi8(d0));
        __m512 sm = _mm512_add_ps(v, _mm512_permutexvar_ps(swap1, v));
        sm = _mm512_add_ps(sm, _mm512_permutexvar_ps(swap2, sm));
        const __m512 p2 = _mm512_scalef_ps(_mm512_set1_ps(1.0f), ex);
        _mm_storeu_ps(e + 4 * j, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, p2)));
        _mm_storeu_ps(s4 + 4 * j, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, sm)));
      }
    }
  }
}

void rows_avx512(const Problem& p, int m0, int mb, int n0, int n1) {
  switch (p.bits) {
    case 2: return rows_b<2>(p, m0, mb, n0, n1);
    case 3: return rows_b<3>(p, m0, mb, n0, n1);
    case 4: return rows_b<4>(p, m0, mb, n0, n1);
    case 5: return rows_b<5>(p, m0, mb, n0, n1);
    case 6: return rows_b<6>(p, m0, mb, n0, n1);
    default: return rows_b<8>(p, m0, mb, n0, n1);
  }
}

}  // namespace qmv
