// CPU SwiGLU: out = silu(gate) * up, and its backward. The FP8 recipe caches (gate, up) in FP8 and
// recomputes `out` in backward, so both directions take the same inputs.
#include <cmath>

#include "cpu_ops.hpp"

namespace fp8moe::cpu {

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
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (T(1) + std::exp(-g[i])) * u[i];
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
#pragma omp parallel for schedule(static) if (n > kParallelWork)
    for (int64_t i = 0; i < n; ++i) {
      const T s = T(1) / (T(1) + std::exp(-g[i]));
      const T silu = g[i] * s;
      dup.ptr<T>()[i] = d[i] * silu;
      dgate.ptr<T>()[i] = d[i] * u[i] * s * (T(1) + g[i] * (T(1) - s));
    }
  });
}

}  // namespace fp8moe::cpu
