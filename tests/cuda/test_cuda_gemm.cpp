// The sm_90a FP8 GEMM (and the cuBLASLt path) tested three ways:
//   1. small-integer inputs with power-of-two scales: every product and sum is exact, so D must
//      equal the CPU reference bit for bit, for every compiled tile shape (layout bugs show here);
//   2. random inputs against the CPU reference on the same quantized inputs (kernel error, FP32
//      rounding level) and against the unquantized FP64 product (calc_diff < 1e-3, recipe error);
//   3. outputs poisoned with NaN, a padded row stride with sentinels, accumulation into D, and
//      bad arguments. Skips without a Hopper GPU.
#include <cmath>
#include <limits>

#include "cuda_test_util.hpp"
#include "fp8moe/codecs.hpp"

namespace fp8moe::testing {
namespace {

// A device D [M, N] view over a buffer with row stride N + pad, pad columns set to a sentinel.
struct PaddedD {
  Tensor buf;
  TensorView view;
  int64_t M, N, ld;
  PaddedD(Backend& be, DType dt, int64_t m, int64_t n, int64_t pad) : M(m), N(n), ld(n + pad) {
    Tensor h = Tensor::host(dt, {M, ld});
    for (int64_t i = 0; i < M * ld; ++i)
      store_float(h.view(), i, (i % ld) < N ? std::numeric_limits<float>::quiet_NaN() : 1024.0f);
    buf = to_device(be, h);
    view = buf.view();
    view.shape[1] = N;
    view.strides[0] = ld;
  }
  // D as a dense host tensor; checks the pad sentinels.
  Tensor fetch(Backend& be, bool& pads_ok) const {
    Tensor h = be.to_host(buf);
    Tensor out = Tensor::host(buf.dtype(), {M, N});
    pads_ok = true;
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < ld; ++c) {
        const float v = load_float(h.view(), r * ld + c);
        if (c < N) store_float(out.view(), r * N + c, v);
        else if (v != 1024.0f) pads_ok = false;
      }
    return out;
  }
};

class CudaGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    if (!cuda::sm90_available()) GTEST_SKIP() << "needs a Hopper (sm_90) GPU";
    be_ = make_cuda_backend();
  }
  std::unique_ptr<Backend> be_;
};

struct Case {
  int64_t M, N, K;
};

TEST_F(CudaGemm, SmallIntegersExactForEveryTile) {
  auto rng = make_rng();
  const Case cases[] = {{128, 128, 128}, {200, 136, 384}, {64, 16, 256}, {1, 40, 128}, {300, 520, 1024}, {129, 250, 256}, {256, 704, 512}};
  for (bool b_1x128 : {false, true}) {
    const ScaleKind bkind = b_1x128 ? ScaleKind::tile_1x128 : ScaleKind::block_128x128;
    for (const Case& c : cases) {
      QuantizedTensor a = small_int_quantized(rng, c.M, c.K, ScaleKind::tile_1x128);
      QuantizedTensor b = small_int_quantized(rng, c.N, c.K, bkind);
      QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
      for (DType dt : {DType::f32, DType::bf16}) {
        Tensor ref = Tensor::host(dt, {c.M, c.N});
        gemm_fp8_ref(a.view(), b.view(), ref.view());
        for (const cuda::GemmTile& t : cuda::gemm_tiles(b_1x128)) {
          PaddedD d(*be_, dt, c.M, c.N, 8);
          cuda::gemm_fp8_sm90(ad.view(), bd.view(), d.view, false, nullptr, &t);
          be_->synchronize();
          bool pads_ok = false;
          Tensor got = d.fetch(*be_, pads_ok);
          const int64_t mis = first_mismatch(got, ref);
          EXPECT_EQ(mis, -1) << (b_1x128 ? "1d1d" : "1d2d") << " tile " << t.block_m << "x" << t.block_n
                             << (t.tma_epilogue ? " tma-epilogue" : " direct-epilogue") << " multicast " << t.multicast
                             << (t.pipelined ? " pipelined" : "") << " M=" << c.M
                             << " N=" << c.N << " K=" << c.K << " " << dtype_name(dt) << ": first mismatch at ["
                             << (mis >= 0 ? mis / c.N : 0) << ", " << (mis >= 0 ? mis % c.N : 0) << "] got "
                             << (mis >= 0 ? load_float(got.view(), mis) : 0) << " want "
                             << (mis >= 0 ? load_float(ref.view(), mis) : 0);
          EXPECT_TRUE(pads_ok) << "write past N (row padding changed), tile " << t.block_m << "x" << t.block_n
                               << " multicast " << t.multicast;
        }
      }
    }
  }
}

