// The Linears of the routed experts as grouped FP8 GEMMs over the expert-sorted layout
// (backend.hpp, "MoE dispatch and grouped GEMMs"): rows of all experts in one [R, K] tensor, each
// expert's segment padded to 128 rows, the experts' weights and gradients stacked [G * N, K].
//   Fprop  y [R, N] = x (1x128) * W[g]^T (128x128), g = row_group[r]
//   Dgrad  dx [R, K] (+)= dy (1x128) * (W[g]^T)^T: the stacked W[g]^T [G * K, N], 128x128, the
//          blocks of the quantized W[g] transposed (transpose_128x128)
//   Wgrad  dW[g] += dy^T x over g's segment: dy^T [N, R] quantized along tokens (by the Dgrad, in
//          the pass that quantizes its dy, and kept: WgradDy), x^T [K, R] requantized from the
//          cached 1x128 tiles (the report's path), segments from offsets.
// The same numbers as one Linear per expert on that expert's rows: 1x128 tiles are per row,
// 128x128 blocks never span two experts (N, K % 128 == 0), and 128-token Wgrad blocks never span
// two segments.
// The BF16 recipe shares the layout: each operand converts to BF16 once for all experts (the
// stacked weights, dy), then one BF16 GEMM (FP32 accumulation) per non-empty segment, with the
// transposes in the GEMM's flags rather than in memory.
#include "model_internal.hpp"

namespace fp8moe::model {

namespace {

GemmOptions options(Ctx& c, bool accumulate) {
  GemmOptions o;
  o.accumulate = accumulate;
  o.accum = c.recipe.accum;
  return o;
}

// d[g] (+)= op(a[g]) op(b[g]) for every non-empty segment g. With d_rows (Fprop, Dgrad), a[g] and
// d[g] are the segment's rows and b[g] the g-th block of `block` rows; without (Wgrad), a[g] and
// b[g] are the segment's rows and d[g] the g-th block.
void per_segment(Ctx& c, const ExpertGroups& eg, const TensorView& a, const TensorView& b, const TensorView& d,
                 bool trans_a, bool trans_b, bool accumulate, int64_t block, bool d_rows) {
  for (int64_t g = 0; g < eg.groups; ++g) {
    const int64_t r0 = eg.start[size_t(g)], n = eg.count[size_t(g)];
    if (n == 0) continue;
    if (d_rows)  // Fprop / Dgrad: rows of a and d, block g of b
      c.be.gemm(rows_view(a, r0, n), rows_view(b, g * block, block), rows_view(d, r0, n), trans_a, trans_b,
                accumulate);
    else  // Wgrad: rows of a and b, block g of d
      c.be.gemm(rows_view(a, r0, n), rows_view(b, r0, n), rows_view(d, g * block, block), trans_a, trans_b,
                accumulate);
  }
}

}  // namespace

void check_stacked(const std::vector<Parameter*>& per_expert) {
  const int64_t groups = int64_t(per_expert.size());
  const TensorView w0 = per_expert[0]->weight.view(), g0 = per_expert[0]->grad.view();
  const int64_t rows = w0.size(0), cols = w0.size(1), esz = int64_t(dtype_size(w0.dtype));
  for (int64_t e = 0; e < groups; ++e) {
    const Parameter& p = *per_expert[size_t(e)];
    FP8MOE_CHECK(p.weight.view().data == static_cast<char*>(w0.data) + e * rows * cols * esz &&
                     p.grad.view().data == static_cast<char*>(g0.data) + e * rows * cols * esz,
                 p.name << ": the routed experts' matrices must be stacked in one tensor (model.cpp)");
  }
}

void grouped_linear_forward(Ctx& c, const ExpertGroups& eg, const Cached& x, Parameter& w0, const Tensor& y) {
  if (c.recipe.linear == LinearPrecision::bf16) {  // y[g] = x[g] W[g]^T
    const Tensor wb = weight_bf16(c, w0, eg.groups, false);
    return per_segment(c, eg, x.full.view(), wb.view(), y.view(), false, true, false, w0.weight.size(0), true);
  }
  const QuantizedTensor wq = weight_fp8(c, w0, eg.groups, false);  // [G * N, K]
  c.be.grouped_gemm_fp8_contiguous(x.q, wq, eg.row_group.view(), eg.groups, y.view(), options(c, false));
}

WgradDy grouped_linear_backward_input(Ctx& c, const ExpertGroups& eg, const Tensor& dy, Parameter& w0,
                                      const Tensor& dx, bool accumulate, ScaleMode dy_mode) {
  if (c.recipe.linear == LinearPrecision::bf16) {  // dx[g] (+)= dy[g] W[g]
    const Tensor dyb = to_bf16(c, dy.view()), wb = weight_bf16(c, w0, eg.groups, true);
    per_segment(c, eg, dyb.view(), wb.view(), dx.view(), false, false, accumulate, w0.weight.size(0), true);
    return {dyb, {}};  // converted once for the Dgrad and the Wgrad
  }
  // R is a multiple of 128 (segments padded to 128 rows) and N too (validated): the Dgrad's dy and
  // the Wgrad's dy^T come from one pass.
  const int64_t G = eg.groups, N = w0.weight.size(0), K = w0.weight.size(1), R = dy.size(0);
  QuantizedTensor dyq = c.be.empty_quantized(R, N, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor dyt = c.be.empty_quantized(N, R, DType::e4m3, ScaleKind::tile_1x128);  // dy^T along tokens
  c.be.quantize_1x128_and_128x1(dy.view(), dyq, dyt, dy_mode);
  const QuantizedTensor wq = weight_fp8(c, w0, G, true);
  QuantizedTensor wtq = c.be.empty_quantized(G * K, N, DType::e4m3, ScaleKind::block_128x128);  // W[g]^T stacked
  c.be.transpose_128x128(wq, wtq, G);
  c.be.grouped_gemm_fp8_contiguous(dyq, wtq, eg.row_group.view(), G, dx.view(), options(c, accumulate));
  return {Tensor(), dyt};
}

void grouped_linear_backward_weight(Ctx& c, const ExpertGroups& eg, const Cached& x, const WgradDy& dy, Parameter& w0) {
  if (c.recipe.linear == LinearPrecision::bf16) {  // dW[g] += dy[g]^T x[g]
    return per_segment(c, eg, dy.full.view(), x.full.view(), stacked(w0.grad, eg.groups), true, false, true,
                       w0.weight.size(0), false);  // dy in BF16 (the Dgrad's)
  }
  const int64_t K = w0.weight.size(1), R = dy.t.values.size(1);
  QuantizedTensor b = c.be.empty_quantized(K, R, DType::e4m3, ScaleKind::tile_1x128);  // x^T along tokens
  if (x.full.defined()) c.be.quantize_128x1(x.full.view(), b, c.recipe.scale_mode);  // fp8-f32-cache
  else c.be.requantize_128x1(x.q, b, c.recipe.scale_mode);
  c.be.grouped_wgrad_fp8(dy.t, b, eg.offsets.view(), stacked(w0.grad, eg.groups), options(c, true));
}

}  // namespace fp8moe::model
