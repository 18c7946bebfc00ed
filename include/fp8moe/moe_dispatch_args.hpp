// Argument checks of the MoE dispatch ops (backend.hpp: moe_layout, moe_masked_layout, moe_permute,
// moe_permute_quantize, moe_combine, moe_combine_weight_grad), shared by the backends so that all
// refuse the same calls with the same messages: every tensor defined, contiguous and on the
// backend's `device`, dtypes (where f32 is named, the cpu also takes f64: the fp64 recipe), ranks, shapes and the i32 range of row and slot indices. Index
// values are each backend's business: the CPU ops check them, the CUDA ops (which never
// synchronize with the host) skip entries out of range.
#pragma once
#include "fp8moe/quantize.hpp"

namespace fp8moe {

// Sizes of one call: T tokens, k slots per token, R rows of the expert-sorted layout, D (or N)
// columns, G experts.
struct MoeDispatchDims {
  int64_t tokens = 0, topk = 0, rows = 0, cols = 0, groups = 0;
};

// expert_ids [T, k], row_slot [R], row_group [R], slot_row [T, k], offsets [G + 1], all i32;
// align > 0, G >= 1, R >= moe_layout_rows(T * k, G, align) (and that bound within i32).
MoeDispatchDims check_moe_layout_args(Device device, const TensorView& expert_ids, int64_t align,
                                      const TensorView& row_slot, const TensorView& row_group,
                                      const TensorView& slot_row, const TensorView& offsets);
// expert_ids [T, k], row_slot [G * M_max], slot_row [T, K] (K = k, or k + 1 with
// every_token_group in [0, G)), counts [G], all i32; loads [G] i64 or undefined. topk is K.
MoeDispatchDims check_moe_masked_layout_args(Device device, const TensorView& expert_ids, int64_t groups,
                                             int64_t every_token_group, const TensorView& row_slot,
                                             const TensorView& slot_row, const TensorView& counts,
                                             const TensorView& loads);
// x [T, D] f32|bf16, row_slot [R] i32, topk >= 1, w [T, topk] f32 or undefined, out [R, D] f32|bf16.
MoeDispatchDims check_moe_permute_args(Device device, const TensorView& x, const TensorView& row_slot, int64_t topk,
                                       const TensorView& w, const TensorView& out);
// As moe_permute with out 1x128-scaled e4m3|e5m2 [R, D], D % 128 == 0.
MoeDispatchDims check_moe_permute_quantize_args(Device device, const TensorView& x, const TensorView& row_slot,
                                                int64_t topk, const TensorView& w, const QuantizedView& out);
// y [R, N] f32|bf16, slot_row [T, k] i32, w [T, k] f32 or undefined, out [T, N] f32.
MoeDispatchDims check_moe_combine_args(Device device, const TensorView& y, const TensorView& slot_row,
                                       const TensorView& w, const TensorView& out);
// v [R] f32, slot_row [T, k] i32, w [T, k] f32, dw [T, k] f32.
MoeDispatchDims check_moe_combine_weight_grad_args(Device device, const TensorView& v, const TensorView& slot_row,
                                                   const TensorView& w, const TensorView& dw);

// The balance loss's arguments: scores [T, E] float (f32; f64 too on the cpu), idx [T, k] i32,
// T whole sequences of seq_len; loss [1] f64 and dscores [T, E] of the scores' dtype, each
// optional. Returns tokens T, topk k, groups E.
MoeDispatchDims check_moe_balance_loss_args(Device device, const TensorView& scores, const TensorView& idx,
                                            int64_t seq_len, const TensorView& loss, const TensorView& dscores);

}  // namespace fp8moe
