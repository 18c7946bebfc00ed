// Fine-grained quantizers: round-trip error within half an FP8 ulp times the scale, outlier
// isolation per tile, all-zero tiles, ragged shapes without stray writes, power-of-two scales, the
// two 128x1 paths, and the errors bad input raises.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "fp8moe/codecs.hpp"
#include "fp8moe/quantize.hpp"
#include "testing.hpp"

using namespace fp8moe;
using fp8moe::testing::make_rng;
using fp8moe::testing::random_normal;
using fp8moe::testing::expect_error;

namespace {

// Half an ulp of `dtype` at magnitude |v| (v in units of the scale), the RNE error bound.
double half_ulp(DType dtype, double v) {
  const MiniFloatFormat& f = format_of(dtype);
  int e = v == 0 ? 1 - f.bias : std::max(std::ilogb(v), 1 - f.bias);
  return std::ldexp(0.5, e - f.man_bits);
}

void expect_roundtrip_bound(const TensorView& x, const QuantizedView& q) {
  const int64_t R = q.rows(), C = q.cols();
  int64_t bad = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      double s = q.scale_at(r, c);
      double v = load_float(x, r * C + c);
      double deq = double(decode_value(q.values.dtype, q.values.data, r * C + c)) * s;
      // x * (1 / s) carries two float roundings before encoding (of 1 / s and of the product),
      // each within 2^-24 relative: allow 2^-23 of |x| for them.
      double bound = half_ulp(q.values.dtype, std::fabs(v) / s) * s * (1 + 1e-6) + std::fabs(v) * 0x1p-23;
      if (std::fabs(deq - v) > bound && ++bad < 5)
        ADD_FAILURE() << "[" << r << ", " << c << "] x=" << v << " deq=" << deq << " bound=" << bound;
    }
  EXPECT_EQ(bad, 0);
}

}  // namespace

using ShapeParam = std::tuple<int64_t, int64_t, DType, ScaleMode>;
static std::string shape_name(const ::testing::TestParamInfo<ShapeParam>& info) {
  const auto& [R, C, dtype, mode] = info.param;
  return std::to_string(R) + "x" + std::to_string(C) + "_" + std::string(dtype_name(dtype)) +
         (mode == ScaleMode::pow2 ? "_pow2" : "_fp32");
}

class QuantizeShapes : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, DType, ScaleMode>> {};

