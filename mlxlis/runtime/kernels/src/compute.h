// The kernels' driver: ISA choice, threading, and the prefill (M large) path.
// Independent of MLX (operates on raw dense row-major buffers).
#pragma once

#include "kernels.h"

namespace qmv {

// cblas_sgemm's C signature (enums as ints: RowMajor 101, NoTrans 111, Trans 112)
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                         int, float, float*, int);

// Which kernels run: "avx512" (VNNI + VBMI), "avx2", "neon" or "scalar" (chosen once
// from the CPU; $QMV_ISA=avx2 or scalar forces those); set_isa returns false if unavailable.
const char* isa();
bool set_isa(const char* name);

// Where prompt rows go (compute's choice): "own" (the ISA's product, gemm_impl.h), "sgemm"
// (dequantized tiles into sgemm) or "decode" (the decode kernels: no BLAS).
const char* prompt_route();

// sgemm for the prefill path: set explicitly (an address from ctypes), else
// looked up once as dlsym(RTLD_DEFAULT, "cblas_sgemm") -- the symbol MLX
// itself resolves, i.e. mlxlis' dispatch to OpenBLAS when it is loaded.
void set_sgemm(void* fn);
void* sgemm_ptr();

struct Settings {
  int prefill_min_m = 0;   // M >= this: the prefill path (0: the ISA's product's own, else 17)
  int tile_rows = 0;       // rows of w per dequantized tile into sgemm (0: ~8 MiB of floats)
  bool gemm = true;        // the ISA's own prefill product where it has one (x86)
};
Settings& settings();

// Per-path call counters (for tests).
struct Counters {
  long decode = 0, prefill = 0, gemm = 0, prefill_fallback = 0;
};
Counters counters();

// out (M x N) = x (M x K) @ w.T. p.xsum is computed here (p.xsum ignored).
void compute(const Problem& p);

// Several products of one x (each Problem's x, M and K the same), up to kMaxProducts: as
// compute() on each, the decode rows as one job for the pool (the same bits).
constexpr int kMaxProducts = 4;
void compute_many(const Problem* ps, int n);

}  // namespace qmv
