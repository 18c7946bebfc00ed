// CUDA quantizers against the CPU quantizers, bit for bit (values and scales), on ragged shapes,
// both input dtypes, both scale modes, e4m3 and e5m2; plus NaN refusal and bad arguments. The
// one-pass quantize_1x128_and_128x1 against the two CPU quantizers it stands for.
// Skips without a GPU. Run: ctest -R test_cuda_quantize (FP8MOE_SEED=<n> replays a seed).
#include <cmath>
#include <cstring>
#include <limits>

#include "cuda_test_util.hpp"
#include "fp8moe/codecs.hpp"

namespace fp8moe::testing {
namespace {

struct Shape {
  int64_t r, c;
};
const Shape kShapes[] = {{1, 1}, {3, 130}, {128, 384}, {257, 1000}, {130, 7168}, {513, 264}, {272, 400}};

// N(0,1) with outliers, an all-zero 128-column group in row 0, and tiny values in row 1.
Tensor make_input(std::mt19937_64& rng, DType dt, int64_t R, int64_t C) {
  Tensor x = random_normal(rng, dt, {R, C});
  std::uniform_int_distribution<int64_t> pick(0, R * C - 1);
  for (int i = 0; i < 4; ++i) store_float(x.view(), pick(rng), 300.0f * (i % 2 ? -1 : 1));
  for (int64_t c = 0; c < std::min<int64_t>(C, 128); ++c) store_float(x.view(), c, 0.0f);
  if (R > 1)
    for (int64_t c = 0; c < C; ++c) store_float(x.view(), C + c, load_float(x.view(), C + c) * 1e-30f);
  return x;
}

void expect_same(const QuantizedTensor& got, const QuantizedTensor& ref, const std::string& what) {
  const int64_t iv = first_mismatch(got.values, ref.values);
  EXPECT_EQ(iv, -1) << what << ": values differ first at element " << iv;
  const int64_t is = first_mismatch(got.scales, ref.scales);
  EXPECT_EQ(is, -1) << what << ": scales differ first at element " << is << " (got "
                    << (is >= 0 ? got.scales.ptr<float>()[is] : 0) << ", want " << (is >= 0 ? ref.scales.ptr<float>()[is] : 0)
                    << ")";
}

class CudaQuantize : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    be_ = make_cuda_backend();
  }
  std::unique_ptr<Backend> be_;
};

TEST_F(CudaQuantize, Rows1x128MatchesCpuBitExact) {
  auto rng = make_rng();
  for (DType in : {DType::bf16, DType::f32})
    for (DType out : {DType::e4m3, DType::e5m2})
      for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2})
        for (const Shape& s : kShapes) {
          Tensor x = make_input(rng, in, s.r, s.c);
          QuantizedTensor ref = make_quantized_host(s.r, s.c, out, ScaleKind::tile_1x128);
          quantize_1x128(x.view(), ref.view(), mode);
          QuantizedTensor q = be_->empty_quantized(s.r, s.c, out, ScaleKind::tile_1x128);
          be_->quantize_1x128(to_device(*be_, x).view(), q.view(), mode);
          expect_same(to_host(*be_, q), ref,
                      "1x128 " + std::string(dtype_name(in)) + "->" + std::string(dtype_name(out)) + " [" +
                          std::to_string(s.r) + ", " + std::to_string(s.c) + "] " + (mode == ScaleMode::pow2 ? "pow2" : "fp32"));
        }
}

