// CPU optimizer ops: the AdamW update of one parameter (BF16 or FP32 moments) and the sum of
// squares behind gradient clipping. The CUDA update (src/cuda/ops/adamw.cu) reproduces this one bit
// for bit: same operation order, FP64 bias correction and update.
#include <cmath>

#include "cpu_ops.hpp"
#include "fp8moe/codecs.hpp"

namespace fp8moe::cpu {

void adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                const Backend::AdamWStep& p) {
  check_op_tensor(w, "adamw_step", "w", DType::f32, -1);
  check_op_tensor(g, "adamw_step", "g", DType::f32, -1);
  const bool bf16 = m.dtype == DType::bf16;
  check_op_tensor(m, "adamw_step", "m", bf16 ? DType::bf16 : DType::f32, -1);
  check_op_tensor(v, "adamw_step", "v", m.dtype, -1);
  const int64_t n = w.numel();
  FP8MOE_CHECK(g.numel() == n && m.numel() == n && v.numel() == n,
               "adamw_step: w " << w.str() << ", g " << g.str() << ", m " << m.str() << ", v " << v.str() << " differ in size");
  const double bc1 = 1.0 - std::pow(double(p.beta1), double(p.step));
  const double bc2 = 1.0 - std::pow(double(p.beta2), double(p.step));
  const float b1 = p.beta1, b2 = p.beta2;
  float* wp = w.ptr<float>();
  const float* gp = g.ptr<const float>();
  auto* m16 = m.ptr<uint16_t>();
  auto* v16 = v.ptr<uint16_t>();
  auto* m32 = m.ptr<float>();
  auto* v32 = v.ptr<float>();
#pragma omp parallel for schedule(static) if (n > kParallelWork)
  for (int64_t j = 0; j < n; ++j) {
    const float gj = gp[j] * p.grad_scale;
    float mj = bf16 ? bf16_decode(m16[j]) : m32[j];
    float vj = bf16 ? bf16_decode(v16[j]) : v32[j];
    mj = b1 * mj + (1 - b1) * gj;
    vj = b2 * vj + (1 - b2) * gj * gj;
    if (bf16) {
      m16[j] = bf16_encode(mj);
      v16[j] = bf16_encode(vj);
    } else {
      m32[j] = mj;
      v32[j] = vj;
    }
    const double update = (double(mj) / bc1) / (std::sqrt(double(vj) / bc2) + p.eps);
    wp[j] = float(double(wp[j]) - double(p.lr) * (update + double(p.weight_decay) * wp[j]));
  }
}

double sum_squares(const TensorView& x) {
  double ss = 0;
  dispatch_float(x, "sum_squares", "x", [&](auto zero) {
    using T = decltype(zero);
    const T* p = x.ptr<const T>();
    const int64_t n = x.numel();
#pragma omp parallel for reduction(+ : ss) schedule(static) if (n > kParallelWork)
    for (int64_t j = 0; j < n; ++j) ss += double(p[j]) * double(p[j]);
  });
  return ss;
}

}  // namespace fp8moe::cpu
