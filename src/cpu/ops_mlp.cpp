// CPU SwiGLU: out = silu(gate) * up, and its backward. The FP8 recipe caches (gate, up) in FP8 and
// recomputes `out` in backward, so both directions take the same inputs; swiglu_backward_fp8 does
// that recomputation and the backward straight from the FP8 cache.
#include <algorithm>
#include <cmath>

#include "cpu_ops.hpp"

namespace fp8moe::cpu {

namespace {

// The per-element arithmetic of the two directions, shared by the float ops and the FP8 one so
// that all of them round alike (each operation rounded to T, left to right).
template <class T>
inline T swiglu_value(T g, T u) {
  return g / (T(1) + std::exp(-g)) * u;
}
template <class T>
inline void swiglu_grad(T g, T u, T d, T& dg, T& du) {
  const T s = T(1) / (T(1) + std::exp(-g));
  const T silu = g * s;
  du = d * silu;
  dg = d * u * s * (T(1) + g * (T(1) - s));
}

}  // namespace

void swiglu_forward(const TensorView& gate, const TensorView& up, const TensorView& out) {
  dispatch_float(gate, "swiglu_forward", "gate", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(gate, "swiglu_forward", "gate", gate.dtype, 2);
    check_op_tensor(up, "swiglu_forward", "up", gate.dtype, 2);
    check_op_tensor(out, "swiglu_forward", "out", gate.dtype, 2);
    check_shape(up, "swiglu_forward: up", {gate.size(0), gate.size(1)});
    check_shape(out, "swiglu_forward: out", {gate.size(0), gate.size(1)});
    const int64_t n = gate.numel();
    const T* g = gate.ptr<const T>();
    const T* u = up.ptr<const T>();
    T* o = out.ptr<T>();
#pragma omp parallel for schedule(static) if (n > kParallelWork)
    for (int64_t i = 0; i < n; ++i) o[i] = swiglu_value(g[i], u[i]);
  });
}

void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dout, const TensorView& dgate,
                     const TensorView& dup) {
  dispatch_float(gate, "swiglu_backward", "gate", [&](auto tag) {
    using T = decltype(tag);
    for (auto [t, name] : {std::pair{&up, "up"}, {&dout, "dout"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
      check_op_tensor(*t, "swiglu_backward", name, gate.dtype, 2);
      FP8MOE_CHECK(t->size(0) == gate.size(0) && t->size(1) == gate.size(1),
                   "swiglu_backward: " << name << " " << t->str() << " differs from gate " << gate.str());
    }
    const int64_t n = gate.numel();
    const T* g = gate.ptr<const T>();
    const T* u = up.ptr<const T>();
    const T* d = dout.ptr<const T>();
    T* dg = dgate.ptr<T>();
    T* du = dup.ptr<T>();
#pragma omp parallel for schedule(static) if (n > kParallelWork)
    for (int64_t i = 0; i < n; ++i) swiglu_grad(g[i], u[i], d[i], dg[i], du[i]);
  });
}

void swiglu_backward_fp8(const QuantizedView& gate, const QuantizedView& up, const TensorView& dout,
                         const TensorView& out, const TensorView& dgate, const TensorView& dup) {
  const char* op = "swiglu_backward_fp8";
  check_op_tensor(dout, op, "dout", DType::f32, 2);
  const int64_t T = dout.size(0), F = dout.size(1);
  for (auto [q, name] : {std::pair{&gate, "gate"}, {&up, "up"}}) {
    check_quantized(*q, name, ScaleKind::tile_1x128);
    FP8MOE_CHECK(q->values.dtype == DType::e4m3 || q->values.dtype == DType::e5m2,
                 op << ": " << name << " must be e4m3 or e5m2, got " << q->values.str());
    check_op_tensor(q->values, op, name, gate.values.dtype, 2);  // up: gate's dtype
    check_covers_rows(*q, op, name, T, F, "dout " + dout.str());
  }
  for (auto [t, name] : {std::pair{&out, "out"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
    if (t == &out && !out.defined()) continue;
    check_op_tensor(*t, op, name, DType::f32, 2);
    FP8MOE_CHECK(t->size(0) == T && t->size(1) == F,
                 op << ": " << name << " " << t->str() << " differs from dout " << dout.str());
  }
  const DType gdt = gate.values.dtype, udt = up.values.dtype;
  const float* gs = gate.scales.ptr<const float>();
  const float* us = up.scales.ptr<const float>();
  const int64_t gld = gate.scales.size(1), uld = up.scales.size(1), groups = ceil_div(F, kQuantGroup);
  const float* d = dout.ptr<const float>();
  float* o = out.defined() ? out.ptr<float>() : nullptr;
  float* dg = dgate.ptr<float>();
  float* du = dup.ptr<float>();
  // Per element: g and u as dequantize computes them (decode(q) * scale, one FP32 product), then
  // the arithmetic of swiglu_forward and swiglu_backward.
#pragma omp parallel for schedule(static) if (T * F > kParallelWork)
  for (int64_t r = 0; r < T; ++r) {
    for (int64_t k = 0; k < groups; ++k) {
      const float sg = gs[k * gld + r], su = us[k * uld + r];
      const int64_t end = std::min(F, (k + 1) * kQuantGroup);
      for (int64_t c = k * kQuantGroup; c < end; ++c) {
        const int64_t i = r * F + c;
        const float g = decode_value(gdt, gate.values.data, i) * sg;
        const float u = decode_value(udt, up.values.data, i) * su;
        if (o) o[i] = swiglu_value(g, u);
        swiglu_grad(g, u, d[i], dg[i], du[i]);
      }
    }
  }
}

}  // namespace fp8moe::cpu
