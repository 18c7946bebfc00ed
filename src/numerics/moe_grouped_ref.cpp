// MoE permutation and grouped FP8 GEMMs, CPU reference (include/fp8moe/moe_grouped.hpp).
// The grouped GEMMs are defined as the plain reference GEMM applied to each group's slice, which
// is exactly what the grouped kernels must reproduce.
#include "fp8moe/moe_grouped.hpp"

#include <cstring>

#include "fp8moe/codecs.hpp"

namespace fp8moe {

namespace {

// Copy of rows [r0, r1) and columns [c0, c1) of q (c0, c1 multiples of 128 or c1 = cols; for
// 128x128 blocks r0, r1 multiples of 128 too).
QuantizedTensor slice(const QuantizedView& q, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t R = r1 - r0, C = c1 - c0, esz = int64_t(dtype_size(q.values.dtype));
  QuantizedTensor out = make_quantized_host(R, C, q.values.dtype, q.kind);
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(static_cast<char*>(out.values.view().data) + r * C * esz,
                static_cast<const char*>(q.values.data) + ((r0 + r) * q.cols() + c0) * esz, size_t(C * esz));
  float* s = out.scales.ptr<float>();
  const int64_t ld = out.scales.size(1);
  if (q.kind == ScaleKind::tile_1x128) {
    for (int64_t g = 0; g < out.scales.size(0); ++g)
      for (int64_t r = 0; r < ld; ++r) s[g * ld + r] = r < R ? q.scale_at(r0 + r, c0 + g * kQuantGroup) : 1.0f;
  } else {
    for (int64_t br = 0; br < out.scales.size(0); ++br)
      for (int64_t bc = 0; bc < ld; ++bc) s[br * ld + bc] = q.scale_at(r0 + br * kQuantGroup, c0 + bc * kQuantGroup);
  }
  return out;
}

// Writes src [R, N] (f32) into rows [r0, r0 + R) of d [*, N] (f32|bf16).
void put_rows(const TensorView& d, int64_t r0, const Tensor& src) {
  const int64_t R = src.size(0), N = src.size(1);
  for (int64_t i = 0; i < R * N; ++i) store_float(d, r0 * N + i, src.ptr<float>()[i]);
}

void zero_rows(const TensorView& d, int64_t r0, int64_t r1) {
  const int64_t N = d.size(1);
  for (int64_t i = r0 * N; i < r1 * N; ++i) store_float(d, i, 0.0f);
}

void check_weights(const QuantizedView& b, int64_t groups, int64_t K, const char* arg) {
  check_quantized(b, arg, ScaleKind::block_128x128);
  FP8MOE_CHECK(groups > 0 && b.rows() % groups == 0, arg << ": " << b.rows() << " rows do not split into " << groups << " groups");
  FP8MOE_CHECK((b.rows() / groups) % kQuantGroup == 0,
               arg << ": N = " << b.rows() / groups << " per group must be a multiple of 128 (one 128x128 block per expert)");
  FP8MOE_CHECK(b.cols() == K, arg << ": expected K = " << K << " columns, got " << b.values.str());
}

}  // namespace

MoeLayout build_moe_layout(const TensorView& expert_ids, int64_t groups, int64_t align) {
  check_tensor(expert_ids, "expert_ids", DType::i32, 2);
  FP8MOE_CHECK(groups > 0, "groups must be positive, got " << groups);
  FP8MOE_CHECK(align > 0, "align must be positive, got " << align);
  MoeLayout L;
  L.tokens = expert_ids.size(0);
  L.topk = expert_ids.size(1);
  L.groups = groups;
  L.align = align;
  const int32_t* ids = expert_ids.ptr<const int32_t>();
  L.counts.assign(size_t(groups), 0);
  for (int64_t i = 0; i < L.tokens * L.topk; ++i) {
    FP8MOE_CHECK(ids[i] >= -1 && ids[i] < groups, "expert_ids: value " << ids[i] << " at [" << i / L.topk << ", "
                                                                         << i % L.topk << "] outside [-1, " << groups << ")");
    if (ids[i] >= 0) ++L.counts[size_t(ids[i])];
  }
  L.offsets.assign(size_t(groups + 1), 0);
  for (int64_t g = 0; g < groups; ++g) L.offsets[size_t(g + 1)] = L.offsets[size_t(g)] + round_up(L.counts[size_t(g)], align);
  const int64_t M = L.offsets.back();
  L.row_token.assign(size_t(M), -1);
  L.row_group.assign(size_t(M), -1);
  L.slot_row.assign(size_t(L.tokens * L.topk), -1);
  std::vector<int64_t> fill(L.offsets.begin(), L.offsets.end() - 1);
  for (int64_t t = 0; t < L.tokens; ++t)
    for (int64_t s = 0; s < L.topk; ++s) {
      const int32_t g = ids[t * L.topk + s];
      if (g < 0) continue;
      const int64_t row = fill[size_t(g)]++;
      L.row_token[size_t(row)] = int32_t(t);
      L.row_group[size_t(row)] = g;
      L.slot_row[size_t(t * L.topk + s)] = int32_t(row);
    }
  return L;
}

void moe_permute_quantize(const TensorView& x, const MoeLayout& layout, const QuantizedView& out, ScaleMode mode) {
  check_tensor(x, "x", {DType::f32, DType::bf16}, 2);
  FP8MOE_CHECK(x.size(0) == layout.tokens, "x: " << x.size(0) << " tokens, the layout has " << layout.tokens);
  check_quantized(out, "out", ScaleKind::tile_1x128);
  check_shape(out.values, "out.values", {layout.rows(), x.size(1)});
  const int64_t D = x.size(1);
  Tensor gathered = Tensor::host(DType::f32, {layout.rows(), D});
  for (int64_t r = 0; r < layout.rows(); ++r) {
    const int32_t t = layout.row_token[size_t(r)];
    if (t >= 0)
      for (int64_t c = 0; c < D; ++c) gathered.ptr<float>()[r * D + c] = load_float(x, t * D + c);
  }
  quantize_1x128(gathered, out, mode);
}

void moe_unpermute_combine(const TensorView& y, const TensorView& weights, const MoeLayout& layout, const TensorView& out) {
  check_tensor(y, "y", {DType::f32, DType::bf16}, 2);
  check_tensor(weights, "weights", DType::f32, 2);
  check_tensor(out, "out", {DType::f32, DType::bf16}, 2);
  FP8MOE_CHECK(y.size(0) == layout.rows(), "y: " << y.size(0) << " rows, the layout has " << layout.rows());
  check_shape(weights, "weights", {layout.tokens, layout.topk});
  check_shape(out, "out", {layout.tokens, y.size(1)});
  const int64_t N = y.size(1);
  for (int64_t t = 0; t < layout.tokens; ++t)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0;
      for (int64_t s = 0; s < layout.topk; ++s) {
        const int32_t r = layout.slot_row[size_t(t * layout.topk + s)];
        if (r >= 0) acc += weights.ptr<const float>()[t * layout.topk + s] * load_float(y, r * N + n);
      }
      store_float(out, t * N + n, acc);
    }
}

