// MoE permutation and grouped FP8 GEMMs (CPU reference): layout invariants, fused gather +
// quantize, combine, and the contiguous / masked / k-grouped GEMMs against FP64 products, with
// per-expert token counts drawn between 0.7x and 1.3x of the mean and an empty expert.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "fp8moe/moe_grouped.hpp"
#include "testing.hpp"

using namespace fp8moe;
using namespace fp8moe::testing;

namespace {

// Top-k routing [T, k] with distinct experts per token; expert `empty` never chosen; loads vary.
Tensor random_routing(std::mt19937_64& rng, int64_t T, int64_t k, int64_t G, int64_t empty) {
  Tensor ids = Tensor::host(DType::i32, {T, k});
  std::vector<double> w(static_cast<size_t>(G));
  std::uniform_real_distribution<double> u(0.7, 1.3);
  for (int64_t g = 0; g < G; ++g) w[size_t(g)] = g == empty ? 0.0 : u(rng);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> ww = w;
    for (int64_t s = 0; s < k; ++s) {
      std::discrete_distribution<int> pick(ww.begin(), ww.end());
      int g = pick(rng);
      ids.ptr<int32_t>()[t * k + s] = g;
      ww[size_t(g)] = 0;
    }
  }
  return ids;
}

std::vector<double> dequant(const QuantizedView& q) {
  Tensor d = Tensor::host(DType::f32, {q.rows(), q.cols()});
  dequantize(q, d);
  return to_doubles(d);
}

}  // namespace

TEST(MoeLayout, SegmentsArePaddedOrderedAndInvertible) {
  auto rng = make_rng();
  const int64_t T = 300, k = 3, G = 6;
  Tensor ids = random_routing(rng, T, k, G, 4);
  MoeLayout L = build_moe_layout(ids, G, 128);
  EXPECT_EQ(L.counts[4], 0);
  EXPECT_EQ(L.offsets[5], L.offsets[4]);  // empty segment
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) {
    EXPECT_EQ(L.offsets[size_t(g)] % 128, 0);
    EXPECT_EQ(L.offsets[size_t(g + 1)] - L.offsets[size_t(g)], round_up(L.counts[size_t(g)], 128));
    int32_t prev = -1;
    for (int64_t r = L.offsets[size_t(g)]; r < L.offsets[size_t(g + 1)]; ++r) {
      if (r - L.offsets[size_t(g)] < L.counts[size_t(g)]) {
        EXPECT_EQ(L.row_group[size_t(r)], g);
        EXPECT_GT(L.row_token[size_t(r)], prev);  // ascending tokens: deterministic order
        prev = L.row_token[size_t(r)];
      } else {
        EXPECT_EQ(L.row_token[size_t(r)], -1);
        EXPECT_EQ(L.row_group[size_t(r)], -1);
      }
    }
    total += L.counts[size_t(g)];
  }
  EXPECT_EQ(total, T * k);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      int32_t r = L.slot_row[size_t(t * k + s)];
      EXPECT_EQ(L.row_token[size_t(r)], t);
      EXPECT_EQ(L.row_group[size_t(r)], ids.ptr<int32_t>()[t * k + s]);
    }
  ids.ptr<int32_t>()[7] = int32_t(G);
  EXPECT_THROW(build_moe_layout(ids, G), Error);
}

