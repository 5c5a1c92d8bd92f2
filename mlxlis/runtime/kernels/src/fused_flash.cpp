// The attention of a prompt chunk (many queries) over a cache, on every core: attend_blocks
// (fused_kernels.h). MLX's CPU path for it is BLAS's two products around a softmax, a mask
// and the blocks' concatenation that run on one thread, with the T x S scores written and
// read between them; here each (row, KV head, query block) item keeps its scores to one
// block of keys at a time.
#include <math.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "fused_kernels.h"
#include "pool.h"

// the 64-byte vectors below never cross a call (always inlined): no ABI to keep
#pragma GCC diagnostic ignored "-Wpsabi"

namespace qmv {

namespace {

constexpr int QB = kQueryBlock, KB = kKeyBlock;
constexpr int kMaxHeads = 8;  // query heads of one KV head an item takes (more: split)

struct FlashCtx {
  const AttendArgs* a;
  int qblocks, chunks, per_item;  // query blocks; a KV head's query heads in chunks of per_item
};

// 16 floats, one lane each: GCC's vector extension, as wide as the clone's ISA allows (four
// SSE, two AVX2 or one AVX-512 register); each lane's arithmetic is the scalar one
typedef float vf __attribute__((vector_size(64)));
constexpr int L = 16;

inline __attribute__((always_inline)) vf load(const float* p) {
  vf x;
  memcpy(&x, p, sizeof(vf));
  return x;
}
inline __attribute__((always_inline)) void store(float* p, vf x) { memcpy(p, &x, sizeof(vf)); }

// s (KB) = q . kt, kt a block of keys transposed (D, KB): each score a sum over d in order,
// the block's scores in registers
inline __attribute__((always_inline)) void scores(const float* q, const float* kt, int D,
                                                  float* s) {
  static_assert(KB == 4 * L);
  vf s0 = {}, s1 = {}, s2 = {}, s3 = {};
  for (int d = 0; d < D; ++d) {
    const vf qd = vf{} + q[d];
    const float* kd = kt + d * KB;
    s0 += qd * load(kd);
    s1 += qd * load(kd + L);
    s2 += qd * load(kd + 2 * L);
    s3 += qd * load(kd + 3 * L);
  }
  store(s, s0), store(s + L, s1), store(s + 2 * L, s2), store(s + 3 * L, s3);
}

// o (Dv) += sum over j < n of p[j] * v_j (v_j = v + j * stride), each o[d] a sum in j order:
// 64 columns at a time in registers, then the rest one at a time (the same sums)
inline __attribute__((always_inline)) void weighted(const float* p, const float* v,
                                                    int64_t stride, int n, int Dv, float* o) {
  int d0 = 0;
  for (; d0 + 4 * L <= Dv; d0 += 4 * L) {
    vf o0 = {}, o1 = {}, o2 = {}, o3 = {};
    for (int j = 0; j < n; ++j) {
      const vf pj = vf{} + p[j];
      const float* vr = v + j * stride + d0;
      o0 += pj * load(vr);
      o1 += pj * load(vr + L);
      o2 += pj * load(vr + 2 * L);
      o3 += pj * load(vr + 3 * L);
    }
    store(o + d0, o0), store(o + d0 + L, o1), store(o + d0 + 2 * L, o2), store(o + d0 + 3 * L, o3);
  }
  for (int d = d0; d < Dv; ++d) o[d] = 0.0f;
  for (int j = 0; j < n && d0 < Dv; ++j)
    for (int d = d0; d < Dv; ++d) o[d] += p[j] * v[j * stride + d];
}

// the maximum of s (KB), hidden keys (seen 0) set to -inf first
inline __attribute__((always_inline)) float hide_and_max(float* s, const uint8_t* seen) {
  float lane[L];
  for (int l = 0; l < L; ++l) lane[l] = -INFINITY;
  for (int j = 0; j < KB; j += L)
    for (int l = 0; l < L; ++l) {
      const float x = seen[j + l] ? s[j + l] : -INFINITY;
      s[j + l] = x;
      lane[l] = lane[l] > x ? lane[l] : x;
    }
  float top = -INFINITY;
  for (int l = 0; l < L; ++l) top = top > lane[l] ? top : lane[l];
  return top;
}

// s[j] = e^(s[j] - high); their sum, in L lanes then the lanes in order
inline __attribute__((always_inline)) float exp_and_sum(float* s, float high) {
  float lane[L] = {};
  for (int j = 0; j < KB; j += L)
    for (int l = 0; l < L; ++l) {
      s[j + l] = exp_inline(s[j + l] - high);
      lane[l] += s[j + l];
    }
  float sum = 0.0f;
  for (int l = 0; l < L; ++l) sum += lane[l];
  return sum;
}

// One item. Rows r = i * nt + u: query head h0 + i at query position t0 + u; per row a
// running maximum mx, denominator den (double: thousands of terms) and output acc, all
// rescaled by e^(old max - new max) when a key block raises the maximum.
QMV_CLONES void flash_task(void* vctx, int task) {
  const auto* c = static_cast<const FlashCtx*>(vctx);
  const AttendArgs& a = *c->a;
  const int B = a.q.n[0], H = a.q.n[1], T = a.q.n[2], D = a.q.n[3];
  const int Hkv = a.k.n[1], S = a.k.n[2], Dv = a.v.n[3], G = H / Hkv;
  // the last query block first (a causal chunk's longest), then the rows and KV heads
  const int per_block = B * Hkv * c->chunks;
  const int qb = c->qblocks - 1 - task / per_block;
  int r = task % per_block;
  const int ch = r % c->chunks;
  r /= c->chunks;
  const int g = r % Hkv, b = r / Hkv;
  const int t0 = qb * QB, nt = std::min(QB, T - t0);
  const int h0 = g * G + ch * c->per_item, nh = std::min(c->per_item, G - ch * c->per_item);
  const int rows = nh * nt;

  std::vector<float> qs(size_t(rows) * D), kt(size_t(D) * KB), acc(size_t(rows) * Dv, 0.0f);
  std::vector<float> mx(rows, -INFINITY), blk(Dv);
  std::vector<double> den(rows, 0.0);
  alignas(64) float s[KB];
  alignas(64) uint8_t seen[KB];
  for (int i = 0; i < nh; ++i)
    for (int u = 0; u < nt; ++u) {
      const float* q = a.q.row(b, h0 + i, t0 + u);
      float* o = &qs[size_t(i * nt + u) * D];
      for (int d = 0; d < D; ++d) o[d] = q[d] * a.scale;  // scaled first, as MLX's
    }
  const int lo = S - T;  // causal: query t sees keys [0, lo + t], aligned to the newest
  const int end = a.causal ? lo + t0 + nt : S;  // past the last key a query here sees
  const uint8_t* mb = a.mask ? a.mask + b * a.mask_s[0] : nullptr;

  for (int j0 = 0; j0 < end; j0 += KB) {
    const int nj = std::min(KB, end - j0);
    if (mb) {  // a block the mask hides from every query here (a window's past): skipped
      bool any = false;
      for (int u = 0; u < nt && !any; ++u)
        for (int j = 0; j < nj && !any; ++j)
          any = mb[(t0 + u) * a.mask_s[1] + (j0 + j) * a.mask_s[2]];
      if (!any) continue;
    }
    for (int j = 0; j < KB; ++j) {  // (D, KB), zeros past the keys
      const float* kr = j < nj ? a.k.row(b, g, j0 + j) : nullptr;
      for (int d = 0; d < D; ++d) kt[size_t(d) * KB + j] = kr ? kr[d] : 0.0f;
    }
    for (int u = 0; u < nt; ++u) {
      const int last = a.causal ? lo + t0 + u : S - 1;  // the last key query t0 + u sees
      const uint8_t* m = mb ? mb + (t0 + u) * a.mask_s[1] : nullptr;
      for (int j = 0; j < KB; ++j) {
        const int key = j0 + j;
        seen[j] = j < nj && key <= last && (!m || m[key * a.mask_s[2]]);
      }
      const int jn = std::min(nj, last - j0 + 1);  // keys of the block up to `last`
      if (jn <= 0) continue;
      for (int i = 0; i < nh; ++i) {
        const int row = i * nt + u;
        scores(&qs[size_t(row) * D], kt.data(), D, s);
        const float high = std::max(mx[row], hide_and_max(s, seen));
        if (high == -INFINITY) continue;  // nothing seen yet
        const float alpha = exp_inline(mx[row] - high);  // e^-inf = 0 at the first block
        mx[row] = high;
        const float sum = exp_and_sum(s, high);
        den[row] = den[row] * alpha + sum;
        // this block's weighted values, then added to the rescaled output: the rounding
        // grows with KB + S / KB terms, not S
        weighted(s, a.v.row(b, g, j0), a.v.s[2], jn, Dv, blk.data());
        float* o = &acc[size_t(row) * Dv];
        for (int d = 0; d < Dv; ++d) o[d] = o[d] * alpha + blk[d];
      }
    }
  }
  for (int i = 0; i < nh; ++i)
    for (int u = 0; u < nt; ++u) {
      const int h = h0 + i, t = t0 + u, row = i * nt + u;
      float* o = a.out +
                 (a.heads_last ? (int64_t(b) * T + t) * H + h : (int64_t(b) * H + h) * T + t) * Dv;
      const float total = float(den[row]);  // 0 where every key is hidden: NaN, as attend's
      for (int d = 0; d < Dv; ++d) o[d] = acc[size_t(row) * Dv + d] / total;
    }
}

}  // namespace

void attend_blocks(const AttendArgs& a) {
  const int B = a.q.n[0], T = a.q.n[2], Hkv = a.k.n[1], G = a.q.n[1] / Hkv;
  FlashCtx c{&a, (T + QB - 1) / QB, 1, std::min(G, kMaxHeads)};
  c.chunks = (G + c.per_item - 1) / c.per_item;
  c.per_item = (G + c.chunks - 1) / c.chunks;  // even chunks
  parallel_for(B * Hkv * c.chunks * c.qblocks, flash_task, &c);
}

}  // namespace qmv
