#include "fused.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "fused_kernels.h"
#include "mlx/ops.h"
#include "qmv.h"

namespace qmv {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("[fused] " + msg); }

void need_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) fail(std::string(what) + " must be float32");
}

mx::Stream cpu() { return mx::to_stream({}, mx::Device::cpu); }

// A 4-D view of a (its own strides when the last one is 1, else a dense copy in keep).
View4 view4(const mx::array& a, std::vector<char>& keep) {
  View4 v{};
  for (int d = 0; d < 4; ++d) v.n[d] = a.shape(d);
  if (a.strides()[3] == 1 || a.shape(3) == 1) {
    v.p = a.data<float>();
    for (int d = 0; d < 4; ++d) v.s[d] = a.strides()[d];
    return v;
  }
  v.p = static_cast<const float*>(dense_data(a, keep));
  v.s[3] = 1;
  for (int d = 2; d >= 0; --d) v.s[d] = v.s[d + 1] * v.n[d + 1];
  return v;
}

// x (B, T, H, D), or (B, T, H * D) with `heads` H, seen as (B, H, T, D)
View4 view4_heads_last(const mx::array& a, int heads, std::vector<char>& keep) {
  const bool flat = a.ndim() == 3;
  const int D = flat ? a.shape(2) / heads : a.shape(3);
  View4 v{};
  v.n[0] = a.shape(0), v.n[1] = heads, v.n[2] = a.shape(1), v.n[3] = D;
  const float* p = a.data<float>();
  std::vector<int64_t> s(a.strides().begin(), a.strides().end());
  if (s.back() != 1 && a.shape(-1) != 1) {  // a dense copy, its own strides
    p = static_cast<const float*>(dense_data(a, keep));
    s.back() = 1;
    for (int d = a.ndim() - 2; d >= 0; --d) s[d] = s[d + 1] * a.shape(d + 1);
  }
  v.p = p;
  v.s[0] = s[0], v.s[2] = s[1], v.s[3] = 1;
  v.s[1] = flat ? int64_t(D) : s[2];
  return v;
}

}  // namespace

mx::array fused_rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps) {
  need_f32(x, "x");
  if (x.ndim() < 1 || x.shape(-1) == 0) fail("x must have a last dimension");
  std::vector<mx::array> in{x};
  if (w) {
    need_f32(*w, "w");
    if (w->ndim() != 1 || w->shape(0) != x.shape(-1)) fail("w must be (D,)");
    in.push_back(*w);
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Fused>(cpu(), FusedOp::RmsNorm, std::vector<float>{eps},
                                           std::vector<int>{}),
                   std::move(in));
}

mx::array fused_rope(const mx::array& x, int dims, bool traditional, float base, float scale,
                     int offset, const std::optional<mx::array>& offsets,
                     const std::optional<mx::array>& periods, int heads) {
  need_f32(x, "x");
  mx::Shape shape = x.shape();  // (B, H, T, D)
  if (heads > 0) {
    if (x.ndim() == 4 && x.shape(2) == heads) {
      shape = {x.shape(0), heads, x.shape(1), x.shape(3)};
    } else if (x.ndim() == 3 && x.shape(2) % heads == 0) {
      shape = {x.shape(0), heads, x.shape(1), x.shape(2) / heads};
    } else {
      fail("x must be (B, T, heads, D) or (B, T, heads * D)");
    }
  } else if (x.ndim() != 4) {
    fail("x must be (B, H, T, D)");
  }
  if (dims <= 0 || dims % 2 || dims > shape[3]) fail("dims must be even, within D");
  std::vector<mx::array> in{x};
  int flags = 0;
  if (offsets) {
    if (offsets->ndim() != 1 || (offsets->shape(0) != x.shape(0) && offsets->shape(0) != 1))
      fail("offsets must be (B,) or (1,)");
    in.push_back(mx::astype(*offsets, mx::int32, cpu()));
    flags |= 1;
  }
  if (periods) {
    need_f32(*periods, "periods");
    if (periods->ndim() != 1 || periods->shape(0) != dims / 2) fail("periods must be (dims/2,)");
    in.push_back(*periods);
    flags |= 2;
  }
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<Fused>(cpu(), FusedOp::Rope, std::vector<float>{base, scale},
                                           std::vector<int>{dims, traditional, offset, flags,
                                                            std::max(heads, 0)}),
                   std::move(in));
}

mx::array fused_attend(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                       bool causal, const std::optional<mx::array>& mask, bool heads_last) {
  for (auto* a : {&q, &k, &v}) {
    need_f32(*a, "q, k and v");
    if (a->ndim() != 4) fail("q, k and v must be 4-D");
  }
  const int B = q.shape(0), H = q.shape(1), T = q.shape(2), S = k.shape(2);
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != k.shape(1) || v.shape(2) != S ||
      k.shape(3) != q.shape(3) || k.shape(1) == 0 || H % k.shape(1))
    fail("q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) with H a multiple of Hkv");
  if (causal && T > S) fail("a causal chunk longer than the keys");
  std::vector<mx::array> in{q, k, v};
  if (mask) {
    if (mask->dtype() != mx::bool_) fail("mask must be boolean");
    in.push_back(mx::broadcast_to(*mask, {B, 1, T, S}, cpu()));
  }
  mx::Shape shape = heads_last ? mx::Shape{B, T, H * v.shape(3)} : mx::Shape{B, H, T, v.shape(3)};
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<Fused>(cpu(), FusedOp::Attend, std::vector<float>{scale},
                                           std::vector<int>{causal, bool(mask), heads_last}),
                   std::move(in));
}