// Packed E5M6 (two codes in three bytes): the GPU quantizer's bytes equal the CPU's, on the vector
// paths (C % 8 == 0), the quantizer's only (C % 4 == 0, C % 8 != 0: the dequantizer goes scalar)
// and neither (C = 130, 2: partial pairs of groups), both scale modes; the dequantization of those
// bytes equals the CPU's in f32 and bf16; an odd column count is refused (a pair would span rows).
TEST_F(CudaQuantize, E5M6PackedMatchesCpuBitExact) {
  auto rng = make_rng();
  for (DType in : {DType::bf16, DType::f32})
    for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2})
      for (const Shape& s : {Shape{1, 2}, Shape{3, 130}, Shape{128, 384}, Shape{257, 1000}, Shape{130, 7168},
                             Shape{65, 132}, Shape{513, 264}}) {
        const std::string what = "e5m6 " + std::string(dtype_name(in)) + " [" + std::to_string(s.r) + ", " +
                                 std::to_string(s.c) + "] " + (mode == ScaleMode::pow2 ? "pow2" : "fp32");
        Tensor x = make_input(rng, in, s.r, s.c);
        QuantizedTensor ref = make_quantized_host(s.r, s.c, DType::e5m6, ScaleKind::tile_1x128);
        quantize_1x128(x.view(), ref.view(), mode);
        ASSERT_EQ(ref.values.view().nbytes(), size_t(s.r * s.c * 3 / 2)) << what;
        QuantizedTensor q = be_->empty_quantized(s.r, s.c, DType::e5m6, ScaleKind::tile_1x128);
        be_->quantize_1x128(to_device(*be_, x).view(), q.view(), mode);
        const QuantizedTensor got = to_host(*be_, q);
        EXPECT_TRUE(bytes_equal(got.values, ref.values)) << what << ": packed bytes differ";
        expect_same(got, ref, what);
        for (DType out : {DType::f32, DType::bf16}) {
          Tensor want = Tensor::host(out, {s.r, s.c});
          dequantize(ref.view(), want.view());
          Tensor d = be_->empty(out, {s.r, s.c});
          be_->dequantize(to_device(*be_, ref).view(), d.view());
          EXPECT_TRUE(bytes_equal(be_->to_host(d), want)) << what << " dequantized to " << dtype_name(out);
        }
      }
  Tensor odd = to_device(*be_, make_input(rng, DType::f32, 4, 129));
  QuantizedTensor q = be_->empty_quantized(4, 129, DType::e5m6, ScaleKind::tile_1x128);
  expect_error([&] { be_->quantize_1x128(odd.view(), q.view(), ScaleMode::pow2); }, "even number of columns");
}

TEST_F(CudaQuantize, Blocks128x128MatchesCpuBitExact) {
  auto rng = make_rng();
  for (DType in : {DType::bf16, DType::f32})
    for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2})
      for (const Shape& s : kShapes) {
        Tensor w = make_input(rng, in, s.r, s.c);
        QuantizedTensor ref = make_quantized_host(s.r, s.c, DType::e4m3, ScaleKind::block_128x128);
        quantize_128x128(w.view(), ref.view(), mode);
        QuantizedTensor q = be_->empty_quantized(s.r, s.c, DType::e4m3, ScaleKind::block_128x128);
        be_->quantize_128x128(to_device(*be_, w).view(), q.view(), mode);
        expect_same(to_host(*be_, q), ref, "128x128 [" + std::to_string(s.r) + ", " + std::to_string(s.c) + "]");
      }
}

TEST_F(CudaQuantize, Transposed128x1MatchesCpuBitExact) {
  auto rng = make_rng();
  for (DType in : {DType::bf16, DType::f32})
    for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2})
      for (const Shape& s : kShapes) {
        Tensor x = make_input(rng, in, s.r, s.c);  // [T, C]
        QuantizedTensor ref = make_quantized_host(s.c, s.r, DType::e4m3, ScaleKind::tile_1x128);
        quantize_128x1(x.view(), ref.view(), mode);
        QuantizedTensor q = be_->empty_quantized(s.c, s.r, DType::e4m3, ScaleKind::tile_1x128);
        be_->quantize_128x1(to_device(*be_, x).view(), q.view(), mode);
        expect_same(to_host(*be_, q), ref, "128x1 [" + std::to_string(s.r) + ", " + std::to_string(s.c) + "]");
      }
}

TEST_F(CudaQuantize, Requantize128x1MatchesCpuBitExact) {
  auto rng = make_rng();
  for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2})
    for (const Shape& s : kShapes) {
      Tensor x = make_input(rng, DType::bf16, s.r, s.c);
      QuantizedTensor in = make_quantized_host(s.r, s.c, DType::e4m3, ScaleKind::tile_1x128);
      quantize_1x128(x.view(), in.view(), ScaleMode::fp32);
      QuantizedTensor ref = make_quantized_host(s.c, s.r, DType::e4m3, ScaleKind::tile_1x128);
      requantize_128x1(in.view(), ref.view(), mode);
      QuantizedTensor q = be_->empty_quantized(s.c, s.r, DType::e4m3, ScaleKind::tile_1x128);
      be_->requantize_128x1(to_device(*be_, in).view(), q.view(), mode);
      expect_same(to_host(*be_, q), ref, "requantize [" + std::to_string(s.r) + ", " + std::to_string(s.c) + "]");
    }
}

