#include "qmv.h"

#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "compute.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace qmv {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("[qmv] " + msg); }

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << ")";
  return s.str();
}

int sb_type_of(mx::Dtype d) {
  if (d == mx::float32) return SB_F32;
  if (d == mx::float16) return SB_F16;
  if (d == mx::bfloat16) return SB_BF16;
  return -1;
}

}  // namespace

// A pointer to a's elements in dense row-major order: a's own data when it is
// row-contiguous, else a gathered copy in `keep` (rare: a transposed or sliced
// input that MLX did not copy).
const void* dense_data(const mx::array& a, std::vector<char>& keep) {
  if (a.flags().row_contiguous) return a.data<char>();
  const size_t isz = a.itemsize(), n = a.size();
  keep.resize(n * isz);
  const char* src = a.data<char>();
  const int nd = a.ndim();
  std::vector<int> idx(nd, 0);
  for (size_t e = 0; e < n; ++e) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += int64_t(idx[d]) * a.strides()[d];
    std::memcpy(keep.data() + e * isz, src + off * int64_t(isz), isz);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  return keep.data();
}


// N of a product of x_in by (wq, scales, biases, supers), every argument checked.
int checked_rows(const mx::array& x_in, const mx::array& wq, const mx::array& scales,
                 const std::optional<mx::array>& biases, int group_size, int bits,
                 const std::optional<mx::array>& supers) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    fail("bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  if (group_size != 16 && group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be 16, 32, 64 or 128, got " + std::to_string(group_size));
  if (wq.dtype() != mx::uint32 || wq.ndim() != 2)
    fail("wq must be a 2-D uint32 array, got " + shape_str(wq));
  const int N = wq.shape(0);
  const int64_t kbits = int64_t(wq.shape(1)) * 32;
  if (kbits % bits) fail("wq's width is not a whole number of codes");
  const int K = int(kbits / bits);
  if (K == 0 || K % group_size || K % 32) fail("K must be a positive multiple of group_size and 32");
  const int G = K / group_size;
  std::vector<const mx::array*> sb{&scales};
  if (biases) sb.push_back(&*biases);
  for (const mx::array* a : sb) {
    if (a->ndim() != 2 || a->shape(0) != N || a->shape(1) != G)
      fail("scales and biases must have shape (" + std::to_string(N) + ", " + std::to_string(G) +
           "), got " + shape_str(*a));
  }
  if (supers) {
    if (group_size != 16 && group_size != 32) fail("a super-block format takes groups of 16 or 32");
    if (K % 256) fail("a super-block format needs K a multiple of 256, got " + std::to_string(K));
    if (supers->dtype() != mx::float16 || supers->ndim() != 3 || supers->shape(0) != N ||
        supers->shape(1) != K / 256 || supers->shape(2) != 2)
      fail("supers must be float16 (" + std::to_string(N) + ", " + std::to_string(K / 256) +
           ", 2), got " + shape_str(*supers));
    if (scales.dtype() != mx::uint8 && scales.dtype() != mx::int8)
      fail("a super-block format's scales must be uint8 or int8");
    if (biases && biases->dtype() != mx::uint8) fail("a super-block format's biases must be uint8");
  } else {
    for (const mx::array* a : sb)
      if (sb_type_of(a->dtype()) < 0)
        fail("scales and biases must be float32, float16 or bfloat16");
    if (biases && scales.dtype() != biases->dtype())
      fail("scales and biases must have the same dtype");
  }
  if (x_in.ndim() < 1 || x_in.shape(-1) != K)
    fail("x must have last dimension K = " + std::to_string(K) + ", got " + shape_str(x_in));
  if (!mx::issubdtype(x_in.dtype(), mx::Dtype::Category::floating)) fail("x must be floating point");

  return N;
}

mx::array quantized_matvec(const mx::array& x_in, const mx::array& wq, const mx::array& scales,
                           const std::optional<mx::array>& biases, int group_size, int bits,
                           const std::optional<mx::array>& supers) {
  const int N = checked_rows(x_in, wq, scales, biases, group_size, bits, supers);
  const auto s = mx::to_stream({}, mx::Device::cpu);
  mx::array x = x_in.dtype() == mx::float32 ? x_in : mx::astype(x_in, mx::float32, s);
  mx::Shape out_shape = x.shape();
  out_shape.back() = N;
  std::vector<mx::array> in{x, wq, scales};
  if (biases) in.push_back(*biases);
  if (supers) in.push_back(*supers);
  return mx::array(
      std::move(out_shape), mx::float32,
      std::make_shared<QuantizedMatVec>(s, group_size, bits, bool(biases), bool(supers)),
      std::move(in));
}

mx::cpu::CommandEncoder* cpu_encoder(const mx::Stream& s, const std::vector<mx::array>& inputs,
                                     mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return nullptr;
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  return &enc;
}