mx::array fused_gated(const mx::array& g, const mx::array& u, int act) {
  need_f32(g, "gate");
  need_f32(u, "up");
  if (g.shape() != u.shape()) fail("gate and up must have the same shape");
  if (act != 0 && act != 1) fail("act must be 0 (silu) or 1 (gelu_tanh)");
  return mx::array(g.shape(), mx::float32,
                   std::make_shared<Fused>(cpu(), FusedOp::Gated, std::vector<float>{},
                                           std::vector<int>{act}),
                   {g, u});
}

void Fused::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto* e = cpu_encoder(stream(), inputs, out);
  if (!e) return;
  auto& enc = *e;
  float* o = out.data<float>();
  // inputs captured by value keep their buffers alive until the task has run
  switch (op_) {
    case FusedOp::RmsNorm:
      enc.dispatch([in = inputs, o, eps = f_[0]]() {
        std::vector<char> kx, kw;
        const int D = in[0].shape(-1);
        const float* w = in.size() > 1 ? static_cast<const float*>(dense_data(in[1], kw)) : nullptr;
        rms_norm_rows(static_cast<const float*>(dense_data(in[0], kx)), w, eps,
                      int64_t(in[0].size() / D), D, o);
      });
      return;
    case FusedOp::Rope:
      enc.dispatch([in = inputs, o, f = f_, i = i_]() {
        std::vector<char> kx, kp, ko;
        RopeArgs a{};
        a.x = i[4] > 0 ? view4_heads_last(in[0], i[4], kx) : view4(in[0], kx);
        a.dims = i[0];
        a.traditional = i[1];
        a.base = f[0];
        a.scale = f[1];
        const int32_t fixed = i[2];
        int next = 1;
        if (i[3] & 1) {
          const auto& offs = in[next++];
          a.offsets = static_cast<const int32_t*>(dense_data(offs, ko));
          a.offset_count = int(offs.size());
        } else {
          a.offsets = &fixed;
          a.offset_count = 1;
        }
        a.periods = (i[3] & 2) ? static_cast<const float*>(dense_data(in[next], kp)) : nullptr;
        a.out = o;
        rope(a);
      });
      return;
    case FusedOp::Attend:
      enc.dispatch([in = inputs, o, scale = f_[0], i = i_]() {
        std::vector<char> kq, kk, kv;
        AttendArgs a{};
        a.q = view4(in[0], kq);
        a.k = view4(in[1], kk);
        a.v = view4(in[2], kv);
        a.scale = scale;
        a.causal = i[0];
        a.heads_last = i[2];
        if (i[1]) {
          const auto& m = in[3];
          a.mask = m.data<uint8_t>();
          a.mask_s[0] = m.strides()[0];
          a.mask_s[1] = m.strides()[2];
          a.mask_s[2] = m.strides()[3];
        }
        a.out = o;
        if (a.q.n[2] > kFewQueries)
          attend_blocks(a);  // a prompt's chunk
        else
          attend(a);
      });
      return;
    case FusedOp::Gated:
      enc.dispatch([in = inputs, o, act = i_[0]]() {
        std::vector<char> kg, ku;
        gated(static_cast<const float*>(dense_data(in[0], kg)),
              static_cast<const float*>(dense_data(in[1], ku)), int64_t(in[0].size()), act, o);
      });
      return;
  }
}

void Fused::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[fused] no GPU implementation");
}

const char* Fused::name() const {
  switch (op_) {
    case FusedOp::RmsNorm: return "FusedRmsNorm";
    case FusedOp::Rope: return "FusedRope";
    case FusedOp::Attend: return "FusedAttend";
    default: return "FusedGated";
  }
}

bool Fused::is_equivalent(const mx::Primitive& other) const {
  auto* o = dynamic_cast<const Fused*>(&other);
  return o && o->op_ == op_ && o->f_ == f_ && o->i_ == i_;
}

std::vector<mx::Shape> Fused::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& x = inputs[0];
  if (op_ == FusedOp::Attend) {
    const int Dv = inputs[2].shape(3);
    if (i_[2]) return {{x.shape(0), x.shape(2), x.shape(1) * Dv}};
    return {{x.shape(0), x.shape(1), x.shape(2), Dv}};
  }
  if (op_ == FusedOp::Rope && i_[4] > 0) {
    const int h = i_[4], D = x.ndim() == 3 ? x.shape(2) / h : x.shape(3);
    return {{x.shape(0), h, x.shape(1), D}};
  }
  return {x.shape()};
}

}  // namespace qmv