void grouped_gemm_fp8_contiguous_ref(const QuantizedView& a, const QuantizedView& b, const std::vector<int32_t>& row_group,
                                     int64_t groups, const TensorView& d, const GemmOptions& opt) {
  check_quantized(a, "a", ScaleKind::tile_1x128);
  check_weights(b, groups, a.cols(), "b");
  const int64_t M = a.rows(), N = b.rows() / groups;
  FP8MOE_CHECK(int64_t(row_group.size()) == M, "row_group: " << row_group.size() << " entries, a has " << M << " rows");
  check_tensor(d, "d", {DType::f32, DType::bf16}, 2);
  check_shape(d, "d", {M, N});
  for (int64_t r = 0; r < M;) {  // runs of rows with one group
    const int32_t g = row_group[size_t(r)];
    FP8MOE_CHECK(g >= -1 && g < groups, "row_group: value " << g << " at row " << r << " outside [-1, " << groups << ")");
    int64_t e = r + 1;
    while (e < M && row_group[size_t(e)] == g) ++e;
    if (g < 0) {
      zero_rows(d, r, e);
    } else {
      QuantizedTensor as = slice(a, r, e, 0, a.cols()), bs = slice(b, g * N, (g + 1) * N, 0, b.cols());
      Tensor part = Tensor::host(DType::f32, {e - r, N});
      GemmOptions o = opt;
      o.accumulate = false;
      gemm_fp8_ref(as, bs, part, o);
      put_rows(d, r, part);
    }
    r = e;
  }
}