TEST_F(CudaGemm, RandomAgainstReferenceAndFp64) {
  auto rng = make_rng();
  const Case cases[] = {{256, 512, 1024}, {77, 264, 640}, {1000, 136, 2048}, {64, 2112, 7168}};
  for (bool b_1x128 : {false, true})
    for (const Case& c : cases) {
      const ScaleKind bkind = b_1x128 ? ScaleKind::tile_1x128 : ScaleKind::block_128x128;
      Tensor a32 = random_normal(rng, DType::f32, {c.M, c.K});
      Tensor b32 = random_normal(rng, DType::f32, {c.N, c.K});
      QuantizedTensor a = make_quantized_host(c.M, c.K, DType::e4m3, ScaleKind::tile_1x128);
      QuantizedTensor b = make_quantized_host(c.N, c.K, DType::e4m3, bkind);
      quantize_1x128(a32.view(), a.view());
      if (b_1x128) quantize_1x128(b32.view(), b.view());
      else quantize_128x128(b32.view(), b.view());
      Tensor ref = Tensor::host(DType::f32, {c.M, c.N});
      gemm_fp8_ref(a.view(), b.view(), ref.view());
      // The hardware's view: Tensor Core accumulation inside each 128-block (emulated, 14 bits).
      Tensor ref_tc = Tensor::host(DType::f32, {c.M, c.N});
      GemmOptions tc;
      tc.accum.mode = AccumMode::tensor_core;
      gemm_fp8_ref(a.view(), b.view(), ref_tc.view(), tc);
      Tensor exact = Tensor::host(DType::f32, {c.M, c.N});
      gemm_ref(a32.view(), b32.view(), exact.view());

      QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
      PaddedD d(*be_, DType::f32, c.M, c.N, 4);
      be_->gemm_fp8(ad.view(), bd.view(), d.view, {});
      bool pads_ok = false;
      Tensor got = d.fetch(*be_, pads_ok);
      EXPECT_TRUE(pads_ok);
      const auto g = to_doubles(got.view()), r = to_doubles(ref.view()), x = to_doubles(exact.view());
      for (double v : g) ASSERT_TRUE(std::isfinite(v)) << "NaN/Inf in D (unwritten or overflowed)";
      const double kerr = rel_error(g, r), kerr_tc = rel_error(g, to_doubles(ref_tc.view())), cd = calc_diff(g, x);
      // NOTES: the Tensor Cores keep a limited-precision sum inside each 128-block (report §3.3.2),
      // so against ideal FP32 promotion the error is above FP32 rounding; it is bounded here and
      // printed, together with the distance to the emulated Tensor Core accumulation.
      EXPECT_LT(kerr, 1e-3) << "kernel error vs CPU reference, M=" << c.M << " N=" << c.N << " K=" << c.K;
      EXPECT_LT(cd, 1e-3) << "calc_diff vs unquantized product, M=" << c.M << " N=" << c.N << " K=" << c.K;
      std::cout << "[ info     ] " << (b_1x128 ? "1d1d" : "1d2d") << " M=" << c.M << " N=" << c.N << " K=" << c.K
                << " rel err vs fp32-promotion ref " << kerr << ", vs tensor-core emulation " << kerr_tc
                << ", calc_diff vs unquantized " << cd << "\n";
    }
}

TEST_F(CudaGemm, AccumulatesIntoF32) {
  auto rng = make_rng();
  for (bool b_1x128 : {false, true}) {
    const int64_t M = 300, N = 264, K = 512;
    const ScaleKind bkind = b_1x128 ? ScaleKind::tile_1x128 : ScaleKind::block_128x128;
    QuantizedTensor a = small_int_quantized(rng, M, K, ScaleKind::tile_1x128);
    QuantizedTensor b = small_int_quantized(rng, N, K, bkind);
    Tensor c0 = Tensor::host(DType::f32, {M, N});
    std::uniform_int_distribution<int> v(-100, 100);
    for (int64_t i = 0; i < M * N; ++i) c0.ptr<float>()[i] = float(v(rng));
    Tensor ref = Tensor::host(DType::f32, {M, N});
    std::memcpy(ref.ptr<float>(), c0.ptr<float>(), size_t(M * N) * 4);
    GemmOptions acc_opt;
    acc_opt.accumulate = true;
    gemm_fp8_ref(a.view(), b.view(), ref.view(), acc_opt);
    Tensor d = to_device(*be_, c0);
    be_->gemm_fp8(to_device(*be_, a).view(), to_device(*be_, b).view(), d.view(), acc_opt);
    EXPECT_EQ(first_mismatch(be_->to_host(d), ref), -1) << (b_1x128 ? "1d1d" : "1d2d");
  }
}

