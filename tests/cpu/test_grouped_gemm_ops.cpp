// The CPU backend's grouped FP8 GEMM ops (the specification the CUDA kernels are tested against):
// the group tables read from i32 tensors give the references' results, accumulation adds on
// expert rows only and leaves padding rows (and the rows of empty Wgrad segments) bit for bit
// alone, and bad tables or options raise errors naming the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "fp8moe/backend.hpp"
#include "fp8moe/moe_grouped.hpp"
#include "grouped_testing.hpp"

using namespace fp8moe;
using namespace fp8moe::testing;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

QuantizedTensor random_quantized(std::mt19937_64& rng, int64_t R, int64_t C, ScaleKind kind) {
  Tensor x = random_normal(rng, DType::f32, {R, C});
  QuantizedTensor q = make_quantized_host(R, C, DType::e4m3, kind);
  if (kind == ScaleKind::tile_1x128) quantize_1x128(x, q);
  else quantize_128x128(x, q);
  return q;
}

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::host_like(t.view());
  std::memcpy(c.view().data, t.view().data, t.view().nbytes());
  return c;
}

bool same_bytes(const Tensor& x, const Tensor& y, int64_t i) {
  const size_t es = dtype_size(x.dtype());
  return std::memcmp(static_cast<const char*>(x.view().data) + i * es, static_cast<const char*>(y.view().data) + i * es,
                     es) == 0;
}

class GroupedGemmOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> cpu_ = make_backend("cpu");
};

TEST_F(GroupedGemmOps, ContiguousReadsRowGroupAndAccumulatesOnExpertRowsOnly) {
  auto rng = make_rng();
  const int64_t G = 3, N = 128, K = 256;
  const ExpertRows L = expert_rows(random_expert_counts(rng, G, 150, {1}), 50);
  const int64_t R = L.rows();
  QuantizedTensor a = random_quantized(rng, R, K, ScaleKind::tile_1x128);
  QuantizedTensor b = random_quantized(rng, G * N, K, ScaleKind::block_128x128);
  const Tensor rg = i32_tensor(L.row_group);
  // Overwrite: the reference's result, padding rows zero.
  Tensor want = Tensor::host(DType::f32, {R, N});
  grouped_gemm_fp8_contiguous_ref(a, b, L.row_group, G, want);
  Tensor d = Tensor::host(DType::f32, {R, N});
  for (int64_t i = 0; i < R * N; ++i) d.ptr<float>()[i] = kNaN;
  cpu_->grouped_gemm_fp8_contiguous(a, b, rg, G, d, {});
  for (int64_t i = 0; i < R * N; ++i) ASSERT_TRUE(same_bytes(d, want, i)) << "row " << i / N;
  for (int64_t r = 0; r < R; ++r) {
    if (L.row_group[size_t(r)] < 0) {
      ASSERT_EQ(d.ptr<float>()[r * N], 0.0f) << "padding row " << r;
    }
  }
  // Accumulate: d0 + product on expert rows, padding rows (NaN) untouched.
  Tensor d0 = random_normal(rng, DType::f32, {R, N});
  for (int64_t r = 0; r < R; ++r) {
    if (L.row_group[size_t(r)] >= 0) continue;
    for (int64_t n = 0; n < N; ++n) d0.ptr<float>()[r * N + n] = kNaN;
  }
  Tensor acc = copy_of(d0);
  GemmOptions o;
  o.accumulate = true;
  cpu_->grouped_gemm_fp8_contiguous(a, b, rg, G, acc, o);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t i = r * N + n;
      if (L.row_group[size_t(r)] < 0) {
        ASSERT_TRUE(same_bytes(acc, d0, i)) << "padding row " << r << " touched";
      } else {
        ASSERT_EQ(acc.ptr<float>()[i], d0.ptr<float>()[i] + want.ptr<float>()[i]) << "row " << r;
      }
    }
  // Errors: table length, dtype and values; accumulate into bf16.
  expect_error([&] { cpu_->grouped_gemm_fp8_contiguous(a, b, i32_tensor(std::vector<int>(size_t(R - 1), 0)), G, d, {}); },
               "row_group must have");
  Tensor rg_f32 = Tensor::host(DType::f32, {R});
  expect_error([&] { cpu_->grouped_gemm_fp8_contiguous(a, b, rg_f32, G, d, {}); }, "row_group must be i32");
  std::vector<int32_t> bad = L.row_group;
  bad[0] = int32_t(G);
  expect_error([&] { cpu_->grouped_gemm_fp8_contiguous(a, b, i32_tensor(bad), G, d, {}); }, "outside [-1, 3)");
  Tensor d16 = Tensor::host(DType::bf16, {R, N});
  expect_error([&] { cpu_->grouped_gemm_fp8_contiguous(a, b, rg, G, d16, o); }, "d: expected dtype f32");
  expect_error([&] { cpu_->grouped_gemm_fp8_contiguous(a, b, rg, 5, d, {}); }, "do not split into 5 groups");
  expect_error([&] { cpu_->grouped_gemm_fp8_contiguous(a, b, rg, 2, d, {}); }, "N = 192 per group must be a multiple of 128");
}

