// MoE token permutation and grouped FP8 GEMMs (issue: grouped GEMMs), CPU reference.
//
// Routing -> layout. From top-k routing (expert ids [T, k] i32, weights [T, k] f32) the tokens of
// each expert are gathered into one contiguous segment of rows, experts in order, tokens in
// ascending order inside a segment (deterministic), each segment padded to `align` rows (the
// grouped kernel's M-tile) so that no M-tile mixes two experts:
//   row_token  [M_pad] i32   source token of each row, -1 for padding
//   row_group  [M_pad] i32   expert of each row (DeepGEMM's m_indices), -1 for padding
//   slot_row   [T, k]  i32   row holding (token, slot); the inverse map used by combine
//   offsets    [G + 1]       first row of each expert's segment (host)
//   counts     [G]           tokens routed to each expert (unpadded)
// An expert with no tokens gets an empty segment.
//
// Grouped GEMMs (D = A * B^T per group, A 1x128-scaled, B [G, N, K] 128x128-scaled, K % 128 == 0):
//   contiguous  A [M_pad, K], the group of each row from row_group; padding rows of D are zero.
//   masked      A [G, M_max, K] with per-group valid row counts; rows past the count are zero.
//   k-grouped   Wgrad: dW[g] [N, K] (+)= dY_g^T X_g, operands [N, M_pad] and [K, M_pad]
//               1x128-scaled along the rows (tokens) of the contiguous layout, groups split by offsets.
#pragma once
#include <vector>

#include "fp8moe/gemm_ref.hpp"
#include "fp8moe/quantize.hpp"

namespace fp8moe {

struct MoeLayout {
  int64_t tokens = 0, topk = 0, groups = 0, align = 128;
  std::vector<int32_t> row_token, row_group, slot_row;
  std::vector<int64_t> offsets, counts;
  int64_t rows() const { return int64_t(row_token.size()); }
};

// expert_ids [T, k] i32 with values in [0, groups) (or -1: slot dropped).
MoeLayout build_moe_layout(const TensorView& expert_ids, int64_t groups, int64_t align = 128);

// x [T, D] f32|bf16 -> out [M_pad, D] 1x128 (pow2 scales by default, as before dispatch);
// padding rows are zeros with scale 1. Fused gather + quantize.
void moe_permute_quantize(const TensorView& x, const MoeLayout& layout, const QuantizedView& out,
                          ScaleMode mode = ScaleMode::pow2);
// y [M_pad, N] f32|bf16, weights [T, k] f32 -> out [T, N] f32|bf16: out[t] = sum_k w[t,k] * y[row(t,k)],
// summed in FP32 in slot order (deterministic).
void moe_unpermute_combine(const TensorView& y, const TensorView& weights, const MoeLayout& layout, const TensorView& out);

// b [G*N, K] values with scales [G * ceil(N/128), K/128] (the G weight matrices stacked, N % 128
// == 0 so no block spans two experts).
void grouped_gemm_fp8_contiguous_ref(const QuantizedView& a, const QuantizedView& b, const std::vector<int32_t>& row_group,
                                     int64_t groups, const TensorView& d, const GemmOptions& opt = {});
// a [G*M_max, K] (groups stacked), counts [G]; d [G*M_max, N].
void grouped_gemm_fp8_masked_ref(const QuantizedView& a, const QuantizedView& b, const std::vector<int64_t>& counts,
                                 int64_t groups, const TensorView& d, const GemmOptions& opt = {});
// dy_t [N, M_pad] and x_t [K, M_pad] 1x128-scaled along M (segments aligned to 128 rows);
// d [G*N, K] f32, accumulate per opt; token columns past offsets.back() are ignored.
void grouped_wgrad_fp8_ref(const QuantizedView& dy_t, const QuantizedView& x_t, const std::vector<int64_t>& offsets,
                           const TensorView& d, const GemmOptions& opt = {});

}  // namespace fp8moe
