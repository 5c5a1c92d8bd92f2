#include "fused_kernels.h"

#include <math.h>
#include <string.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "pool.h"

namespace qmv {

namespace {

// a . b over n floats, 8 partial sums (so the compiler vectorises it without -ffast-math)
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) acc[u] += a[i + u] * b[i + u];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// work past which a call is split across the pool (below: waking workers costs more)
constexpr int64_t kParallelWork = 1 << 16;

}  // namespace

float exp_f32(float x) { return exp_inline(x); }

QMV_CLONES void rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int D, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    const float inv = 1.0f / sqrtf(dot(xr, xr, D) / float(D) + eps);
    if (w) {
      for (int d = 0; d < D; ++d) o[d] = (xr[d] * inv) * w[d];
    } else {
      for (int d = 0; d < D; ++d) o[d] = xr[d] * inv;
    }
  }
}

void rope(const RopeArgs& a) {
  const View4& x = a.x;
  const int B = x.n[0], H = x.n[1], T = x.n[2], D = x.n[3], half = a.dims / 2;
  std::vector<float> inv(half), cs(size_t(T) * half * 2);
  for (int i = 0; i < half; ++i)
    inv[i] = a.periods ? 1.0f / a.periods[i] : 1.0f / powf(a.base, float(2 * i) / float(a.dims));
  for (int b = 0; b < B; ++b) {
    // cos and sin of this row's positions, shared by its heads
    if (b == 0 || a.offset_count > 1) {
      const int32_t off = a.offsets[a.offset_count > 1 ? b : 0];
      for (int t = 0; t < T; ++t) {
        const float pos = float(off + t) * a.scale;
        for (int i = 0; i < half; ++i) {
          const float th = pos * inv[i];
          cs[(size_t(t) * half + i) * 2] = cosf(th);
          cs[(size_t(t) * half + i) * 2 + 1] = sinf(th);
        }
      }
    }
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        const float* xr = x.row(b, h, t);
        float* o = a.out + ((int64_t(b) * H + h) * T + t) * D;
        const float* c = &cs[size_t(t) * half * 2];
        if (a.traditional) {
          for (int i = 0; i < half; ++i) {
            const float x1 = xr[2 * i], x2 = xr[2 * i + 1], co = c[2 * i], si = c[2 * i + 1];
            o[2 * i] = x1 * co - x2 * si;
            o[2 * i + 1] = x1 * si + x2 * co;
          }
        } else {
          for (int i = 0; i < half; ++i) {
            const float x1 = xr[i], x2 = xr[i + half], co = c[2 * i], si = c[2 * i + 1];
            o[i] = x1 * co - x2 * si;
            o[i + half] = x2 * co + x1 * si;
          }
        }
        for (int d = a.dims; d < D; ++d) o[d] = xr[d];
      }
  }
}