// Fills a device tensor with 0xFF bytes (NaN scales, NaN/-max values) so unwritten outputs show.
void poison(Backend& be, const Tensor& t) {
  Tensor h = Tensor::host_like(t.view());
  std::memset(h.view().data, 0xFF, h.view().nbytes());
  be.copy(t.view(), h.view());
}

// The requantizer's paths on poisoned outputs: T and C off multiples of 128 (and of 16: the byte
// tail of the output rows), several tiles per CTA, e4m3/e5m2 in and out, both scale modes, and
// input values at an address that is not 16-byte aligned (the fallback kernel).
TEST_F(CudaQuantize, RequantizeRaggedPoisonedMatchesCpuBitExact) {
  auto rng = make_rng();
  const Shape shapes[] = {{1, 16}, {129, 16}, {300, 272}, {1040, 400}, {16, 4096}, {2100, 2064}, {4224, 2064}};
  for (DType in_dt : {DType::e4m3, DType::e5m2})
    for (DType out_dt : {DType::e4m3, DType::e5m2})
      for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2})
        for (const Shape& s : shapes)
          for (bool misaligned : {false, true}) {
            if (s.r * s.c > 1000000 && (in_dt != out_dt || misaligned)) continue;
            const std::string what = "requantize " + std::string(dtype_name(in_dt)) + "->" +
                                     std::string(dtype_name(out_dt)) + " [" + std::to_string(s.r) + ", " +
                                     std::to_string(s.c) + "] " + (mode == ScaleMode::pow2 ? "pow2" : "fp32") +
                                     (misaligned ? " misaligned" : "");
            Tensor x = make_input(rng, DType::f32, s.r, s.c);
            QuantizedTensor in = make_quantized_host(s.r, s.c, in_dt, ScaleKind::tile_1x128);
            quantize_1x128(x.view(), in.view(), mode);
            QuantizedTensor ref = make_quantized_host(s.c, s.r, out_dt, ScaleKind::tile_1x128);
            requantize_128x1(in.view(), ref.view(), mode);
            QuantizedTensor in_d = to_device(*be_, in);
            Tensor shifted = be_->zeros(in_dt, {s.r * s.c + 16});
            QuantizedView in_v = in_d.view();
            if (misaligned) {
              in_v.values.data = static_cast<uint8_t*>(shifted.view().data) + 1;
              be_->copy(in_v.values, in.values.view());
            }
            QuantizedTensor q = be_->empty_quantized(s.c, s.r, out_dt, ScaleKind::tile_1x128);
            poison(*be_, q.values);
            poison(*be_, q.scales);
            be_->requantize_128x1(in_v, q.view(), mode);
            expect_same(to_host(*be_, q), ref, what);
          }
}

std::string shape_name(const Shape& s) { return "[" + std::to_string(s.r) + ", " + std::to_string(s.c) + "]"; }

// x [T, C] -> rows and cols through the op on poisoned outputs, against the CPU's quantize_1x128
// and quantize_128x1. `shift` elements moves x off its 16-byte alignment (the two kernels' path).
void expect_1x128_and_128x1(Backend& be, const Tensor& x, DType rows_dt, DType cols_dt, ScaleMode mode, int64_t shift,
                            const std::string& what) {
  const int64_t T = x.size(0), C = x.size(1);
  QuantizedTensor ref_rows = make_quantized_host(T, C, rows_dt, ScaleKind::tile_1x128);
  QuantizedTensor ref_cols = make_quantized_host(C, T, cols_dt, ScaleKind::tile_1x128);
  quantize_1x128(x.view(), ref_rows.view(), mode);
  quantize_128x1(x.view(), ref_cols.view(), mode);
  Tensor buf = be.zeros(x.dtype(), {T * C + shift});
  const TensorView xd(static_cast<char*>(buf.view().data) + shift * int64_t(dtype_size(x.dtype())), x.dtype(), {T, C},
                      Device::cuda);
  be.copy(xd, x.view());
  QuantizedTensor rows = be.empty_quantized(T, C, rows_dt, ScaleKind::tile_1x128);
  QuantizedTensor cols = be.empty_quantized(C, T, cols_dt, ScaleKind::tile_1x128);
  for (const Tensor* t : {&rows.values, &rows.scales, &cols.values, &cols.scales}) poison(be, *t);
  be.quantize_1x128_and_128x1(xd, rows.view(), cols.view(), mode);
  expect_same(to_host(be, rows), ref_rows, what + " rows");
  expect_same(to_host(be, cols), ref_cols, what + " cols");
}