TEST_F(GroupedGemmOps, MaskedReadsCounts) {
  auto rng = make_rng();
  const int64_t G = 4, Mmax = 100, N = 256, K = 128;
  const std::vector<int64_t> counts{100, 0, 37, 1};
  QuantizedTensor a = random_quantized(rng, G * Mmax, K, ScaleKind::tile_1x128);
  QuantizedTensor b = random_quantized(rng, G * N, K, ScaleKind::block_128x128);
  Tensor want = Tensor::host(DType::bf16, {G * Mmax, N});
  grouped_gemm_fp8_masked_ref(a, b, counts, G, want);
  Tensor d = Tensor::host(DType::bf16, {G * Mmax, N});
  std::memset(d.view().data, 0xFF, d.view().nbytes());
  cpu_->grouped_gemm_fp8_masked(a, b, i32_tensor(counts), G, d, {});
  EXPECT_EQ(std::memcmp(d.view().data, want.view().data, d.view().nbytes()), 0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t m = counts[size_t(g)]; m < Mmax; ++m)
      ASSERT_EQ(load_float(d, (g * Mmax + m) * N), 0.0f) << "group " << g << " row " << m << " past the count";
  GemmOptions o;
  o.accumulate = true;
  Tensor d32 = Tensor::host(DType::f32, {G * Mmax, N});
  expect_error([&] { cpu_->grouped_gemm_fp8_masked(a, b, i32_tensor(counts), G, d32, o); }, "accumulate is unsupported");
  expect_error([&] { cpu_->grouped_gemm_fp8_masked(a, b, i32_tensor(std::vector<int64_t>{1, 2, 3}), G, d, {}); },
               "counts must have 4 entries");
  expect_error([&] { cpu_->grouped_gemm_fp8_masked(a, b, i32_tensor(std::vector<int64_t>{1, 2, 3, 101}), G, d, {}); },
               "counts[3] = 101 outside [0, 100]");
  Tensor counts64 = Tensor::host(DType::i64, {G});
  expect_error([&] { cpu_->grouped_gemm_fp8_masked(a, b, counts64, G, d, {}); }, "counts must be i32");
}

TEST_F(GroupedGemmOps, WgradReadsOffsetsAndLeavesEmptySegments) {
  auto rng = make_rng();
  const int64_t N = 128, K = 200, R = 768;
  const std::vector<int64_t> offsets{0, 256, 256, 640};  // an empty expert; columns past 640 ignored
  const int64_t G = int64_t(offsets.size()) - 1;
  QuantizedTensor dy = random_quantized(rng, N, R, ScaleKind::tile_1x128);
  QuantizedTensor x = random_quantized(rng, K, R, ScaleKind::tile_1x128);
  const Tensor off = i32_tensor(offsets);
  Tensor want = Tensor::host(DType::f32, {G * N, K});
  grouped_wgrad_fp8_ref(dy, x, offsets, want);
  Tensor d = Tensor::host(DType::f32, {G * N, K});
  for (int64_t i = 0; i < d.numel(); ++i) d.ptr<float>()[i] = kNaN;
  cpu_->grouped_wgrad_fp8(dy, x, off, d, {});
  EXPECT_EQ(std::memcmp(d.view().data, want.view().data, d.view().nbytes()), 0);
  for (int64_t i = N * K; i < 2 * N * K; ++i) ASSERT_EQ(d.ptr<float>()[i], 0.0f) << "empty segment not zeroed";
  // Accumulate: the empty segment's rows keep their bits, the others add.
  Tensor d0 = random_normal(rng, DType::f32, {G * N, K});
  for (int64_t i = N * K; i < 2 * N * K; ++i) d0.ptr<float>()[i] = kNaN;
  Tensor acc = copy_of(d0);
  GemmOptions o;
  o.accumulate = true;
  cpu_->grouped_wgrad_fp8(dy, x, off, acc, o);
  Tensor want_acc = copy_of(d0);
  grouped_wgrad_fp8_ref(dy, x, offsets, want_acc, o);
  EXPECT_EQ(std::memcmp(acc.view().data, want_acc.view().data, acc.view().nbytes()), 0);
  for (int64_t i = N * K; i < 2 * N * K; ++i) ASSERT_TRUE(same_bytes(acc, d0, i)) << "empty segment touched";
  // Errors: offsets not from 0, past R, off the 128-token grid, wrong dtype.
  for (const std::vector<int64_t>& bad : {std::vector<int64_t>{128, 256, 256, 640}, std::vector<int64_t>{0, 256, 256, 896}})
    expect_error([&] { cpu_->grouped_wgrad_fp8(dy, x, i32_tensor(bad), d, {}); }, "offsets: must run from 0");
  expect_error([&] { cpu_->grouped_wgrad_fp8(dy, x, i32_tensor(std::vector<int64_t>{0, 200, 256, 640}), d, {}); },
               "offsets[1] = 200: segments must start on 128-token boundaries");
  expect_error([&] { cpu_->grouped_wgrad_fp8(dy, x, i32_tensor(std::vector<int64_t>{0, 256, 128, 640}), d, {}); },
               "in ascending order");
  Tensor off64 = Tensor::host(DType::i64, {G + 1});
  expect_error([&] { cpu_->grouped_wgrad_fp8(dy, x, off64, d, {}); }, "offsets must be i32");
}

}  // namespace
