#include "compute.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "pool.h"

namespace qmv {

namespace {

using RowsFn = void (*)(const Problem&, int, int, int, int);
using DequantFn = void (*)(const Problem&, int, int, float*);

// An ISA's prompt product (gemm_impl.h): from how many rows of x it runs (where it beats the
// decode kernels, which read w once but redo its codes' unpacking and each group's reduction
// for every 4 rows of x: measured on the 1.5B's shapes), its panel of x rows, entry points.
struct Gemm {
  int min_m, panel;
  void (*pack)(const float*, int, int, int, int, int, float*);
  size_t (*scratch)(int, int);
  void (*run)(const Problem&, const float*, int, int, int, int, float*);
};

struct Isa {
  const char* name;
  RowsFn rows;
  DequantFn dequant;
  const Gemm* gemm;  // a prompt product of its own, else dequantized tiles + sgemm
};

constexpr Isa kScalar{"scalar", rows_scalar, dequant_scalar, nullptr};
#if defined(__x86_64__)
// AVX2 from 10 rows too: 6-8 rows cost 14.5 / 18.2 ms through the decode kernels against
// 19.9 / 19.5 through the product (the 1.5B's shapes, AVX2 code on a Zen 4; 12 rows: 25.4
// against 23.3)
constexpr Gemm kGemmAvx2{10, kPanelAvx2, pack_x_avx2, gemm_scratch_avx2, gemm_avx2};
constexpr Gemm kGemmAvx512{10, kPanelAvx512, pack_x_avx512, gemm_scratch_avx512, gemm_avx512};
constexpr Isa kAvx2{"avx2", rows_avx2, dequant_avx2, &kGemmAvx2};
constexpr Isa kAvx512{"avx512", rows_avx512, dequant_avx2, &kGemmAvx512};  // VNNI + VBMI
#endif
#if defined(__aarch64__)
constexpr Isa kNeon{"neon", rows_neon, dequant_neon, nullptr};
#endif

bool isa_available(const Isa& i) {
#if defined(__x86_64__)
  if (&i == &kAvx2) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  if (&i == &kAvx512) {
    return isa_available(kAvx2) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  }
#endif
  return true;  // scalar; NEON is baseline on arm64
}

const Isa* best_isa() {
  const char* env = getenv("QMV_ISA");
  if (env && strcmp(env, "scalar") == 0) return &kScalar;
#if defined(__x86_64__)
  if (isa_available(kAvx512) && !(env && strcmp(env, "avx2") == 0)) return &kAvx512;
  if (isa_available(kAvx2)) return &kAvx2;
#endif
#if defined(__aarch64__)
  return &kNeon;
#endif
  return &kScalar;
}

std::atomic<const Isa*> g_isa{nullptr};
const Isa& cur_isa() {
  const Isa* i = g_isa.load(std::memory_order_acquire);
  if (!i) {
    i = best_isa();
    g_isa.store(i, std::memory_order_release);
  }
  return *i;
}

std::atomic<void*> g_sgemm{nullptr};
std::atomic<bool> g_sgemm_looked{false};
Settings g_settings;
std::atomic<long> c_decode{0}, c_prefill{0}, c_gemm{0}, c_fallback{0};

// ---- decode path: fused kernel, rows split into tasks ----------------------

struct DecodeCtx {
  const Problem* p;
  RowsFn rows;
  int rows_per_task;
};

void decode_task(void* vctx, int t) {
  auto* c = static_cast<DecodeCtx*>(vctx);
  const Problem& p = *c->p;
  const int n0 = t * c->rows_per_task, n1 = std::min(p.N, n0 + c->rows_per_task);
  // all M rows of x for these weight rows (read from memory once; the m-blocks
  // after the first find the rows in L1/L2)
  for (int m0 = 0; m0 < p.M; m0 += kMaxMB) c->rows(p, m0, std::min(kMaxMB, p.M - m0), n0, n1);
}

// The decode tasks of p: ~16 KiB of weights each (L1-resident across the m-blocks), >= 1
// row, and at least ~4 a thread for balance when N is small.
int decode_tasks(const Problem& p, RowsFn rows, DecodeCtx& ctx) {
  const size_t row_bytes = size_t(p.K) * p.bits / 8;
  int rpt = int(std::max<size_t>(1, (16 << 10) / row_bytes));
  const int nth = num_threads();
  rpt = std::max(1, std::min(rpt, (p.N + 4 * nth - 1) / (4 * nth)));
  ctx = DecodeCtx{&p, rows, rpt};
  return (p.N + rpt - 1) / rpt;
}

// tiny products: not worth waking anyone
bool tiny(const Problem& p) { return size_t(p.N) * p.K * p.bits / 8 < (64u << 10); }

void run_decode(const Problem& p, const Isa& isa) {
  DecodeCtx ctx;
  const int ntasks = decode_tasks(p, isa.rows, ctx);
  if (tiny(p)) {
    for (int t = 0; t < ntasks; ++t) decode_task(&ctx, t);
  } else {
    parallel_for(ntasks, decode_task, &ctx);
  }
}

// Several products of one x (a layer's q, k and v; its gate and up) as one job: one hand-off
// to the pool instead of one each, and the small ones (k, v) spread over the threads too.
struct ManyCtx {
  DecodeCtx parts[kMaxProducts];
  int first[kMaxProducts + 1];  // the parts' first task; first[n]: all of them
  int n;
};

void many_task(void* vctx, int t) {
  auto* c = static_cast<ManyCtx*>(vctx);
  int i = 0;
  while (t >= c->first[i + 1]) ++i;
  decode_task(&c->parts[i], t - c->first[i]);
}

// ---- prefill path: dequantize a tile of rows, sgemm on it -------------------

struct DequantCtx {
  const Problem* p;
  DequantFn dequant;
  int n0, n1, rows_per_task;
  float* dst;
};

void dequant_task(void* vctx, int t) {
  auto* c = static_cast<DequantCtx*>(vctx);
  const int a = c->n0 + t * c->rows_per_task, b = std::min(c->n1, a + c->rows_per_task);
  c->dequant(*c->p, a, b, c->dst + size_t(a - c->n0) * c->p->K);
}

SgemmFn get_sgemm() {
  void* f = g_sgemm.load(std::memory_order_acquire);
  if (!f && !g_sgemm_looked.exchange(true)) {
    f = dlsym(RTLD_DEFAULT, "cblas_sgemm");
    void* expected = nullptr;
    g_sgemm.compare_exchange_strong(expected, f);
    f = g_sgemm.load();
  }
  return reinterpret_cast<SgemmFn>(f);
}

void run_prefill(const Problem& p, const Isa& isa, SgemmFn sgemm) {
  int tile = g_settings.tile_rows;
  // ~8 MiB of floats a tile: each sgemm call has a fixed cost (OpenBLAS wakes its threads
  // and packs), so 1 MiB tiles (~1400 calls for Qwen2.5-0.5B's layers) made a 63-token
  // prefill 570 ms against 376 ms dense; 8 MiB: 420 ms (16 MiB and more: 405 ms)
  if (tile <= 0) tile = int(std::clamp<size_t>((8u << 20) / (size_t(p.K) * 4), 32, 1 << 16));
  tile = std::min(tile, p.N);
  // scratch reused across calls on this thread (MLX's stream thread)
  thread_local std::vector<float> scratch;
  if (scratch.size() < size_t(tile) * p.K) scratch.resize(size_t(tile) * p.K);
  for (int n0 = 0; n0 < p.N; n0 += tile) {
    const int n1 = std::min(p.N, n0 + tile);
    // the tile dequantized on the pool's threads too: with OpenBLAS's threads sleeping
    // soon after each product (runtime/blas.py sets OPENBLAS_THREAD_TIMEOUT), the two pools
    // no longer fight for the cores between tiles, as they did spinning (20-60x slowdowns)
    const int per = std::max(1, (n1 - n0 + 2 * num_threads() - 1) / (2 * num_threads()));
    DequantCtx dc{&p, isa.dequant, n0, n1, per, scratch.data()};
    parallel_for((n1 - n0 + per - 1) / per, dequant_task, &dc);
    // out[:, n0:n1] = x (M x K) @ tile.T  (row-major, ldc = N)
    sgemm(101, 111, 112, p.M, n1 - n0, p.K, 1.0f, p.x, p.K, scratch.data(), p.K, 0.0f,
          p.out + n0, p.N);
  }
}

// ---- prefill path: the ISA's own product (gemm_impl.h) ---------------------

struct PackCtx {
  const Gemm* g;
  const float* x;
  int M, K, kstep, nk;
  float* xt;
};

void pack_task(void* vctx, int t) {
  auto* c = static_cast<PackCtx*>(vctx);
  const int k0 = (t % c->nk) * c->kstep;
  c->g->pack(c->x, c->M, c->K, t / c->nk, k0, std::min(c->K, k0 + c->kstep), c->xt);
}

struct GemmCtx {
  const Gemm* g;
  const Problem* p;
  const float* xt;
  int units, panels;  // w's rows in units of 24, x's panels
  int nu, ng;         // split evenly into nu x ng tasks (a task: some rows, a group of panels)
  int max_rows, max_panels;
};

void gemm_task(void* vctx, int t) {
  auto* c = static_cast<GemmCtx*>(vctx);
  const Problem& p = *c->p;
  thread_local std::vector<float> scratch;  // each thread's: dequantized w, out transposed
  const size_t need = c->g->scratch(c->max_panels, c->max_rows);
  if (scratch.size() < need) scratch.resize(need);
  const int u = t % c->nu, gi = t / c->nu;  // (a group's tasks in a row: its x stays in cache)
  const int n0 = int(long(u) * c->units / c->nu) * 24;
  const int n1 = std::min(p.N, int(long(u + 1) * c->units / c->nu) * 24);
  const int pa = int(long(gi) * c->panels / c->ng), pb = int(long(gi + 1) * c->panels / c->ng);
  c->g->run(p, c->xt, n0, n1, pa, pb, scratch.data());
}

void run_gemm(const Problem& p, const Gemm& g) {
  thread_local std::vector<float> xt;  // the caller's (MLX's stream thread)
  const int panels = (p.M + g.panel - 1) / g.panel;
  if (xt.size() < size_t(panels) * p.K * g.panel) xt.resize(size_t(panels) * p.K * g.panel);
  PackCtx pc{&g, p.x, p.M, p.K, 256, (p.K + 255) / 256, xt.data()};
  parallel_for(panels * pc.nk, pack_task, &pc);
  // A task: up to 384 weight rows (16 units of 24, the register tiles' rows) by a group of
  // ~512 of x's rows. A block of a panel of x (128 columns) comes into L1 from outer caches
  // once a task and is read there by each of the task's register tiles (6-24 weight rows
  // each): 96-row tasks fetched x four times as often, and the 1.5B's 512-row products took
  // ~6% longer. The groups of panels keep a task's out (transposed, summed block by block)
  // in L2: 768 KiB at 384 x 512. The task count a multiple of the threads where the rows
  // allow it (640 rows in 96-row tasks were 7 on 2 threads, one idle an eighth of the time),
  // else more groups of panels (a few weight rows by a long prompt: every thread busy).
  const int nth = num_threads(), units = (p.N + 23) / 24;
  int ng = (panels * g.panel + 511) / 512, nu = (units + 15) / 16;
  while ((nu * ng) % nth && nu < units) ++nu;
  while ((nu * ng) % nth && ng < panels) ++ng;
  GemmCtx gc{&g, &p, xt.data(), units, panels, nu, ng, (units + nu - 1) / nu * 24,
             (panels + ng - 1) / ng};
  parallel_for(nu * ng, gemm_task, &gc);
  if (xt.size() > (4u << 20)) std::vector<float>().swap(xt);  // a long prompt's: not kept
}

// The ISA's prompt product when it has one and it is not set aside.
const Gemm* prompt_gemm() { return g_settings.gemm ? cur_isa().gemm : nullptr; }

}  // namespace

const char* isa() { return cur_isa().name; }

const char* prompt_route() {
  return prompt_gemm() ? "own" : get_sgemm() ? "sgemm" : "decode";
}

bool set_isa(const char* name) {
  const Isa* cands[] = {
      &kScalar,
#if defined(__x86_64__)
      &kAvx2, &kAvx512,
#endif
#if defined(__aarch64__)
      &kNeon,
#endif
  };
  for (const Isa* i : cands) {
    if (strcmp(i->name, name) == 0 && isa_available(*i)) {
      g_isa.store(i);
      return true;
    }
  }
  if (strcmp(name, "auto") == 0) {
    g_isa.store(best_isa());
    return true;
  }
  return false;
}

void set_sgemm(void* fn) {
  g_sgemm.store(fn);
  g_sgemm_looked.store(true);
}
void* sgemm_ptr() { return reinterpret_cast<void*>(get_sgemm()); }

Settings& settings() { return g_settings; }

Counters counters() {
  return {c_decode.load(), c_prefill.load(), c_gemm.load(), c_fallback.load()};
}

namespace {

// The ISA whose decode kernels take p (the CPU's, unless they cannot).
const Isa* decode_isa(const Problem& p) {
  const Isa* ip = &cur_isa();
#if defined(__aarch64__)
  // the NEON kernels go a group of 32+ at a time, with stored float biases
  if (p.group < 32 || !p.biases || sb_super(p.sb_type)) ip = &kScalar;
#endif
#if defined(__x86_64__)
  // the AVX-512 kernels expand a row's super-block scales on the stack (kMaxSuperGroups)
  if (ip == &kAvx512 && sb_super(p.sb_type) && p.K / p.group > kMaxSuperGroups) ip = &kAvx2;
#endif
  return ip;
}

// From how many rows of x a product takes the prompt route.
int prompt_min_m() {
  const Gemm* gemm = prompt_gemm();
  // automatic: the ISA's product's own threshold, else from 17 rows the sgemm route
  return g_settings.prefill_min_m > 0 ? g_settings.prefill_min_m : gemm ? gemm->min_m : 17;
}

// Scratch of the caller's thread (MLX's stream thread), reused across calls: x as the decode
// kernels read it, a part of a job each (compute_many) where the kinds differ.
struct XScratch {
  std::vector<float> xsum[kMaxProducts], xe, xs4;
  std::vector<int8_t> xd;
};
thread_local XScratch t_x;

// x as the decode kernels of `isa` read it, written into p: AVX-512's digits, else the sums
// of x over each group (the float kernels' bias term), in slot `slot` of the scratch.
void prepare_x(Problem& p, const Isa* isa, int slot) {
#if defined(__x86_64__)
  if (isa == &kAvx512) {
    const size_t blocks = size_t(p.M) * ((p.K + 63) / 64);
    if (t_x.xd.size() < blocks * 192) t_x.xd.resize(blocks * 192);
    if (t_x.xe.size() < blocks * 16) t_x.xe.resize(blocks * 16), t_x.xs4.resize(blocks * 16);
    prep_x_avx512(p.x, p.M, p.K, t_x.xd.data(), t_x.xe.data(), t_x.xs4.data());
    p.xd = t_x.xd.data(), p.xe = t_x.xe.data(), p.xs4 = t_x.xs4.data();
    return;
  }
#endif
  (void)isa;
  const int G = p.K / p.group;
  std::vector<float>& xs = t_x.xsum[slot];
  if (xs.size() < size_t(p.M) * G) xs.resize(size_t(p.M) * G);
  for (int m = 0; m < p.M; ++m)
    for (int g = 0; g < G; ++g) {
      const float* xg = p.x + size_t(m) * p.K + size_t(g) * p.group;
      float s = 0.0f;
      for (int k = 0; k < p.group; ++k) s += xg[k];
      xs[size_t(m) * G + g] = s;
    }
  p.xsum = xs.data();
}

// A prompt's digits (the decode kernels without BLAS) are not kept.
void release_x() {
  if (t_x.xd.size() > (4u << 20)) {
    std::vector<int8_t>().swap(t_x.xd);
    std::vector<float>().swap(t_x.xe), std::vector<float>().swap(t_x.xs4);
  }
}

}  // namespace

void compute(const Problem& p_in) {
  Problem p = p_in;
  const Isa* ip = decode_isa(p);
  if (p.M >= prompt_min_m()) {
    if (const Gemm* gemm = prompt_gemm()) {  // (no limit on a row's super-block groups)
      c_gemm.fetch_add(1, std::memory_order_relaxed);
      run_gemm(p, *gemm);
      return;
    }
    if (SgemmFn f = get_sgemm()) {
      c_prefill.fetch_add(1, std::memory_order_relaxed);
      run_prefill(p, *ip, f);
      return;
    }
    c_fallback.fetch_add(1, std::memory_order_relaxed);  // no BLAS: fused kernel
  } else {
    c_decode.fetch_add(1, std::memory_order_relaxed);
  }
  prepare_x(p, ip, 0);
  run_decode(p, *ip);
  release_x();
}

void compute_many(const Problem* ps, int n) {
  if (n < 1 || n > kMaxProducts || ps[0].M >= prompt_min_m()) {
    for (int i = 0; i < n; ++i) compute(ps[i]);
    return;
  }
  c_decode.fetch_add(n, std::memory_order_relaxed);
  Problem p[kMaxProducts];
  ManyCtx ctx{};
  ctx.n = n;
  bool all_tiny = true;
  const Problem* digits = nullptr;  // the part whose AVX-512 digits of x the others share
  for (int i = 0; i < n; ++i) {
    p[i] = ps[i];
    const Isa* ip = decode_isa(p[i]);
    if (digits && ip == decode_isa(*digits) && digits->xd) {
      p[i].xd = digits->xd, p[i].xe = digits->xe, p[i].xs4 = digits->xs4;
    } else {
      prepare_x(p[i], ip, i);
      if (p[i].xd) digits = &p[i];
    }
    ctx.first[i + 1] = ctx.first[i] + decode_tasks(p[i], ip->rows, ctx.parts[i]);
    all_tiny = all_tiny && tiny(p[i]);
  }
  if (all_tiny) {
    for (int t = 0; t < ctx.first[n]; ++t) many_task(&ctx, t);
  } else {
    parallel_for(ctx.first[n], many_task, &ctx);
  }
}

}  // namespace qmv
