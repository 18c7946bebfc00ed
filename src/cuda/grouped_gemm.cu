// Grouped FP8 GEMMs (placeholder until the implementation lands).
#include "cuda_check.hpp"
#include "moe_api.hpp"

namespace fp8moe::cuda {
#define FP8MOE_TODO(op) FP8MOE_CHECK(false, #op ": not implemented on cuda yet")
void grouped_gemm_fp8_contiguous_cuda(const QuantizedView&, const QuantizedView&, const TensorView&, int64_t,
                                      const TensorView&, bool, cudaStream_t) {
  FP8MOE_TODO(grouped_gemm_fp8_contiguous);
}
void grouped_gemm_fp8_masked_cuda(const QuantizedView&, const QuantizedView&, const TensorView&, int64_t,
                                  const TensorView&, bool, cudaStream_t) {
  FP8MOE_TODO(grouped_gemm_fp8_masked);
}
void grouped_wgrad_fp8_cuda(const QuantizedView&, const QuantizedView&, const TensorView&, const TensorView&, bool,
                            cudaStream_t) {
  FP8MOE_TODO(grouped_wgrad_fp8);
}
}  // namespace fp8moe::cuda