// T off 128 and off 16 (the byte tail of the transposed rows), C off 128 (136: the fused kernel's
// partial channel block; 130: not a whole number of 16-byte vectors, the two kernels; 272 x 400 and
// 1040 x 144: T a multiple of 16, partial tiles on the 16-byte store path), many token blocks;
// both input dtypes, both scale modes, e4m3 and e5m2; an all-zero channel (a zero 128x1 tile,
// scale 1) besides make_input's zero 1x128 tile, tiny row and outliers.
TEST_F(CudaQuantize, Quantize1x128And128x1MatchesCpuBitExact) {
  auto rng = make_rng();
  const Shape shapes[] = {{1, 128}, {200, 128}, {200, 136}, {384, 136}, {384, 7168}, {8192, 128},
                          {8192, 256}, {272, 400}, {1040, 144}, {3, 130}, {257, 130}};
  for (DType in : {DType::bf16, DType::f32})
    for (DType out : {DType::e4m3, DType::e5m2})
      for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2})
        for (const Shape& s : shapes) {
          Tensor x = make_input(rng, in, s.r, s.c);
          for (int64_t t = 0; t < s.r; ++t) store_float(x.view(), t * s.c + s.c - 1, 0.0f);
          expect_1x128_and_128x1(*be_, x, out, out, mode, 0,
                                 std::string(dtype_name(in)) + "->" + std::string(dtype_name(out)) + " " +
                                     shape_name(s) + (mode == ScaleMode::pow2 ? " pow2" : " fp32"));
        }
}

// The shapes and dtypes the fused kernel leaves to the two kernels: x not 16-byte aligned, rows and
// cols in different dtypes, E5M6 rows (the 1x128 quantizer's own kernel).
TEST_F(CudaQuantize, Quantize1x128And128x1FallbacksMatchCpuBitExact) {
  auto rng = make_rng();
  for (const Shape& s : {Shape{200, 136}, Shape{384, 256}})
    for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2}) {
      const std::string what = shape_name(s) + (mode == ScaleMode::pow2 ? " pow2" : " fp32");
      Tensor xb = make_input(rng, DType::bf16, s.r, s.c), xf = make_input(rng, DType::f32, s.r, s.c);
      expect_1x128_and_128x1(*be_, xb, DType::e4m3, DType::e4m3, mode, 1, "misaligned bf16 " + what);
      expect_1x128_and_128x1(*be_, xf, DType::e4m3, DType::e4m3, mode, 2, "misaligned f32 " + what);
      expect_1x128_and_128x1(*be_, xf, DType::e5m2, DType::e4m3, mode, 0, "e5m2 rows, e4m3 cols " + what);
      expect_1x128_and_128x1(*be_, xb, DType::e5m6, DType::e4m3, mode, 0, "e5m6 rows " + what);
    }
}