void grouped_gemm_fp8_masked_ref(const QuantizedView& a, const QuantizedView& b, const std::vector<int64_t>& counts,
                                 int64_t groups, const TensorView& d, const GemmOptions& opt) {
  check_quantized(a, "a", ScaleKind::tile_1x128);
  check_weights(b, groups, a.cols(), "b");
  FP8MOE_CHECK(int64_t(counts.size()) == groups, "counts: " << counts.size() << " entries for " << groups << " groups");
  FP8MOE_CHECK(a.rows() % groups == 0, "a: " << a.rows() << " rows do not split into " << groups << " groups of M_max");
  const int64_t Mmax = a.rows() / groups, N = b.rows() / groups;
  check_tensor(d, "d", {DType::f32, DType::bf16}, 2);
  check_shape(d, "d", {a.rows(), N});
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m = counts[size_t(g)];
    FP8MOE_CHECK(m >= 0 && m <= Mmax, "counts[" << g << "] = " << m << " outside [0, " << Mmax << "]");
    if (m > 0) {
      QuantizedTensor as = slice(a, g * Mmax, g * Mmax + m, 0, a.cols()), bs = slice(b, g * N, (g + 1) * N, 0, b.cols());
      Tensor part = Tensor::host(DType::f32, {m, N});
      GemmOptions o = opt;
      o.accumulate = false;
      gemm_fp8_ref(as, bs, part, o);
      put_rows(d, g * Mmax, part);
    }
    zero_rows(d, g * Mmax + m, (g + 1) * Mmax);
  }
}

void grouped_wgrad_fp8_ref(const QuantizedView& dy_t, const QuantizedView& x_t, const std::vector<int64_t>& offsets,
                           const TensorView& d, const GemmOptions& opt) {
  check_quantized(dy_t, "dy_t", ScaleKind::tile_1x128);
  check_quantized(x_t, "x_t", ScaleKind::tile_1x128);
  FP8MOE_CHECK(dy_t.cols() == x_t.cols(), "x_t: " << x_t.cols() << " token columns, dy_t has " << dy_t.cols());
  FP8MOE_CHECK(offsets.size() >= 2 && offsets.front() == 0 && offsets.back() <= dy_t.cols(),
               "offsets: must run from 0 to at most the " << dy_t.cols() << " token columns");
  const int64_t G = int64_t(offsets.size()) - 1, N = dy_t.rows(), K = x_t.rows();
  check_tensor(d, "d", DType::f32, 2);
  check_shape(d, "d", {G * N, K});
  for (int64_t g = 1; g <= G; ++g)
    FP8MOE_CHECK(offsets[size_t(g)] % kQuantGroup == 0 && offsets[size_t(g)] >= offsets[size_t(g - 1)],
                 "offsets[" << g << "] = " << offsets[size_t(g)]
                            << ": segments must start on 128-token boundaries, in ascending order");
  for (int64_t g = 0; g < G; ++g) {
    const int64_t c0 = offsets[size_t(g)], c1 = offsets[size_t(g + 1)];
    TensorView dg = d;
    dg.data = d.ptr<float>() + g * N * K;
    dg.shape[0] = N;
    if (c1 == c0) {
      if (!opt.accumulate) zero_rows(dg, 0, N);
      continue;
    }
    QuantizedTensor ds = slice(dy_t, 0, N, c0, c1), xs = slice(x_t, 0, K, c0, c1);
    gemm_fp8_ref(ds, xs, dg, opt);
  }
}

}  // namespace fp8moe
