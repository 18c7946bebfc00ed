// CUDA MoE dispatch kernels (placeholder until the implementation lands).
#include "cuda_check.hpp"
#include "moe_api.hpp"

namespace fp8moe::cuda {
#define FP8MOE_TODO(op) FP8MOE_CHECK(false, #op ": not implemented on cuda yet")
void moe_layout_cuda(const TensorView&, int64_t, const TensorView&, const TensorView&, const TensorView&,
                     const TensorView&, cudaStream_t) {
  FP8MOE_TODO(moe_layout);
}
void moe_permute_cuda(const TensorView&, const TensorView&, int64_t, const TensorView&, const TensorView&,
                      cudaStream_t) {
  FP8MOE_TODO(moe_permute);
}
void moe_permute_quantize_cuda(const TensorView&, const TensorView&, int64_t, const TensorView&, const QuantizedView&,
                               ScaleMode, cudaStream_t) {
  FP8MOE_TODO(moe_permute_quantize);
}
void moe_combine_cuda(const TensorView&, const TensorView&, const TensorView&, const TensorView&, bool, cudaStream_t) {
  FP8MOE_TODO(moe_combine);
}
void moe_combine_weight_grad_cuda(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                  cudaStream_t) {
  FP8MOE_TODO(moe_combine_weight_grad);
}
}  // namespace fp8moe::cuda
