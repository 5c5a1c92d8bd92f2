// Python binding (nanobind). mx.array crosses into this module through
// mlx.core's own nanobind type registration: the module must be built with the
// same nanobind internals ABI and NB_DOMAIN mlx (see CMakeLists.txt), and
// mlx.core must be imported before this module is used.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>

#include "compute.h"
#include "fused.h"
#include "pool.h"
#include "qmv.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

NB_MODULE(_qmv, m) {
  m.doc() = "CPU quantized matrix-vector products on MLX's affine quantized layout";

  m.def("qmv", &qmv::quantized_matvec, "x"_a, "wq"_a, "scales"_a, "biases"_a.none(),
        "group_size"_a = 64, "bits"_a = 4, "supers"_a.none() = nb::none(),
        "x @ w.T for w given as mx.quantize's (wq, scales, biases); float32 result, CPU. "
        "biases None: a symmetric format, bias = -2^(bits-1) * scale. supers (N, K/256, 2) "
        "float16: a super-block format, uint8/int8 scales sc and uint8 biases m, the group's "
        "scale d*sc and bias -dmin*m.");

  m.def("qmv_many",
        [](const mx::array& x, const std::vector<mx::array>& wq, const std::vector<mx::array>& scales,
           const std::vector<std::optional<mx::array>>& biases, const std::vector<int>& group_size,
           const std::vector<int>& bits, const std::vector<std::optional<mx::array>>& supers) {
          const size_t n = wq.size();
          if (scales.size() != n || biases.size() != n || group_size.size() != n ||
              bits.size() != n || supers.size() != n)
            throw std::invalid_argument("[qmv] one scales, biases, group_size, bits and supers a w");
          std::vector<qmv::QuantPart> parts;
          for (size_t i = 0; i < n; ++i)
            parts.push_back({wq[i], scales[i], biases[i], supers[i], group_size[i], bits[i]});
          return qmv::quantized_matvecs(x, parts);
        },
        "x"_a, "wq"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a, "supers"_a,
        "qmv of one x by each w (lists, one entry a product, at most 4): one node, one job for "
        "the threads on a decode's rows; the same results as qmv's.");
  m.def("rms_norm", &qmv::fused_rms_norm, "x"_a, "w"_a.none(), "eps"_a,
        "x / sqrt(mean(x^2, -1) + eps) * w, float32, one CPU node.");
  m.def("rope", &qmv::fused_rope, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a,
        "offset"_a, "offsets"_a.none(), "periods"_a.none(), "heads"_a = 0,
        "RoPE of x (B, H, T, D) from `offset` (or per-row `offsets`), float32, one CPU node; "
        "heads > 0: x (B, T, heads[, D]) in, (B, heads, T, D) out.");
  m.def("attend", &qmv::fused_attend, "q"_a, "k"_a, "v"_a, "scale"_a, "causal"_a,
        "mask"_a.none(), "heads_last"_a = false,
        "softmax((q * scale) k^T [masked]) v for GQA heads, float32, one CPU node; "
        "heads_last: out (B, T, H * Dv).");
  m.def("gated", &qmv::fused_gated, "gate"_a, "up"_a, "act"_a,
        "act(gate) * up (act 0 silu, 1 gelu_tanh), float32, one CPU node.");

  // The same kernels on numpy arrays, without MLX (no graph, no stream thread): for
  // callers outside MLX and for testing the pool in a fork()ed child, where MLX itself
  // cannot evaluate once the parent has (its stream thread is not in the child).
  using F2 = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
  using U2 = nb::ndarray<const uint32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
  m.def("qmv_numpy", [](F2 x, U2 wq, F2 scales, std::optional<F2> biases, int group_size,
                        int bits) {
        const int M = int(x.shape(0)), K = int(x.shape(1)), N = int(wq.shape(0));
        // bits and group_size first: K % group_size must not divide by zero
        if (bits < 2 || bits > 8 || bits == 7 || group_size <= 0 || group_size % 16 ||
            size_t(K) * bits != wq.shape(1) * 32 || K % group_size || K % 32 ||
            scales.shape(0) != size_t(N) || scales.shape(1) != size_t(K / group_size) ||
            (biases && (biases->shape(0) != scales.shape(0) ||
                        biases->shape(1) != scales.shape(1))))
          throw std::invalid_argument("[qmv] inconsistent shapes, bits or group_size");
        float* out = new float[size_t(M) * N];
        nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
        qmv::Problem p{};
        p.x = x.data(); p.M = M; p.N = N; p.K = K; p.group = group_size; p.bits = bits;
        p.wq = wq.data(); p.scales = scales.data(); p.biases = biases ? biases->data() : nullptr;
        p.sb_type = qmv::SB_F32; p.out = out;
        {
          nb::gil_scoped_release unlocked;
          qmv::compute(p);
        }
        return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, {size_t(M), size_t(N)}, owner);
      }, "x"_a, "wq"_a, "scales"_a, "biases"_a.none(), "group_size"_a, "bits"_a,
      "qmv on float32 / uint32 numpy arrays (C-contiguous); returns a new numpy array.");

  m.def("set_num_threads", &qmv::set_num_threads, "n"_a,
        "Threads per call, the calling thread included (<= 0: the default).");
  m.def("num_threads", &qmv::num_threads);
  m.def("isa", &qmv::isa, "Kernels in use: 'avx512', 'avx2', 'neon' or 'scalar'.");
  m.def("prompt_route", &qmv::prompt_route,
        "Where prompt rows go: 'own' (the ISA's product), 'sgemm' (dequantized tiles into "
        "sgemm) or 'decode' (the decode kernels).");
  m.def("set_isa", [](const std::string& s) { return qmv::set_isa(s.c_str()); }, "name"_a,
        "'avx512' | 'avx2' | 'neon' | 'scalar' | 'auto'; False if not available here.");
  m.def("set_sgemm", [](uintptr_t addr) { qmv::set_sgemm(reinterpret_cast<void*>(addr)); },
        "address"_a,
        "Use this cblas_sgemm-compatible function (e.g. ctypes.cast(lib.scipy_cblas_sgemm, "
        "c_void_p).value) for the prefill path's tiles; 0: none (prompts then take the ISA's own "
        "product, or else the decode kernels).");
  m.def("sgemm_address", [] { return reinterpret_cast<uintptr_t>(qmv::sgemm_ptr()); });
  m.def("set_prefill", [](int min_m, int tile_rows, bool gemm) {
        qmv::settings().prefill_min_m = min_m;
        qmv::settings().tile_rows = tile_rows;
        qmv::settings().gemm = gemm;
      }, "min_m"_a = 0, "tile_rows"_a = 0, "gemm"_a = true,
      "M >= min_m (0: automatic): the ISA's own prefill product (AVX-512) if gemm, else "
      "dequantized tiles of tile_rows rows (0: automatic) into sgemm.");
  m.def("pool_stats", [] {
    const qmv::PoolStats s = qmv::pool_stats();
    nb::dict d;
    d["runs"] = s.runs;
    d["joined"] = s.joined;
    d["wait_ns"] = s.wait_ns;
    d["slept"] = s.slept;
    d["alone"] = s.alone;
    return d;
  }, "The pool since the process started: runs, runs a worker joined, the caller's wait for "
     "joined workers (ns), how often it slept for one, and jobs it then ran alone.");
  m.def("counters", [] {
    auto c = qmv::counters();
    nb::dict d;
    d["decode"] = c.decode;
    d["prefill"] = c.prefill;
    d["gemm"] = c.gemm;
    d["prefill_fallback"] = c.prefill_fallback;
    return d;
  });
}
