// Every op x every available backend against the CPU backend (the specification), on shapes that
// are not multiples of the tiles, with outputs poisoned before the run. Quantizers must match
// bit for bit; GEMMs within FP32 accumulation-order rounding. A backend that does not support an op
// reports it and is skipped for that op. Filter with --gtest_filter=*cuda*, *gemm_fp8*, ...
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "fp8moe/backend.hpp"
#include "testing.hpp"

using namespace fp8moe;
using namespace fp8moe::testing;

namespace {

struct Case {
  std::string backend;
  Op op;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.backend << "/" << op_name(c.op); }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const std::string& b : available_backends())
    for (Op op : {Op::quantize_1x128, Op::quantize_128x128, Op::quantize_128x1, Op::requantize_128x1,
                  Op::transpose_128x128, Op::dequantize, Op::gemm_fp8, Op::gemm_bf16})  // the model ops: tests/model and tests/cuda/test_cuda_model_ops.cpp
      cases.push_back({b, op});
  return cases;
}

// Host tensor -> a tensor on `be` (same bytes).
Tensor upload(Backend& be, const Tensor& host) {
  if (be.device() == Device::cpu) return host;
  const TensorView& v = host.view();
  Tensor t = v.ndim == 2 ? be.empty(v.dtype, {v.shape[0], v.shape[1]}) : be.empty(v.dtype, {v.shape[0]});
  be.copy(t.view(), v);
  return t;
}

QuantizedTensor upload(Backend& be, const QuantizedTensor& q) { return {upload(be, q.values), upload(be, q.scales), q.kind}; }

// Fills device memory of `t` with NaN-like bytes so unwritten elements are caught.
void poison(Backend& be, const Tensor& t) {
  Tensor h = Tensor::host_like(t.view());
  std::memset(h.view().data, 0xFF, h.view().nbytes());
  be.copy(t.view(), h.view());
}

void expect_same_bytes(Backend& be, const Tensor& got, const Tensor& want, const char* what) {
  Tensor h = be.to_host(got);
  ASSERT_EQ(h.view().nbytes(), want.view().nbytes());
  const auto* g = static_cast<const uint8_t*>(h.view().data);
  const auto* w = static_cast<const uint8_t*>(want.view().data);
  int64_t bad = 0;
  for (size_t i = 0; i < want.view().nbytes(); ++i)
    if (g[i] != w[i] && ++bad < 5) ADD_FAILURE() << what << ": byte " << i << " got " << int(g[i]) << " want " << int(w[i]);
  EXPECT_EQ(bad, 0) << what;
}

class BackendOps : public ::testing::TestWithParam<Case> {};

