// The MLX side: an op building a graph node, and its Primitive.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace qmv {

namespace mx = mlx::core;

// x @ w.T for w (N, K) in MLX's affine quantized layout (as mx.quantize
// returns it): wq uint32 (N, K*bits/32), scales and biases (N, K/group_size) of
// float32, float16 or bfloat16. x: (..., K), float32 (float16/bfloat16 are cast
// to float32); result (..., N) float32. Always evaluated on the CPU.
// bits in {2, 3, 4, 5, 6, 8}, group_size in {16, 32, 64, 128} (16: K a multiple of 32;
// MLX's own quantized ops do not take it).
// `supers` (N, K/256, 2) float16: a super-block format (GGUF's K-quants as stored): scales
// uint8 or int8 (sc), biases uint8 (m) or none, group 16 or 32, K a multiple of 256; the
// group's scale is d·sc and its bias −dmin·m, (d, dmin) its super-block's pair.
mx::array quantized_matvec(const mx::array& x, const mx::array& wq, const mx::array& scales,
                           const std::optional<mx::array>& biases, int group_size, int bits,
                           const std::optional<mx::array>& supers);

// One product of several of one x (quantized_matvecs): w as quantized_matvec takes it.
struct QuantPart {
  mx::array wq, scales;
  std::optional<mx::array> biases, supers;
  int group_size, bits;
};

// x @ w.T for each part (at most kMaxProducts, compute.h), one node: one job for the CPU
// kernels' threads where x has a decode's rows, results the same bits as quantized_matvec's.
std::vector<mx::array> quantized_matvecs(const mx::array& x, const std::vector<QuantPart>& parts);

// A pointer to a's elements in dense row-major order: a's own data when it is
// row-contiguous, else a gathered copy kept in `keep`.
const void* dense_data(const mx::array& a, std::vector<char>& keep);

// The start of a CPU primitive's eval_cpu: out's buffer allocated here (the caller may
// chain further nodes on its pointer before the task runs), the inputs and out registered
// with the stream's encoder, whose dispatch then enqueues the work on the stream's thread
// in order after the tasks producing the inputs. Null when out is empty (nothing to run).
mx::cpu::CommandEncoder* cpu_encoder(const mx::Stream& s, const std::vector<mx::array>& inputs,
                                     mx::array& out);

class QuantizedMatVec : public mx::UnaryPrimitive {
 public:
  QuantizedMatVec(mx::Stream stream, int group_size, int bits, bool biases, bool supers)
      : mx::UnaryPrimitive(stream),
        group_size_(group_size),
        bits_(bits),
        biases_(biases),
        supers_(supers) {}

  // Allocates the output and enqueues the kernel on the stream's thread.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "QuantizedMatVec"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_, bits_;
  bool biases_, supers_;  // which of the optional inputs follow x, wq, scales
};

// A part's layout, for QuantizedMatVecs: its inputs after x are wq, scales, then biases and
// supers where it has them.
struct PartSpec {
  int group, bits;
  bool biases, supers;
};

class QuantizedMatVecs : public mx::Primitive {
 public:
  QuantizedMatVecs(mx::Stream stream, std::vector<PartSpec> specs)
      : mx::Primitive(stream), specs_(std::move(specs)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "QuantizedMatVecs"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  std::vector<PartSpec> specs_;
};

}  // namespace qmv