void QuantizedMatVec::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  // Runs on the thread that called eval; the work itself runs on the stream's thread.
  auto* e = cpu_encoder(stream(), inputs, out);
  if (!e) return;
  auto& enc = *e;
  const int K = inputs[0].shape(-1), N = inputs[1].shape(0);
  // no biases: a symmetric format, the kernels' bias_of
  std::optional<mx::array> bi, su;
  if (biases_) bi = inputs[3];
  if (supers_) su = inputs[biases_ ? 4 : 3];
  enc.dispatch([x = inputs[0], wq = inputs[1], sc = inputs[2], bi, su,
                out_ptr = out.data<float>(), M = int(inputs[0].size() / K), N, K,
                group = group_size_, bits = bits_]() {
    // Arrays captured by value keep their buffers alive until the task ran
    // (MLX also holds them, through a no-op task enqueued after this one).
    std::vector<char> kx, kw, ks, kb, ku;
    Problem p{};
    p.x = static_cast<const float*>(dense_data(x, kx));
    p.wq = static_cast<const uint32_t*>(dense_data(wq, kw));
    p.scales = dense_data(sc, ks);
    p.biases = bi ? dense_data(*bi, kb) : nullptr;
    if (su) {
      p.sb_type = sc.dtype() == mx::uint8 ? SB_U8 : SB_I8;
      p.kd = static_cast<const uint16_t*>(dense_data(*su, ku));
      p.gshift = group == 16 ? 4 : 3;
    } else {
      p.sb_type = sb_type_of(sc.dtype());
    }
    p.M = M;
    p.N = N;
    p.K = K;
    p.group = group;
    p.bits = bits;
    p.out = out_ptr;
    compute(p);
  });
}

void QuantizedMatVec::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[qmv] QuantizedMatVec has no GPU implementation");
}

bool QuantizedMatVec::is_equivalent(const mx::Primitive& other) const {
  auto* o = dynamic_cast<const QuantizedMatVec*>(&other);
  return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->biases_ == biases_ &&
         o->supers_ == supers_;
}

std::vector<mx::Shape> QuantizedMatVec::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape s = inputs[0].shape();
  s.back() = inputs[1].shape(0);
  return {s};
}

std::vector<mx::array> quantized_matvecs(const mx::array& x_in, const std::vector<QuantPart>& parts) {
  if (parts.empty() || parts.size() > size_t(kMaxProducts))
    fail("between 1 and " + std::to_string(kMaxProducts) + " products, got " +
         std::to_string(parts.size()));
  const auto s = mx::to_stream({}, mx::Device::cpu);
  mx::array x = x_in.dtype() == mx::float32 ? x_in : mx::astype(x_in, mx::float32, s);
  std::vector<mx::array> in{x};
  std::vector<mx::Shape> shapes;
  std::vector<PartSpec> specs;
  for (const QuantPart& q : parts) {
    const int N = checked_rows(x_in, q.wq, q.scales, q.biases, q.group_size, q.bits, q.supers);
    mx::Shape shape = x.shape();
    shape.back() = N;
    shapes.push_back(std::move(shape));
    specs.push_back({q.group_size, q.bits, bool(q.biases), bool(q.supers)});
    in.push_back(q.wq);
    in.push_back(q.scales);
    if (q.biases) in.push_back(*q.biases);
    if (q.supers) in.push_back(*q.supers);
  }
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(parts.size(), mx::float32),
                                std::make_shared<QuantizedMatVecs>(s, std::move(specs)),
                                std::move(in));
}

void QuantizedMatVecs::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  if (inputs[0].size() == 0) return;  // no rows of x: every output is empty
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  std::vector<float*> outs;
  for (auto& o : outputs) {
    enc.set_output_array(o);
    outs.push_back(o.data<float>());
  }
  enc.dispatch([inputs, outs, specs = specs_]() {
    // Arrays captured by value keep their buffers alive until the task ran.
    const mx::array& x = inputs[0];
    const int K = x.shape(-1), M = int(x.size() / K);
    std::vector<char> kx;
    std::vector<std::vector<char>> keep(4 * specs.size());
    const float* xp = static_cast<const float*>(dense_data(x, kx));
    Problem ps[kMaxProducts]{};
    size_t at = 1;
    for (size_t i = 0; i < specs.size(); ++i) {
      const PartSpec& sp = specs[i];
      Problem& p = ps[i];
      const mx::array& wq = inputs[at];
      const mx::array& sc = inputs[at + 1];
      p.x = xp;
      p.wq = static_cast<const uint32_t*>(dense_data(wq, keep[4 * i]));
      p.scales = dense_data(sc, keep[4 * i + 1]);
      at += 2;
      p.biases = sp.biases ? dense_data(inputs[at++], keep[4 * i + 2]) : nullptr;
      if (sp.supers) {
        p.sb_type = sc.dtype() == mx::uint8 ? SB_U8 : SB_I8;
        p.kd = static_cast<const uint16_t*>(dense_data(inputs[at++], keep[4 * i + 3]));
        p.gshift = sp.group == 16 ? 4 : 3;
      } else {
        p.sb_type = sb_type_of(sc.dtype());
      }
      p.M = M;
      p.N = wq.shape(0);
      p.K = K;
      p.group = sp.group;
      p.bits = sp.bits;
      p.out = outs[i];
    }
    compute_many(ps, int(specs.size()));
  });
}

void QuantizedMatVecs::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[qmv] QuantizedMatVecs has no GPU implementation");
}

bool QuantizedMatVecs::is_equivalent(const mx::Primitive& other) const {
  auto* o = dynamic_cast<const QuantizedMatVecs*>(&other);
  if (!o || o->specs_.size() != specs_.size()) return false;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const PartSpec &a = specs_[i], &b = o->specs_[i];
    if (a.group != b.group || a.bits != b.bits || a.biases != b.biases || a.supers != b.supers)
      return false;
  }
  return true;
}

std::vector<mx::Shape> QuantizedMatVecs::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> out;
  size_t at = 1;
  for (const PartSpec& sp : specs_) {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[at].shape(0);
    out.push_back(std::move(shape));
    at += 2 + sp.biases + sp.supers;
  }
  return out;
}

}  // namespace qmv