TEST_P(QuantizeShapes, RoundTripWithinHalfUlp) {
  auto [R, C, dtype, mode] = GetParam();
  auto rng = make_rng();
  for (DType in_dtype : {DType::f32, DType::bf16}) {
    Tensor x = random_normal(rng, in_dtype, {R, C}, 3.0f);
    auto q1 = make_quantized_host(R, C, dtype, ScaleKind::tile_1x128);
    quantize_1x128(x, q1, mode);
    expect_roundtrip_bound(x, q1);
    auto q2 = make_quantized_host(R, C, dtype, ScaleKind::block_128x128);
    quantize_128x128(x, q2, mode);
    expect_roundtrip_bound(x, q2);
    // The largest element of each tile lands at (or, for pow2 scales, below) the format's max.
    for (int64_t r = 0; r < R; ++r) {
      float amax = 0;
      for (int64_t c = 0; c < std::min<int64_t>(C, 128); ++c) amax = std::max(amax, std::fabs(load_float(x, r * C + c)));
      float s = q1.view().scale_at(r, 0);
      if (mode == ScaleMode::fp32) EXPECT_FLOAT_EQ(s, amax / float(max_finite(dtype)));
      else EXPECT_TRUE(s >= amax / float(max_finite(dtype)) && s < 2 * amax / float(max_finite(dtype)));
    }
    // Padding rows of the M-major scale layout are 1.
    const float* sc = q1.scales.ptr<float>();
    for (int64_t g = 0; g < q1.scales.size(0); ++g)
      for (int64_t r = R; r < scale_ld(R); ++r) EXPECT_EQ(sc[g * scale_ld(R) + r], 1.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantizeShapes,
    ::testing::Values(std::tuple{int64_t(256), int64_t(512), DType::e4m3, ScaleMode::fp32},
                      std::tuple{int64_t(130), int64_t(200), DType::e4m3, ScaleMode::fp32},
                      std::tuple{int64_t(1), int64_t(77), DType::e4m3, ScaleMode::pow2},
                      std::tuple{int64_t(257), int64_t(384), DType::e4m3, ScaleMode::pow2},
                      std::tuple{int64_t(129), int64_t(129), DType::e5m2, ScaleMode::fp32},
                      std::tuple{int64_t(67), int64_t(300), DType::e5m6, ScaleMode::pow2}),
    shape_name);

TEST(Quantize, PowerOfTwoScalesArePowersOfTwo) {
  auto rng = make_rng();
  Tensor x = random_normal(rng, DType::f32, {64, 384}, 100.0f);
  auto q = make_quantized_host(64, 384, DType::e4m3, ScaleKind::tile_1x128);
  quantize_1x128(x, q, ScaleMode::pow2);
  for (int64_t i = 0; i < q.scales.numel(); ++i) {
    int e;
    EXPECT_EQ(std::frexp(q.scales.ptr<float>()[i], &e), 0.5f);
  }
}

// An outlier only spoils its own tile (1x128) or block (128x128).
TEST(Quantize, OutlierChangesOnlyItsOwnTile) {
  auto rng = make_rng();
  const int64_t R = 256, C = 512;
  Tensor x = random_normal(rng, DType::f32, {R, C});
  for (ScaleKind kind : {ScaleKind::tile_1x128, ScaleKind::block_128x128}) {
    auto clean = make_quantized_host(R, C, DType::e4m3, kind);
    auto dirty = make_quantized_host(R, C, DType::e4m3, kind);
    Tensor y = Tensor::host(DType::f32, {R, C});
    std::memcpy(y.ptr<float>(), x.ptr<float>(), size_t(R * C) * 4);
    const int64_t orow = 130, ocol = 300;
    y.ptr<float>()[orow * C + ocol] = 1e4f;
    auto quant = [&](const TensorView& in, const QuantizedView& out) {
      kind == ScaleKind::tile_1x128 ? quantize_1x128(in, out) : quantize_128x128(in, out);
    };
    quant(x, clean);
    quant(y, dirty);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        bool same_tile = c / 128 == ocol / 128 && (kind == ScaleKind::tile_1x128 ? r == orow : r / 128 == orow / 128);
        bool same = clean.values.ptr<uint8_t>()[r * C + c] == dirty.values.ptr<uint8_t>()[r * C + c] &&
                    clean.view().scale_at(r, c) == dirty.view().scale_at(r, c);
        if (!same_tile) {
          ASSERT_TRUE(same) << "element [" << r << ", " << c << "] changed";
        } else if (!(r == orow && c == ocol)) {
          EXPECT_NE(clean.view().scale_at(r, c), dirty.view().scale_at(r, c));
        }
      }
  }
}

TEST(Quantize, AllZeroTileGivesFiniteScaleAndExactZeros) {
  Tensor x = Tensor::host(DType::f32, {3, 256});
  x.ptr<float>()[2 * 256 + 200] = 5.0f;  // one non-zero tile
  auto q = make_quantized_host(3, 256, DType::e4m3, ScaleKind::tile_1x128);
  quantize_1x128(x, q);
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < 256; ++c) {
      float s = q.view().scale_at(r, c);
      EXPECT_TRUE(std::isfinite(s) && s > 0);
      if (!(r == 2 && c == 200)) {
        EXPECT_EQ(q.values.ptr<uint8_t>()[r * 256 + c], 0);
      }
    }
  EXPECT_EQ(q.view().scale_at(0, 0), 1.0f);
  EXPECT_EQ(e4m3_decode(q.values.ptr<uint8_t>()[2 * 256 + 200]) * q.view().scale_at(2, 200), 5.0f);
}

