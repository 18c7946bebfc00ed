// CPU MoE dispatch ops (placeholder until the implementation lands).
#include "cpu_ops.hpp"

namespace fp8moe::cpu {
#define FP8MOE_TODO(op) FP8MOE_CHECK(false, #op ": not implemented on the cpu backend yet")
void moe_layout(const TensorView&, int64_t, const TensorView&, const TensorView&, const TensorView&, const TensorView&) {
  FP8MOE_TODO(moe_layout);
}
void moe_permute(const TensorView&, const TensorView&, int64_t, const TensorView&, const TensorView&) {
  FP8MOE_TODO(moe_permute);
}
void moe_permute_quantize(const TensorView&, const TensorView&, int64_t, const TensorView&, const QuantizedView&,
                          ScaleMode) {
  FP8MOE_TODO(moe_permute_quantize);
}
void moe_combine(const TensorView&, const TensorView&, const TensorView&, const TensorView&, bool) {
  FP8MOE_TODO(moe_combine);
}
void moe_combine_weight_grad(const TensorView&, const TensorView&, const TensorView&, const TensorView&) {
  FP8MOE_TODO(moe_combine_weight_grad);
}
}  // namespace fp8moe::cpu