namespace {

// Scratch of one task: the group's scaled queries, scores and value blocks.
struct AttendScratch {
  std::vector<float> qs, p, blk;
};

// One item: query position t of row b, query heads [h0, h0 + nh) of KV head g (GQA heads
// sharing a KV head read each key and value row once for all of them). Per query head, the
// same sums in the same order as one head alone.
inline __attribute__((always_inline)) void attend_heads(const AttendArgs& a, int b, int g,
                                                       int t, int h0, int nh,
                                                       AttendScratch& w) {
  const int H = a.q.n[1], T = a.q.n[2], D = a.q.n[3], S = a.k.n[2], Dv = a.v.n[3];
  float* qs = w.qs.data();
  float* p = w.p.data();  // (nh, S)
  for (int i = 0; i < nh; ++i) {
    const float* q = a.q.row(b, h0 + i, t);
    for (int d = 0; d < D; ++d) qs[i * D + d] = q[d] * a.scale;  // scaled first, as MLX's
  }
  const int L = a.causal ? std::min(S, S - T + t + 1) : S;
  const uint8_t* m = a.mask ? a.mask + b * a.mask_s[0] + t * a.mask_s[1] : nullptr;
  for (int j = 0; j < L; ++j) {
    const bool hidden = m && !m[j * a.mask_s[2]];
    const float* kr = a.k.row(b, g, j);
    for (int i = 0; i < nh; ++i) p[size_t(i) * S + j] = hidden ? -INFINITY : dot(qs + i * D, kr, D);
  }
  // Sums over thousands of keys: the denominator in double, the weighted values in blocks
  // of kBlock keys added to the output block by block, so the rounding grows with
  // kBlock + L / kBlock terms, not L (a sequential float sum over a 4000-token cache drifted
  // ~5x further from BLAS's blocked products than those drift from float64)
  float den[64];  // each head's softmax denominator (nh <= 64: attend's split)
  for (int i = 0; i < nh; ++i) {
    float* pi = p + size_t(i) * S;
    float mx = -INFINITY;
    for (int j = 0; j < L; ++j) mx = std::max(mx, pi[j]);
    for (int j = 0; j < L; ++j) pi[j] = exp_inline(pi[j] - mx);
    double sum = 0.0;
    for (int j = 0; j < L; ++j) sum += pi[j];
    den[i] = float(sum);
  }
  float* blk = w.blk.data();  // (nh, Dv)
  auto out_of = [&](int h) {
    return a.out + (a.heads_last ? (int64_t(b) * T + t) * H + h : (int64_t(b) * H + h) * T + t) * Dv;
  };
  for (int i = 0; i < nh; ++i) std::fill(out_of(h0 + i), out_of(h0 + i) + Dv, 0.0f);
  constexpr int kBlock = 32;
  for (int j0 = 0; j0 < L; j0 += kBlock) {
    std::fill(blk, blk + size_t(nh) * Dv, 0.0f);
    for (int j = j0; j < std::min(L, j0 + kBlock); ++j) {
      const float* vr = a.v.row(b, g, j);
      for (int i = 0; i < nh; ++i) {
        const float pj = p[size_t(i) * S + j] / den[i];
        float* bi = blk + size_t(i) * Dv;
        for (int d = 0; d < Dv; ++d) bi[d] += pj * vr[d];
      }
    }
    for (int i = 0; i < nh; ++i) {
      float* o = out_of(h0 + i);
      for (int d = 0; d < Dv; ++d) o[d] += blk[size_t(i) * Dv + d];
    }
  }
}

// Items: (row, KV head, query position, chunk of `per_item` of the KV head's query heads)
struct AttendCtx {
  const AttendArgs* a;
  int per_task, items, per_item;
};

QMV_CLONES void attend_task(void* vctx, int task) {
  auto* c = static_cast<AttendCtx*>(vctx);
  const AttendArgs& a = *c->a;
  const int T = a.q.n[2], Hkv = a.k.n[1], G = a.q.n[1] / Hkv;
  const int chunks = (G + c->per_item - 1) / c->per_item;
  AttendScratch w;
  w.qs.resize(size_t(c->per_item) * a.q.n[3]);
  w.p.resize(size_t(c->per_item) * a.k.n[2]);
  w.blk.resize(size_t(c->per_item) * a.v.n[3]);
  const int i0 = task * c->per_task, i1 = std::min(c->items, i0 + c->per_task);
  for (int i = i0; i < i1; ++i) {
    int r = i;
    const int ch = r % chunks;
    r /= chunks;
    const int t = r % T;
    r /= T;
    const int g = r % Hkv, b = r / Hkv;
    const int first = ch * c->per_item;
    attend_heads(a, b, g, t, g * G + first, std::min(c->per_item, G - first), w);
  }
}

struct GatedCtx {
  const float *g, *u;
  float* out;
  int64_t n, per_task;
  int act;
};

QMV_CLONES void gated_span(const float* g, const float* u, int64_t n, int act, float* out) {
  if (act == 0) {
    for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + exp_inline(-g[i])) * u[i];
  } else {
    constexpr float c = -2.0f * 0.7978845608028654f;  // -2 sqrt(2/pi)
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i];
      out[i] = x / (1.0f + exp_inline(c * (x + 0.044715f * x * x * x))) * u[i];
    }
  }
}

void gated_task(void* vctx, int task) {
  auto* c = static_cast<GatedCtx*>(vctx);
  const int64_t i0 = task * c->per_task, n = std::min(c->n - i0, c->per_task);
  gated_span(c->g + i0, c->u + i0, n, c->act, c->out + i0);
}

}  // namespace

void attend(const AttendArgs& a) {
  const int B = a.q.n[0], H = a.q.n[1], T = a.q.n[2], Hkv = a.k.n[1], G = H / Hkv;
  const int64_t work = int64_t(B) * H * T * a.k.n[2] * (a.q.n[3] + a.v.n[3]);
  const int nth = work < kParallelWork ? 1 : num_threads();
  // a KV head's query heads together (each key row read once for them), split in chunks
  // while there are fewer than 2 items a thread; at most 64 heads an item
  const int base = B * Hkv * T;
  int chunks = base >= 2 * nth ? 1 : std::min(G, (2 * nth + base - 1) / base);
  chunks = std::max(chunks, (G + 63) / 64);
  const int per_item = (G + chunks - 1) / chunks;
  const int items = base * ((G + per_item - 1) / per_item);
  AttendCtx ctx{&a, items, items, per_item};
  if (nth == 1) {
    attend_task(&ctx, 0);
    return;
  }
  const int tasks = std::min(items, 4 * nth);
  ctx.per_task = (items + tasks - 1) / tasks;
  parallel_for((items + ctx.per_task - 1) / ctx.per_task, attend_task, &ctx);
}

void gated(const float* g, const float* u, int64_t n, int act, float* out) {
  if (n < kParallelWork) return gated_span(g, u, n, act, out);
  GatedCtx ctx{g, u, out, n, 1 << 14, act};
  parallel_for(int((n + ctx.per_task - 1) / ctx.per_task), gated_task, &ctx);
}

}  // namespace qmv