// Writes stay inside [R, C] for ragged shapes: the tensors are views into larger poisoned buffers.
TEST(Quantize, RaggedShapesWriteNothingPastTheEnd) {
  auto rng = make_rng();
  const int64_t R = 131, C = 250;
  Tensor x = random_normal(rng, DType::f32, {R, C});
  std::vector<uint8_t> vbuf(size_t(R * C) + 4096, 0xA5);
  auto ss = scale_shape(ScaleKind::tile_1x128, R, C);
  std::vector<float> sbuf(size_t(ss[0] * ss[1]) + 1024, -7.0f);
  QuantizedView q{TensorView(vbuf.data(), DType::e4m3, {R, C}), TensorView(sbuf.data(), DType::f32, {ss[0], ss[1]}),
                  ScaleKind::tile_1x128};
  quantize_1x128(x, q);
  for (size_t i = size_t(R * C); i < vbuf.size(); ++i) ASSERT_EQ(vbuf[i], 0xA5) << "stray write at " << i;
  for (size_t i = size_t(ss[0] * ss[1]); i < sbuf.size(); ++i) ASSERT_EQ(sbuf[i], -7.0f) << "stray scale write";
  for (size_t i = 0; i < size_t(ss[0] * ss[1]); ++i) ASSERT_NE(sbuf[i], -7.0f) << "scale " << i << " unwritten";
}

// 128x1 for Wgrad: direct from FP32 equals 1x128 of the transpose; the report's path
// (dequantize, transpose, requantize) stays within both quantizations' error.
TEST(Quantize, Both128x1PathsAgree) {
  auto rng = make_rng();
  const int64_t T = 300, C = 256;
  Tensor x = random_normal(rng, DType::bf16, {T, C});
  Tensor xt = Tensor::host(DType::bf16, {C, T});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) xt.ptr<uint16_t>()[c * T + t] = x.ptr<uint16_t>()[t * C + c];
  for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2}) {
    auto direct = make_quantized_host(C, T, DType::e4m3, ScaleKind::tile_1x128);
    auto of_transpose = make_quantized_host(C, T, DType::e4m3, ScaleKind::tile_1x128);
    quantize_128x1(x, direct, mode);
    quantize_1x128(xt, of_transpose, mode);
    ASSERT_EQ(std::memcmp(direct.values.ptr<uint8_t>(), of_transpose.values.ptr<uint8_t>(), size_t(C * T)), 0);
    ASSERT_EQ(std::memcmp(direct.scales.ptr<float>(), of_transpose.scales.ptr<float>(), direct.scales.view().nbytes()), 0);

    auto cached = make_quantized_host(T, C, DType::e4m3, ScaleKind::tile_1x128);
    quantize_1x128(x, cached, mode);
    auto requant = make_quantized_host(C, T, DType::e4m3, ScaleKind::tile_1x128);
    requantize_128x1(cached, requant, mode);
    Tensor a = Tensor::host(DType::f32, {C, T}), b = Tensor::host(DType::f32, {C, T});
    dequantize(requant, a);
    dequantize(direct, b);
    double num = 0, den = 0;
    for (int64_t i = 0; i < C * T; ++i) {
      double d = double(a.ptr<float>()[i]) - load_float(xt, i);
      num += d * d;
      den += double(load_float(xt, i)) * load_float(xt, i);
      // Two roundings of at most half an ulp each; the largest e4m3 half ulp is 16 (times scale).
      const int64_t c = i / T, t = i % T;
      float s1 = cached.view().scale_at(t, c), s2 = requant.view().scale_at(c, t);
      EXPECT_LE(std::fabs(d), 16.0 * (s1 + s2) * (1 + 1e-6)) << i;
    }
    EXPECT_LT(std::sqrt(num / den), 0.08);  // e4m3 relative rounding error, twice
  }
}

