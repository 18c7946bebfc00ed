// Host entry points of the MoE kernels: device-side dispatch (moe_dispatch.cu) and the grouped
// FP8 GEMMs (grouped_gemm.cu). Same contracts as the Backend ops of the same names
// (include/fp8moe/backend.hpp); all tensors are device views, work is queued on `stream` and
// nothing synchronizes with the host (counts and offsets stay on the device).
#pragma once
#include <cuda_runtime.h>

#include "fp8moe/gemm_ref.hpp"
#include "fp8moe/quantize.hpp"
#include "gemm_heuristics.hpp"

namespace fp8moe::cuda {

// ---- dispatch (moe_dispatch.cu) ----
void moe_layout_cuda(const TensorView& expert_ids, int64_t align, const TensorView& row_slot,
                     const TensorView& row_group, const TensorView& slot_row, const TensorView& offsets,
                     cudaStream_t stream);
void moe_permute_cuda(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                      const TensorView& out, cudaStream_t stream);
void moe_permute_quantize_cuda(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                               const QuantizedView& out, ScaleMode mode, cudaStream_t stream);
void moe_combine_cuda(const TensorView& y, const TensorView& slot_row, const TensorView& w, const TensorView& out,
                      bool accumulate, cudaStream_t stream);
void moe_combine_weight_grad_cuda(const TensorView& v, const TensorView& slot_row, const TensorView& w,
                                  const TensorView& dw, cudaStream_t stream);

// ---- grouped FP8 GEMMs (grouped_gemm.cu) ----
void grouped_gemm_fp8_contiguous_cuda(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                      int64_t groups, const TensorView& d, bool accumulate, cudaStream_t stream);
void grouped_gemm_fp8_masked_cuda(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                                  int64_t groups, const TensorView& d, bool accumulate, cudaStream_t stream);
void grouped_wgrad_fp8_cuda(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                            const TensorView& d, bool accumulate, cudaStream_t stream);

}  // namespace fp8moe::cuda
