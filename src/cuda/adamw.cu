// Device AdamW update of one parameter: the per-element arithmetic of AdamW::step
// (src/train/optimizer.cpp) operation for operation, so the GPU and CPU optimizers produce the
// same bits and their states (FP32 master weights, BF16 or FP32 moments) are interchangeable.
// The trainer calls it once per parameter with the step count and bias corrections of AdamW.
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

void cuda_adamw_step(const ParamRef& p, const TensorView& m, const TensorView& v, const AdamWConfig& cfg,
                     int64_t step, float lr, float grad_scale) {
  const std::string value_name = p.name + ".value", grad_name = p.name + ".grad";
  check_f32(p.value, "adamw", value_name.c_str(), -1);
  check_f32(p.grad, "adamw", grad_name.c_str(), -1);
  FP8MOE_CHECK(p.value.numel() == p.grad.numel(),
               "adamw: " << p.name << ": gradient " << p.grad.str() << " does not match " << p.value.str());
  const DType md = cfg.moments == MomentPrecision::bf16 ? DType::bf16 : DType::f32;
  const std::string m_name = p.name + " first moment", v_name = p.name + " second moment";
  check_dev(m, "adamw", m_name.c_str(), md, -1);
  check_dev(v, "adamw", v_name.c_str(), md, -1);
  FP8MOE_CHECK(m.numel() == p.value.numel() && v.numel() == p.value.numel(),
               "adamw: " << p.name << ": moments " << m.str() << ", " << v.str() << " do not match " << p.value.str());
  FP8MOE_CHECK(step >= 1, "adamw: step = " << step << " must be the 1-based update count");
  // The bias corrections exactly as AdamW::step computes them (host std::pow).
  const double bc1 = 1.0 - std::pow(double(cfg.beta1), double(step));
  const double bc2 = 1.0 - std::pow(double(cfg.beta2), double(step));
  const float wd = p.weight_decay ? cfg.weight_decay : 0.0f;
  const int64_t n = p.value.numel();
  if (n == 0) return;
  constexpr int kThreads = 256;
  const unsigned grid = grid_for(n, kThreads, 65536);
  if (md == DType::bf16)
    adamw_kernel<true><<<grid, kThreads>>>(p.value.ptr<float>(), p.grad.ptr<const float>(), m.data, v.data, n,
                                           cfg.beta1, cfg.beta2, cfg.eps, wd, lr, grad_scale, bc1, bc2);
  else
    adamw_kernel<false><<<grid, kThreads>>>(p.value.ptr<float>(), p.grad.ptr<const float>(), m.data, v.data, n,
                                            cfg.beta1, cfg.beta2, cfg.eps, wd, lr, grad_scale, bc1, bc2);
  FP8MOE_CUDA_CHECK_LAUNCH("adamw_kernel");
}

}  // namespace fp8moe::cuda