TEST(Quantize, BadInputRaisesErrorNamingTheArgument) {
  auto q = make_quantized_host(4, 128, DType::e4m3, ScaleKind::tile_1x128);
  Tensor x = Tensor::host(DType::f32, {4, 128});
  x.ptr<float>()[5] = NAN;
  expect_error([&] { quantize_1x128(x, q); }, "x: non-finite value nan at [0, 5]");
  x.ptr<float>()[5] = INFINITY;
  expect_error([&] { quantize_1x128(x, q); }, "non-finite value inf");
  x.ptr<float>()[5] = 0;
  Tensor wrong_shape = Tensor::host(DType::f32, {5, 128});
  expect_error([&] { quantize_1x128(wrong_shape, q); }, "out.values: expected shape [5, 128]");
  Tensor wrong_dtype = Tensor::host(DType::i32, {4, 128});
  expect_error([&] { quantize_1x128(wrong_dtype, q); }, "x: expected dtype f32|bf16");
  TensorView null_x(nullptr, DType::f32, {4, 128});
  expect_error([&] { quantize_1x128(null_x, q); }, "x: null data pointer");
  auto block = make_quantized_host(4, 128, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { quantize_1x128(x, block); }, "out: expected 1x128 scales");
  QuantizedView bad_scales = q;
  bad_scales.scales = TensorView(q.scales.ptr<float>(), DType::f32, {1, 3});
  expect_error([&] { quantize_1x128(x, bad_scales); }, "out.scales: expected shape [1, 4]");
  expect_error([&] { make_quantized_host(4, 128, DType::bf16, ScaleKind::tile_1x128); }, "not an FP8/E5M6 format");
}

TEST(Quantize, TransposedBlocksEqualQuantizingTheTranspose) {
  // The Dgrad GEMM's W^T: transposing W's quantized 128x128 blocks gives bit for bit what
  // quantizing W^T gives, per group of stacked matrices, in both scale modes.
  auto rng = make_rng();
  const int64_t R = 256, C = 384;
  for (int64_t groups : {1, 3})
    for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2}) {
      Tensor w = random_normal(rng, DType::f32, {groups * R, C}, 0.05f);
      w.ptr<float>()[7] = 40.0f;  // one block with a much larger scale
      auto q = make_quantized_host(groups * R, C, DType::e4m3, ScaleKind::block_128x128);
      quantize_128x128(w.view(), q.view(), mode);
      auto got = make_quantized_host(groups * C, R, DType::e4m3, ScaleKind::block_128x128);
      transpose_128x128(q.view(), got.view(), groups);
      Tensor wt = Tensor::host(DType::f32, {groups * C, R});
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < C; ++c) wt.ptr<float>()[(g * C + c) * R + r] = w.ptr<float>()[(g * R + r) * C + c];
      auto want = make_quantized_host(groups * C, R, DType::e4m3, ScaleKind::block_128x128);
      quantize_128x128(wt.view(), want.view(), mode);
      EXPECT_EQ(std::memcmp(got.values.view().data, want.values.view().data, want.values.view().nbytes()), 0)
          << "values, groups " << groups;
      EXPECT_EQ(std::memcmp(got.scales.view().data, want.scales.view().data, want.scales.view().nbytes()), 0)
          << "scales, groups " << groups;
    }
}

TEST(Quantize, TransposeOfBlocksRejectsPartialBlocksAndBadGroups) {
  auto q = make_quantized_host(200, 256, DType::e4m3, ScaleKind::block_128x128);
  auto out = make_quantized_host(256, 200, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { transpose_128x128(q.view(), out.view(), 1); }, "multiples of 128");
  auto q2 = make_quantized_host(384, 128, DType::e4m3, ScaleKind::block_128x128);
  auto out2 = make_quantized_host(256, 192, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { transpose_128x128(q2.view(), out2.view(), 5); }, "divide");
  auto tiles = make_quantized_host(256, 256, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { transpose_128x128(tiles.view(), out.view(), 1); }, "128x128 scales");
}