TEST_P(BackendOps, MatchesCpu) {
  const Case& c = GetParam();
  auto be = make_backend(c.backend);
  auto cpu = make_backend("cpu");
  if (!be->supports(c.op)) GTEST_SKIP() << c.backend << " does not support " << op_name(c.op);
  auto rng = make_rng();
  const int64_t M = 200, N = 136, K = 384;
  Tensor x = random_normal(rng, DType::bf16, {M, K}, 2.0f);
  Tensor w = random_normal(rng, DType::bf16, {N, K}, 0.05f);
  for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2}) {
    switch (c.op) {
      case Op::quantize_1x128:
      case Op::quantize_128x1: {
        const bool t = c.op == Op::quantize_128x1;
        // E5M6 (the attention-out cache, power-of-two scales) through the 1x128 quantizer.
        const DType qt = !t && mode == ScaleMode::pow2 ? DType::e5m6 : DType::e4m3;
        auto want = make_quantized_host(t ? K : M, t ? M : K, qt, ScaleKind::tile_1x128);
        auto got = be->empty_quantized(t ? K : M, t ? M : K, qt, ScaleKind::tile_1x128);
        poison(*be, got.values);
        poison(*be, got.scales);
        Tensor dx = upload(*be, x);
        if (t) {
          cpu->quantize_128x1(x, want, mode);
          be->quantize_128x1(dx, got, mode);
        } else {
          cpu->quantize_1x128(x, want, mode);
          be->quantize_1x128(dx, got, mode);
        }
        expect_same_bytes(*be, got.values, want.values, "values");
        expect_same_bytes(*be, got.scales, want.scales, "scales");
        break;
      }
      case Op::quantize_128x128: {
        auto want = make_quantized_host(N, K, DType::e4m3, ScaleKind::block_128x128);
        auto got = be->empty_quantized(N, K, DType::e4m3, ScaleKind::block_128x128);
        poison(*be, got.values);
        cpu->quantize_128x128(w, want, mode);
        be->quantize_128x128(upload(*be, w), got, mode);
        expect_same_bytes(*be, got.values, want.values, "values");
        expect_same_bytes(*be, got.scales, want.scales, "scales");
        break;
      }
      case Op::requantize_128x1: {
        auto cached = make_quantized_host(M, K, DType::e4m3, ScaleKind::tile_1x128);
        cpu->quantize_1x128(x, cached, mode);
        auto want = make_quantized_host(K, M, DType::e4m3, ScaleKind::tile_1x128);
        auto got = be->empty_quantized(K, M, DType::e4m3, ScaleKind::tile_1x128);
        poison(*be, got.values);
        cpu->requantize_128x1(cached, want, mode);
        be->requantize_128x1(upload(*be, cached), got, mode);
        expect_same_bytes(*be, got.values, want.values, "values");
        expect_same_bytes(*be, got.scales, want.scales, "scales");
        break;
      }
      case Op::transpose_128x128: {  // two stacked [256, 384] matrices
        const int64_t G = 2, R = 256, C = 384;
        Tensor ws = random_normal(rng, DType::bf16, {G * R, C}, 0.05f);
        auto q = make_quantized_host(G * R, C, DType::e4m3, ScaleKind::block_128x128);
        cpu->quantize_128x128(ws, q, mode);
        auto want = make_quantized_host(G * C, R, DType::e4m3, ScaleKind::block_128x128);
        auto got = be->empty_quantized(G * C, R, DType::e4m3, ScaleKind::block_128x128);
        poison(*be, got.values);
        poison(*be, got.scales);
        cpu->transpose_128x128(q, want, G);
        be->transpose_128x128(upload(*be, q), got, G);
        expect_same_bytes(*be, got.values, want.values, "values");
        expect_same_bytes(*be, got.scales, want.scales, "scales");
        break;
      }
      case Op::dequantize: {
        auto q = make_quantized_host(M, K, mode == ScaleMode::pow2 ? DType::e5m6 : DType::e4m3, ScaleKind::tile_1x128);
        cpu->quantize_1x128(x, q, mode);
        Tensor want = Tensor::host(DType::f32, {M, K});
        Tensor got = be->empty(DType::f32, {M, K});
        poison(*be, got);
        cpu->dequantize(q, want);
        be->dequantize(upload(*be, q), got);
        expect_same_bytes(*be, got, want, "dequantized");
        break;
      }
      case Op::gemm_fp8: {
        auto qa = make_quantized_host(M, K, DType::e4m3, ScaleKind::tile_1x128);
        auto qb = make_quantized_host(N, K, DType::e4m3, ScaleKind::block_128x128);
        cpu->quantize_1x128(x, qa, mode);
        cpu->quantize_128x128(w, qb, mode);
        for (DType out : {DType::f32, DType::bf16}) {
          Tensor want = Tensor::host(out, {M, N});
          Tensor got = be->empty(out, {M, N});
          poison(*be, got);
          cpu->gemm_fp8(qa, qb, want, {});
          be->gemm_fp8(upload(*be, qa), upload(*be, qb), got, {});
          std::vector<double> g = to_doubles(be->to_host(got)), wv = to_doubles(want);
          for (double v : g) ASSERT_TRUE(std::isfinite(v)) << "unwritten or non-finite output";
          // The CPU sums each 128-wide K block in FP32; Tensor Cores keep fewer bits inside a block
          // (about 1e-4 relative on random data), so a GPU is held to that.
          const double tol = be->device() == Device::cpu ? 1e-5 : 5e-4;
          EXPECT_LT(rel_error(g, wv), out == DType::f32 ? tol : 8e-3) << dtype_name(out);
        }
        break;
      }
      case Op::gemm_bf16: {
        Tensor want = Tensor::host(DType::f32, {M, N});
        Tensor got = be->empty(DType::f32, {M, N});
        poison(*be, got);
        cpu->gemm_bf16(x, w, want, false);
        be->gemm_bf16(upload(*be, x), upload(*be, w), got, false);
        std::vector<double> g = to_doubles(be->to_host(got)), wv = to_doubles(want);
        for (double v : g) ASSERT_TRUE(std::isfinite(v));
        EXPECT_LT(rel_error(g, wv), 1e-5);
        return;  // no scale mode
      }
      default:
        GTEST_SKIP() << op_name(c.op) << " is covered by the model-op tests";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, BackendOps, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.backend + "_" + std::string(op_name(info.param.op));
                         });

TEST(Backends, RegistryAndErrors) {
  auto names = available_backends();
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.front(), "cpu");
  EXPECT_EQ(make_backend("cpu")->name(), "cpu");
  try {
    make_backend("tpu");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown or unavailable backend 'tpu'"), std::string::npos) << e.what();
  }
}

}  // namespace
