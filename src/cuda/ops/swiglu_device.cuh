// The per-element arithmetic of SwiGLU on the device, shared by the model ops
// (model_ops_elementwise.cu) and the masked expert activation of the two-micro-batch layer
// (src/serve/two_batch.cu), which are then bit-identical to each other.
#pragma once
#include <cuda_runtime.h>

namespace fp8moe::cuda {

// The per-element arithmetic of SwiGLU, shared by the kernels on f32 inputs and the one on the
// FP8-cached input, which are then bit-identical (expf differs from the CPU's std::exp in the last
// bits, so all of them are within rounding of the CPU ops, not bit-identical to them).
__device__ __forceinline__ float swiglu_value(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float& dg, float& du) {
  const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
  const float silu = __fmul_rn(g, s);
  du = __fmul_rn(d, silu);
  // d * u * s * (1 + g * (1 - s)), left to right as in C++.
  dg = __fmul_rn(__fmul_rn(__fmul_rn(d, u), s), __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
}

}  // namespace fp8moe::cuda