// NaN/Inf anywhere (first, middle, last element: the tails of both layouts) is refused as
// quantize_128x1 refuses it, on the fused kernel's shapes and on the two kernels' (C = 130); the
// flag does not stick; deferred checks raise at the next synchronize.
TEST_F(CudaQuantize, Quantize1x128And128x1RefusesNonFiniteInput) {
  auto rng = make_rng();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (DType in : {DType::f32, DType::bf16})
    for (const Shape& s : {Shape{64, 256}, Shape{200, 136}, Shape{200, 130}})
      for (float bad : {nan, inf, -inf})
        for (int64_t at : {int64_t(0), s.r / 2 * s.c + s.c / 2, s.r * s.c - 1}) {
          Tensor x = random_normal(rng, in, {s.r, s.c});
          store_float(x.view(), at, bad);
          const Tensor xd = to_device(*be_, x);
          QuantizedTensor rows = be_->empty_quantized(s.r, s.c, DType::e4m3, ScaleKind::tile_1x128);
          QuantizedTensor cols = be_->empty_quantized(s.c, s.r, DType::e4m3, ScaleKind::tile_1x128);
          const std::string what = std::string(dtype_name(in)) + " " + shape_name(s) + " " + std::to_string(bad) +
                                   " at " + std::to_string(at);
          EXPECT_THROW(be_->quantize_128x1(xd.view(), cols.view(), ScaleMode::fp32), Error) << what;
          EXPECT_THROW(be_->quantize_1x128_and_128x1(xd.view(), rows.view(), cols.view(), ScaleMode::fp32), Error)
              << what;
        }
  Tensor x = random_normal(rng, DType::f32, {200, 136});
  QuantizedTensor rows = be_->empty_quantized(200, 136, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor cols = be_->empty_quantized(136, 200, DType::e4m3, ScaleKind::tile_1x128);
  EXPECT_NO_THROW(be_->quantize_1x128_and_128x1(to_device(*be_, x).view(), rows.view(), cols.view(), ScaleMode::fp32));
  x.ptr<float>()[7] = nan;
  const Tensor xd = to_device(*be_, x);
  be_->set_checks(Backend::Checks::deferred);
  EXPECT_NO_THROW(be_->quantize_1x128_and_128x1(xd.view(), rows.view(), cols.view(), ScaleMode::fp32));
  expect_error([&] { be_->synchronize(); }, "non-finite");
  EXPECT_NO_THROW(be_->synchronize());
  be_->set_checks(Backend::Checks::immediate);
}

TEST_F(CudaQuantize, DequantizeMatchesCpu) {
  auto rng = make_rng();
  for (ScaleKind kind : {ScaleKind::tile_1x128, ScaleKind::block_128x128})
    for (DType out : {DType::f32, DType::bf16}) {
      Tensor x = make_input(rng, DType::f32, 257, 1000);
      QuantizedTensor q = make_quantized_host(257, 1000, DType::e4m3, kind);
      if (kind == ScaleKind::tile_1x128) quantize_1x128(x.view(), q.view());
      else quantize_128x128(x.view(), q.view());
      Tensor ref = Tensor::host(out, {257, 1000});
      dequantize(q.view(), ref.view());
      Tensor d = be_->zeros(out, {257, 1000});
      be_->dequantize(to_device(*be_, q).view(), d.view());
      EXPECT_EQ(first_mismatch(be_->to_host(d), ref), -1);
    }
}

TEST_F(CudaQuantize, RefusesNonFiniteInput) {
  auto rng = make_rng();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    Tensor x = random_normal(rng, DType::f32, {64, 256});
    x.ptr<float>()[1234] = bad;
    Tensor xd = to_device(*be_, x);
    QuantizedTensor q = be_->empty_quantized(64, 256, DType::e4m3, ScaleKind::tile_1x128);
    EXPECT_THROW(be_->quantize_1x128(xd.view(), q.view(), ScaleMode::fp32), Error);
    QuantizedTensor qt = be_->empty_quantized(256, 64, DType::e4m3, ScaleKind::tile_1x128);
    EXPECT_THROW(be_->quantize_128x1(xd.view(), qt.view(), ScaleMode::fp32), Error);
    QuantizedTensor qw = be_->empty_quantized(64, 256, DType::e4m3, ScaleKind::block_128x128);
    EXPECT_THROW(be_->quantize_128x128(xd.view(), qw.view(), ScaleMode::fp32), Error);
  }
}

TEST_F(CudaQuantize, RejectsBadArguments) {
  Tensor x = be_->zeros(DType::bf16, {64, 256});
  // Wrong scale shape.
  QuantizedTensor q = be_->empty_quantized(64, 256, DType::e4m3, ScaleKind::tile_1x128);
  Tensor wrong = be_->zeros(DType::f32, {2, 63});
  EXPECT_THROW(be_->quantize_1x128(x.view(), {q.values.view(), wrong.view(), ScaleKind::tile_1x128}, ScaleMode::fp32), Error);
  // Wrong scale kind, wrong values shape, host input.
  QuantizedTensor qb = be_->empty_quantized(64, 256, DType::e4m3, ScaleKind::block_128x128);
  EXPECT_THROW(be_->quantize_1x128(x.view(), qb.view(), ScaleMode::fp32), Error);
  QuantizedTensor q2 = be_->empty_quantized(64, 128, DType::e4m3, ScaleKind::tile_1x128);
  EXPECT_THROW(be_->quantize_1x128(x.view(), q2.view(), ScaleMode::fp32), Error);
  Tensor xh = Tensor::host(DType::bf16, {64, 256});
  EXPECT_THROW(be_->quantize_1x128(xh.view(), q.view(), ScaleMode::fp32), Error);
  // e5m6 (the attention-out cache) comes only with 1x128 tiles.
  QuantizedTensor q56 = be_->empty_quantized(64, 256, DType::e5m6, ScaleKind::block_128x128);
  EXPECT_THROW(be_->quantize_1x128(x.view(), q56.view(), ScaleMode::fp32), Error);
}

}  // namespace
}  // namespace fp8moe::testing
