// Device AdamW update of one parameter: the per-element arithmetic of the CPU op
// (src/cpu/ops_optim.cpp) operation for operation, so the GPU and CPU optimizers produce the
// same bits and their states (FP32 master weights, BF16 or FP32 moments) are interchangeable.
// AdamW (src/train/optimizer.cpp) calls it once per parameter through Backend::adamw_step.
#include <cmath>

#include "model_ops.hpp"
#include "model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

// w, g [n] f32; m, v [n] bf16 (kBf16) or f32. bc1, bc2: 1 - beta^t in FP64.
// NOTES: every rounding of the CPU loop is spelled out (__fmul_rn, __dadd_rn, ...) so that nvcc
// does not contract it into an FMA; the host compiles that loop for baseline x86-64 (no FMA).
template <bool kBf16>
__global__ void adamw_kernel(float* __restrict__ w, const float* __restrict__ g, void* m_, void* v_, int64_t n,
                             float b1, float b2, float eps, float wd, float lr, float grad_scale, double bc1,
                             double bc2) {
  const float one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    const float gj = __fmul_rn(g[j], grad_scale);
    float m, v;
    if constexpr (kBf16) {
      m = bf16_to_f32(static_cast<const uint16_t*>(m_)[j]);
      v = bf16_to_f32(static_cast<const uint16_t*>(v_)[j]);
    } else {
      m = static_cast<const float*>(m_)[j];
      v = static_cast<const float*>(v_)[j];
    }
    // m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
    m = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(one_b1, gj));
    v = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(one_b2, gj), gj));
    if constexpr (kBf16) {
      static_cast<uint16_t*>(m_)[j] = f32_to_bf16(m);
      static_cast<uint16_t*>(v_)[j] = f32_to_bf16(v);
    } else {
      static_cast<float*>(m_)[j] = m;
      static_cast<float*>(v_)[j] = v;
    }
    // update = (m / bc1) / (sqrt(v / bc2) + eps);  w -= lr * (update + wd * w), in FP64
    const double update =
        __ddiv_rn(__ddiv_rn(double(m), bc1), __dadd_rn(__dsqrt_rn(__ddiv_rn(double(v), bc2)), double(eps)));
    const double wj = w[j];
    w[j] = __double2float_rn(__dsub_rn(wj, __dmul_rn(double(lr), __dadd_rn(update, __dmul_rn(double(wd), wj)))));
  }
}

}  // namespace

void cuda_adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                     const Backend::AdamWStep& p) {
  check_f32(w, "adamw_step", "w", -1);
  check_f32(g, "adamw_step", "g", -1);
  const DType md = m.dtype == DType::bf16 ? DType::bf16 : DType::f32;
  check_dev(m, "adamw_step", "m", md, -1);
  check_dev(v, "adamw_step", "v", md, -1);
  const int64_t n = w.numel();
  FP8MOE_CHECK(g.numel() == n && m.numel() == n && v.numel() == n,
               "adamw_step: w " << w.str() << ", g " << g.str() << ", m " << m.str() << ", v " << v.str() << " differ in size");
  FP8MOE_CHECK(p.step >= 1, "adamw_step: step = " << p.step << " must be the 1-based update count");
  // The bias corrections exactly as the CPU op computes them (host std::pow).
  const double bc1 = 1.0 - std::pow(double(p.beta1), double(p.step));
  const double bc2 = 1.0 - std::pow(double(p.beta2), double(p.step));
  if (n == 0) return;
  constexpr int kThreads = 256;
  const unsigned grid = grid_for(n, kThreads, 65536);
  if (md == DType::bf16)
    adamw_kernel<true><<<grid, kThreads>>>(w.ptr<float>(), g.ptr<const float>(), m.data, v.data, n, p.beta1, p.beta2,
                                           p.eps, p.weight_decay, p.lr, p.grad_scale, bc1, bc2);
  else
    adamw_kernel<false><<<grid, kThreads>>>(w.ptr<float>(), g.ptr<const float>(), m.data, v.data, n, p.beta1, p.beta2,
                                            p.eps, p.weight_decay, p.lr, p.grad_scale, bc1, bc2);
  FP8MOE_CUDA_CHECK_LAUNCH("adamw_kernel");
}

}  // namespace fp8moe::cuda