// permute + quantize -> contiguous grouped GEMM -> combine equals the per-token MoE in FP64.
TEST(MoeGrouped, ContiguousPipelineMatchesPerTokenExperts) {
  auto rng = make_rng();
  const int64_t T = 200, k = 2, G = 4, D = 256, N = 128;
  Tensor ids = random_routing(rng, T, k, G, 2);
  Tensor gate_w = Tensor::host(DType::f32, {T, k});
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (int64_t i = 0; i < T * k; ++i) gate_w.ptr<float>()[i] = u(rng);
  Tensor x = random_normal(rng, DType::bf16, {T, D});
  Tensor w = random_normal(rng, DType::f32, {G * N, D}, 0.05f);
  MoeLayout L = build_moe_layout(ids, G);
  auto xq = make_quantized_host(L.rows(), D, DType::e4m3, ScaleKind::tile_1x128);
  moe_permute_quantize(x, L, xq);
  // Padding rows: exact zeros with scale 1; real rows equal quantizing the token alone.
  for (int64_t r = 0; r < L.rows(); ++r)
    if (L.row_token[size_t(r)] < 0) {
      for (int64_t c = 0; c < D; ++c) ASSERT_EQ(xq.values.ptr<uint8_t>()[r * D + c], 0);
      ASSERT_EQ(xq.view().scale_at(r, 0), 1.0f);
    }
  auto wq = make_quantized_host(G * N, D, DType::e4m3, ScaleKind::block_128x128);
  quantize_128x128(w, wq);
  Tensor y = Tensor::host(DType::f32, {L.rows(), N});
  for (int64_t i = 0; i < y.numel(); ++i) y.ptr<float>()[i] = NAN;
  grouped_gemm_fp8_contiguous_ref(xq, wq, L.row_group, G, y);
  for (int64_t i = 0; i < y.numel(); ++i) ASSERT_TRUE(std::isfinite(y.ptr<float>()[i])) << "row " << i / N << " unwritten";
  Tensor out = Tensor::host(DType::f32, {T, N});
  moe_unpermute_combine(y, gate_w, L, out);

  // FP64 per token, from the same quantized operands (kernel error) and the unquantized ones (recipe).
  const std::vector<double> xd = dequant(xq), wd = dequant(wq), xr = to_doubles(x), wr = to_doubles(w);
  std::vector<double> want_q(size_t(T * N)), want_r(size_t(T * N));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int64_t g = ids.ptr<int32_t>()[t * k + s], r = L.slot_row[size_t(t * k + s)];
      const double gw = gate_w.ptr<float>()[t * k + s];
      for (int64_t n = 0; n < N; ++n) {
        double q = 0, e = 0;
        for (int64_t c = 0; c < D; ++c) {
          q += xd[size_t(r * D + c)] * wd[size_t((g * N + n) * D + c)];
          e += xr[size_t(t * D + c)] * wr[size_t((g * N + n) * D + c)];
        }
        want_q[size_t(t * N + n)] += gw * q;
        want_r[size_t(t * N + n)] += gw * e;
      }
    }
  std::vector<double> got = to_doubles(out);
  EXPECT_LT(rel_error(got, want_q), 1e-5);
  EXPECT_LT(calc_diff(got, want_r), 1e-3);
}

TEST(MoeGrouped, MaskedMatchesContiguousRows) {
  auto rng = make_rng();
  const int64_t G = 3, Mmax = 192, K = 256, N = 128;
  std::vector<int64_t> counts{150, 0, 97};
  Tensor a = random_normal(rng, DType::f32, {G * Mmax, K});
  Tensor w = random_normal(rng, DType::f32, {G * N, K}, 0.05f);
  auto aq = make_quantized_host(G * Mmax, K, DType::e4m3, ScaleKind::tile_1x128);
  auto wq = make_quantized_host(G * N, K, DType::e4m3, ScaleKind::block_128x128);
  quantize_1x128(a, aq);
  quantize_128x128(w, wq);
  Tensor d = Tensor::host(DType::bf16, {G * Mmax, N});
  grouped_gemm_fp8_masked_ref(aq, wq, counts, G, d);
  std::vector<int32_t> row_group(size_t(G * Mmax), -1);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t m = 0; m < counts[size_t(g)]; ++m) row_group[size_t(g * Mmax + m)] = int32_t(g);
  Tensor c = Tensor::host(DType::bf16, {G * Mmax, N});
  grouped_gemm_fp8_contiguous_ref(aq, wq, row_group, G, c);
  EXPECT_EQ(std::memcmp(d.view().data, c.view().data, d.view().nbytes()), 0);
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(load_float(d, (Mmax + 5) * N + n), 0.0f);  // empty group zeroed
  std::vector<int64_t> bad{200, 0, 0};
  EXPECT_THROW(grouped_gemm_fp8_masked_ref(aq, wq, bad, G, d), Error);
}

TEST(MoeGrouped, KGroupedWgradAccumulatesPerExpert) {
  auto rng = make_rng();
  const int64_t N = 64, K = 96;
  const std::vector<int64_t> offsets{0, 256, 256, 384};  // an empty expert in the middle
  const int64_t M = offsets.back(), G = 3;
  Tensor dy = random_normal(rng, DType::bf16, {M, N}), x = random_normal(rng, DType::bf16, {M, K});
  auto dyq = make_quantized_host(N, M, DType::e4m3, ScaleKind::tile_1x128);
  auto xq = make_quantized_host(K, M, DType::e4m3, ScaleKind::tile_1x128);
  quantize_128x1(dy, dyq);
  quantize_128x1(x, xq);
  Tensor dw = random_normal(rng, DType::f32, {G * N, K});
  std::vector<double> want = to_doubles(dw);
  GemmOptions acc;
  acc.accumulate = true;
  grouped_wgrad_fp8_ref(dyq, xq, offsets, dw, acc);
  const std::vector<double> dyd = dequant(dyq), xd = dequant(xq);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t kk = 0; kk < K; ++kk) {
        double s = 0;
        for (int64_t m = offsets[size_t(g)]; m < offsets[size_t(g + 1)]; ++m) s += dyd[size_t(n * M + m)] * xd[size_t(kk * M + m)];
        want[size_t((g * N + n) * K + kk)] += s;
      }
  EXPECT_LT(rel_error(to_doubles(dw), want), 1e-6);
}
