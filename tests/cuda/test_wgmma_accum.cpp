// The hardware accumulation probe (src/cuda/emulation/wgmma_accum.cu, cuda::wgmma_accumulate):
//   1. exact where no accumulator can round: e4m3 values in {-1, 0, 1}, K <= 1024 (every partial
//      sum an integer below 2^11), every promotion interval: the plumbing (the 128-byte swizzle,
//      descriptors, fragment layout, promotion points) against the integer product;
//   2. the same operands through the emulation (gemm_fp8_emulated, unit scales) agree with it;
//   3. N(0,1) operands never promoted (docs/ACCURACY.md, "On the hardware"): of the emulated widths
//      13, 14 and 15, 14 is bit-identical to the hardware on the most outputs, on most of them;
//   4. bad arguments: shapes off the 64 x 128 grid, K not a multiple of 128, N_c not a multiple
//      of 32, wrong dtypes, each with an error that names it.
// Skips without a Hopper GPU.
#include <string>
#include <vector>

#include "cuda_test_util.hpp"

namespace fp8moe::testing {
namespace {

using WgmmaAccum = Sm90Test;

TEST_F(WgmmaAccum, ExactOnTernaryValuesAtEveryPromotionInterval) {
  auto rng = make_rng();
  struct Case {
    int64_t M, N, K;
  };
  for (const Case c : {Case{64, 128, 128}, Case{128, 256, 512}, Case{192, 128, 1024}}) {
    const Tensor a = ternary_e4m3(rng, c.M, c.K), b = ternary_e4m3(rng, c.N, c.K);
    std::vector<float> want(size_t(c.M * c.N));
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t n = 0; n < c.N; ++n) {
        int sum = 0;
        for (int64_t k = 0; k < c.K; ++k)
          sum += int(e4m3_decode(a.ptr<uint8_t>()[m * c.K + k])) * int(e4m3_decode(b.ptr<uint8_t>()[n * c.K + k]));
        want[size_t(m * c.N + n)] = float(sum);
      }
    const Tensor ad = to_device(*be_, a), bd = to_device(*be_, b);
    for (int nc : {0, 32, 64, 128, 256}) {
      if (nc > c.K) continue;
      Tensor d = be_->zeros(DType::f32, {c.M, c.N});
      cuda::wgmma_accumulate(ad.view(), bd.view(), d.view(), nc, nullptr);
      const Tensor got = be_->to_host(d);
      int64_t bad = -1;
      for (int64_t i = 0; i < c.M * c.N && bad < 0; ++i)
        if (got.ptr<float>()[i] != want[size_t(i)]) bad = i;
      EXPECT_EQ(bad, -1) << c.M << "x" << c.N << "x" << c.K << " N_c=" << nc << ": first mismatch at " << bad
                         << " got " << (bad >= 0 ? got.ptr<float>()[bad] : 0.0f) << " want "
                         << (bad >= 0 ? want[size_t(bad)] : 0.0f);
    }
  }
}

TEST_F(WgmmaAccum, EmulationAgreesOnTernaryValues) {
  auto rng = make_rng();
  const int64_t M = 128, N = 128, K = 512;
  QuantizedTensor a = make_quantized_host(M, K, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor b = make_quantized_host(N, K, DType::e4m3, ScaleKind::block_128x128);
  a.values = ternary_e4m3(rng, M, K);
  b.values = ternary_e4m3(rng, N, K);
  for (QuantizedTensor* q : {&a, &b})
    for (int64_t i = 0; i < q->scales.numel(); ++i) q->scales.ptr<float>()[i] = 1.0f;
  const QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
  Tensor hw = be_->zeros(DType::f32, {M, N}), emu = be_->zeros(DType::f32, {M, N});
  for (int nc : {0, 128}) {
    cuda::wgmma_accumulate(ad.values.view(), bd.values.view(), hw.view(), nc, nullptr);
    GemmOptions opt;
    opt.accum = {AccumMode::tensor_core, 14, nc};
    cuda::gemm_fp8_emulated(ad.view(), bd.view(), emu.view(), opt, nullptr);
    EXPECT_TRUE(bytes_equal(be_->to_host(hw), be_->to_host(emu))) << "N_c=" << nc;
  }
}

TEST_F(WgmmaAccum, NeverPromotedMatchesTheFourteenBitEmulationMost) {
  auto rng = make_rng();
  const int64_t M = 128, N = 128, K = 1024;
  const auto [a, b] = cuda::wgmma_accumulate_operands(M, N, K, rng);
  const QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
  Tensor d = be_->zeros(DType::f32, {M, N});
  cuda::wgmma_accumulate(ad.values.view(), bd.values.view(), d.view(), 0, nullptr);
  const Tensor hw = be_->to_host(d);
  int64_t same[3] = {0, 0, 0};
  for (int bits : {13, 14, 15}) {
    GemmOptions opt;
    opt.accum = {AccumMode::tensor_core, bits, 0};
    cuda::gemm_fp8_emulated(ad.view(), bd.view(), d.view(), opt, nullptr);
    const Tensor emu = be_->to_host(d);
    for (int64_t i = 0; i < M * N; ++i) same[bits - 13] += hw.ptr<float>()[i] == emu.ptr<float>()[i];
  }
  EXPECT_GT(same[1], same[0]) << "13 bits: " << same[0] << ", 14 bits: " << same[1] << " of " << M * N;
  EXPECT_GT(same[1], same[2]) << "15 bits: " << same[2] << ", 14 bits: " << same[1] << " of " << M * N;
  EXPECT_GT(same[1], M * N / 2) << "14 bits bit-identical on " << same[1] << " of " << M * N;
}

TEST_F(WgmmaAccum, RejectsBadArguments) {
  auto dev = [&](DType dt, int64_t R, int64_t C) { return be_->zeros(dt, {R, C}); };
  const Tensor a = dev(DType::e4m3, 64, 128), b = dev(DType::e4m3, 128, 128), d = dev(DType::f32, 64, 128);
  auto expect_error = [&](const TensorView& x, const TensorView& y, const TensorView& z, int nc, const std::string& part) {
    try {
      cuda::wgmma_accumulate(x, y, z, nc, nullptr);
      ADD_FAILURE() << "no error, expected one naming '" << part << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const Tensor a_rows = dev(DType::e4m3, 96, 128), b_rows = dev(DType::e4m3, 64, 128), a_k = dev(DType::e4m3, 64, 96);
  const Tensor b_k = dev(DType::e4m3, 128, 96), a_bf16 = dev(DType::bf16, 64, 128), d_bf16 = dev(DType::bf16, 64, 128);
  expect_error(a_rows, b, dev(DType::f32, 96, 128), 0, "a rows must be a multiple of 64");
  expect_error(a, b_rows, dev(DType::f32, 64, 64), 0, "b rows must be a multiple of 128");
  expect_error(a_k, b_k, d, 0, "multiple of 128");
  expect_error(a, b_k, d, 0, "b must have K = 128");
  expect_error(a, b, d, 48, "promote_every");
  expect_error(a_bf16, b, d, 0, "a must be a 2-D e4m3 tensor");
  expect_error(a, b, d_bf16, 0, "d must be a contiguous f32 GPU tensor");
}

}  // namespace
}  // namespace fp8moe::testing
