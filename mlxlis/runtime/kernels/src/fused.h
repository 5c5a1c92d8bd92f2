// Fused CPU primitives for the per-token work around the quantized products: RMSNorm,
// RoPE, attention over a cache, the gated activations. Each is one node where MLX's CPU
// backend runs a chain of small operations (~7-13 us each there), so a decode step costs
// far fewer of them (and a prompt's attention runs on every core). float32 in and out; the
// callers
// (mlxlis/runtime/fused.py) keep MLX's own operations for anything else.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace qmv {

namespace mx = mlx::core;

enum class FusedOp : int { RmsNorm = 0, Rope = 1, Attend = 2, Gated = 3 };

// x (..., D) [w (D)]: x / sqrt(mean(x^2) + eps) * w
mx::array fused_rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps);
// x (B, H, T, D) turned from position `offset` (an int, or offsets (B,) int32); with
// `heads` > 0, x is (B, T, heads, D) or (B, T, heads * D) (a projection's output) and the
// result is still (B, heads, T, D): the transpose done by the same pass
mx::array fused_rope(const mx::array& x, int dims, bool traditional, float base, float scale,
                     int offset, const std::optional<mx::array>& offsets,
                     const std::optional<mx::array>& periods, int heads);
// q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) -> (B, H, T, Dv), or (B, T, H * Dv)
// when `heads_last` (the output projection's input, without a transpose and a reshape);
// mask: bool broadcastable to (B, 1, T, S), True = attend. T > kFewQueries (a prompt's
// chunk): attend_blocks, else attend (fused_kernels.h)
mx::array fused_attend(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                       bool causal, const std::optional<mx::array>& mask, bool heads_last);
// act(g) * u, act 0 silu, 1 gelu_tanh
mx::array fused_gated(const mx::array& g, const mx::array& u, int act);

class Fused : public mx::UnaryPrimitive {
 public:
  Fused(mx::Stream s, FusedOp op, std::vector<float> f, std::vector<int> i)
      : mx::UnaryPrimitive(s), op_(op), f_(std::move(f)), i_(std::move(i)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override;
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  FusedOp op_;
  std::vector<float> f_;  // float parameters (eps; base, scale; scale)
  std::vector<int> i_;    // int parameters (dims, traditional, offset, flags; causal; act)
};

}  // namespace qmv
