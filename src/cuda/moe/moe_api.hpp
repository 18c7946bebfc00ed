// Host entry points of the MoE kernels: device-side dispatch (moe_dispatch.cu) and the grouped
// FP8 GEMMs (grouped_gemm.cu). Same contracts as the Backend ops of the same names
// (include/fp8moe/backend.hpp); all tensors are device views, work is queued on `stream` and
// nothing synchronizes with the host (counts and offsets stay on the device).
#pragma once
#include <cuda_runtime.h>

#include "fp8moe/gemm_ref.hpp"
#include "fp8moe/quantize.hpp"
#include "cuda/gemm/gemm_heuristics.hpp"

namespace fp8moe::cuda {

// ---- dispatch (moe_dispatch.cu) ----
void moe_layout_cuda(const TensorView& expert_ids, int64_t align, const TensorView& row_slot,
                     const TensorView& row_group, const TensorView& slot_row, const TensorView& offsets,
                     cudaStream_t stream);
void moe_masked_layout_cuda(const TensorView& expert_ids, int64_t groups, int64_t every_token_group,
                            const TensorView& row_slot, const TensorView& slot_row, const TensorView& counts,
                            const TensorView& loads, cudaStream_t stream);
void moe_permute_cuda(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                      const TensorView& out, cudaStream_t stream);
void moe_permute_quantize_cuda(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                               const QuantizedView& out, ScaleMode mode, cudaStream_t stream);
void moe_combine_cuda(const TensorView& y, const TensorView& slot_row, const TensorView& w, const TensorView& out,
                      bool accumulate, cudaStream_t stream);
void moe_combine_weight_grad_cuda(const TensorView& v, const TensorView& slot_row, const TensorView& w,
                                  const TensorView& dw, cudaStream_t stream);

// ---- grouped FP8 GEMMs (grouped_gemm.cu, grouped_wgrad.cu) ----
// The sm_90a kernel of gemm_fp8_sm90 with the group of each tile resolved on the device
// (kernels/grouping.cuh). `tile` overrides the heuristic when non-null (grouped_tile_ok tiles).
// Group tables hold valid values as the Backend contracts say (they cannot be checked without
// reading them back); out-of-range values are clamped so that nothing is read or written outside
// the tensors: a row_group value outside [0, G) is padding, counts are clamped to [0, M_max],
// offsets to [0, R].
void grouped_gemm_fp8_contiguous_cuda(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                      int64_t groups, const TensorView& d, bool accumulate, cudaStream_t stream,
                                      const GemmTile* tile = nullptr);
void grouped_gemm_fp8_masked_cuda(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                                  int64_t groups, const TensorView& d, bool accumulate, cudaStream_t stream,
                                  const GemmTile* tile = nullptr);
void grouped_wgrad_fp8_cuda(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                            const TensorView& d, bool accumulate, cudaStream_t stream, const GemmTile* tile = nullptr);
// The tile the heuristic picks for `rows` output rows of all groups together (the rows of the
// contiguous layout, G * M_max, or G * N for the Wgrad), N columns and K (Wgrad: tokens per group);
// d_f32: D is f32 (else bf16; the Wgrad's D is always f32); contiguous_groups: the contiguous GEMM
// over this many expert segments (192-row tiles allowed).
GemmTile grouped_gemm_tile(int64_t rows, int64_t N, int64_t K, bool b_1x128, bool d_f32,
                           int64_t contiguous_groups = 0);

}  // namespace fp8moe::cuda