TEST_F(CudaGemm, CublasLtAgrees) {
  auto rng = make_rng();
  auto lt = make_cublaslt_backend();
  for (bool b_1x128 : {false, true}) {
    const int64_t M = 256, N = 384, K = 1024;
    const ScaleKind bkind = b_1x128 ? ScaleKind::tile_1x128 : ScaleKind::block_128x128;
    Tensor a32 = random_normal(rng, DType::f32, {M, K}), b32 = random_normal(rng, DType::f32, {N, K});
    QuantizedTensor a = make_quantized_host(M, K, DType::e4m3, ScaleKind::tile_1x128);
    QuantizedTensor b = make_quantized_host(N, K, DType::e4m3, bkind);
    quantize_1x128(a32.view(), a.view());
    if (b_1x128) quantize_1x128(b32.view(), b.view());
    else quantize_128x128(b32.view(), b.view());
    Tensor ref = Tensor::host(DType::f32, {M, N});
    gemm_fp8_ref(a.view(), b.view(), ref.view());
    QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
    Tensor d = be_->empty(DType::f32, {M, N});
    try {
      lt->gemm_fp8(ad.view(), bd.view(), d.view(), {});
    } catch (const Error& e) {
      GTEST_SKIP() << "cuBLASLt block-scaled FP8 unavailable: " << e.what();
    }
    const double err = rel_error(to_doubles(lt->to_host(d).view()), to_doubles(ref.view()));
    std::cout << "[ info     ] cuBLASLt rel err vs fp32-promotion ref " << err << "\n";
    EXPECT_LT(err, 1e-3) << "cuBLASLt " << (b_1x128 ? "VEC128 x VEC128" : "VEC128 x BLK128x128") << " vs reference";
  }
}

TEST_F(CudaGemm, Bf16MatchesReference) {
  auto rng = make_rng();
  const int64_t M = 200, N = 136, K = 320;
  Tensor a = random_normal(rng, DType::bf16, {M, K}), b = random_normal(rng, DType::bf16, {N, K});
  Tensor ref = Tensor::host(DType::f32, {M, N});
  gemm_ref(a.view(), b.view(), ref.view());
  Tensor d = be_->empty(DType::f32, {M, N});
  be_->gemm_bf16(to_device(*be_, a).view(), to_device(*be_, b).view(), d.view(), false);
  EXPECT_LT(rel_error(to_doubles(be_->to_host(d).view()), to_doubles(ref.view())), 1e-5);
}

TEST_F(CudaGemm, RejectsBadArguments) {
  QuantizedTensor a = be_->empty_quantized(64, 256, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor b = be_->empty_quantized(128, 256, DType::e4m3, ScaleKind::block_128x128);
  Tensor d = be_->empty(DType::bf16, {64, 128});
  // K not a multiple of 128.
  QuantizedTensor a100 = be_->empty_quantized(64, 100, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor b100 = be_->empty_quantized(128, 100, DType::e4m3, ScaleKind::block_128x128);
  EXPECT_THROW(be_->gemm_fp8(a100.view(), b100.view(), d.view(), {}), Error);
  // Mismatched K.
  QuantizedTensor b384 = be_->empty_quantized(128, 384, DType::e4m3, ScaleKind::block_128x128);
  EXPECT_THROW(be_->gemm_fp8(a.view(), b384.view(), d.view(), {}), Error);
  // Wrong D shape; accumulate into bf16.
  Tensor d_bad = be_->empty(DType::bf16, {64, 120});
  EXPECT_THROW(be_->gemm_fp8(a.view(), b.view(), d_bad.view(), {}), Error);
  GemmOptions acc;
  acc.accumulate = true;
  EXPECT_THROW(be_->gemm_fp8(a.view(), b.view(), d.view(), acc), Error);
  // Wrong scale shape of A; A with 128x128 scales.
  Tensor s_bad = be_->empty(DType::f32, {2, 60});
  EXPECT_THROW(be_->gemm_fp8({a.values.view(), s_bad.view(), ScaleKind::tile_1x128}, b.view(), d.view(), {}), Error);
  QuantizedTensor a_blk = be_->empty_quantized(64, 256, DType::e4m3, ScaleKind::block_128x128);
  EXPECT_THROW(be_->gemm_fp8(a_blk.view(), b.view(), d.view(), {}), Error);
  // Misaligned A pointer (one byte in), through the kernel entry point.
  Tensor big = be_->empty(DType::e4m3, {1, 64 * 256 + 16});
  TensorView mis(static_cast<uint8_t*>(big.view().data) + 1, DType::e4m3, {64, 256}, Device::cuda);
  EXPECT_THROW(cuda::gemm_fp8_sm90({mis, a.scales.view(), ScaleKind::tile_1x128}, b.view(), d.view(), false, nullptr),
               Error);
  // Host tensors; a promotion interval that is no multiple of 32 (no kernel, emulated or not).
  QuantizedTensor ah = make_quantized_host(64, 256, DType::e4m3, ScaleKind::tile_1x128);
  EXPECT_THROW(be_->gemm_fp8(ah.view(), b.view(), d.view(), {}), Error);
  GemmOptions odd;
  odd.accum.mode = AccumMode::tensor_core;
  odd.accum.promote_every = 48;
  EXPECT_THROW(be_->gemm_fp8(a.view(), b.view(), d.view(), odd), Error);
}

}  // namespace
}  // namespace fp8moe::testing
