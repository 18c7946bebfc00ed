// The Tensor Cores' ceiling of `bench gemm --ceiling` (bench/bench_ceiling.cu): that it issues
// the WGMMAs it claims, on the operands it claims, is checked where no sum can round: e4m3 values
// in {-1, 0, 1} and scales of powers of two, so a CTA's f32 tile after B blocks is exactly B times
// (scale squared, when promoting) the integer product of its K block of rows of A and B. Also the
// rows wrapped where M or N is smaller than the tile, each CTA's own K block, the block count for a
// number of FLOPs, and bad arguments. Skips without a Hopper GPU.
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "cuda_test_util.hpp"

namespace fp8moe::testing {
namespace {

using cuda::bench::CeilingMode;

class BenchCeiling : public Sm90Test {
 protected:
  // CTA `cta`'s tile after `blocks` K blocks against the expected value: tile row r is A row
  // r % M (M <= 128), tile column c is B row c % N (N <= the tile's columns), over K block `kb`.
  void expect_tile(CeilingMode mode, const Tensor& a, const Tensor& b, int64_t blocks, float scale, int cta, int64_t kb) {
    const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
    const int R = cuda::bench::ceiling_tile_rows(), C = cuda::bench::ceiling_tile_cols(mode);
    const Tensor ad = to_device(*be_, a), bd = to_device(*be_, b);
    Tensor d = be_->zeros(DType::f32, {R, C});
    cuda::bench::tensor_ceiling(mode, ad.view().data, M, bd.view().data, N, K, blocks, scale,
                                static_cast<float*>(d.view().data), cta, nullptr);
    const Tensor got = be_->to_host(d);
    const double factor = double(blocks) * (mode == CeilingMode::bare ? 1.0 : double(scale) * scale);
    int64_t bad = -1;
    double want_bad = 0;
    for (int r = 0; r < R && bad < 0; ++r)
      for (int c = 0; c < C && bad < 0; ++c) {
        int sum = 0;
        for (int64_t k = kb * 128; k < (kb + 1) * 128; ++k)
          sum += int(e4m3_decode(a.ptr<uint8_t>()[(r % M) * K + k])) * int(e4m3_decode(b.ptr<uint8_t>()[(c % N) * K + k]));
        const double want = factor * sum;
        if (double(got.ptr<float>()[r * C + c]) != want) bad = r * C + c, want_bad = want;
      }
    EXPECT_EQ(bad, -1) << "mode " << int(mode) << " M=" << M << " N=" << N << " K=" << K << " cta " << cta
                       << ": first mismatch at " << bad << " got " << (bad >= 0 ? got.ptr<float>()[bad] : 0.0f)
                       << " want " << want_bad;
  }
};

TEST_F(BenchCeiling, IssuesTheClaimedWgmmasOnTheClaimedOperands) {
  auto rng = make_rng();
  for (CeilingMode mode : {CeilingMode::bare, CeilingMode::promote_1d2d, CeilingMode::promote_1d1d}) {
    const int C = cuda::bench::ceiling_tile_cols(mode);
    // One K block, whole tiles; the promoting modes at scale 1/2 (each block's product 1/4); an
    // even and an odd number of blocks (the promoting loop alternates two accumulator sets), one.
    expect_tile(mode, ternary_e4m3(rng, 128, 128), ternary_e4m3(rng, C, 128), 6, 0.5f, 0, 0);
    expect_tile(mode, ternary_e4m3(rng, 128, 128), ternary_e4m3(rng, C, 128), 7, 0.5f, 0, 0);
    expect_tile(mode, ternary_e4m3(rng, 128, 128), ternary_e4m3(rng, C, 128), 1, 1.0f, 0, 0);
    // Fewer rows than the tile: rows wrap (tile row r = A row r % 64, column c = B row c % 48).
    expect_tile(mode, ternary_e4m3(rng, 64, 128), ternary_e4m3(rng, 48, 128), 4, 2.0f, 0, 0);
    // K = 384: CTA 4 holds K block 4 % 3 = 1.
    expect_tile(mode, ternary_e4m3(rng, 128, 384), ternary_e4m3(rng, C, 384), 2, 1.0f, 4, 1);
  }
}

TEST_F(BenchCeiling, BlocksCoverTheFlops) {
  for (CeilingMode mode : {CeilingMode::bare, CeilingMode::promote_1d2d, CeilingMode::promote_1d1d}) {
    const double per_block = cuda::bench::ceiling_block_flops(mode);
    EXPECT_DOUBLE_EQ(per_block, 2.0 * cuda::bench::ceiling_tile_rows() * cuda::bench::ceiling_tile_cols(mode) * 128 *
                                    cuda::bench::ceiling_ctas());
    const double flops = 2.0 * 4096 * 7168 * 16384;
    const int64_t blocks = cuda::bench::ceiling_blocks(mode, flops);
    EXPECT_GE(double(blocks) * per_block, flops);
    EXPECT_LT(double(blocks - 1) * per_block, flops);
    EXPECT_GE(cuda::bench::ceiling_blocks(mode, 1.0), 1);
  }
}

TEST_F(BenchCeiling, RejectsBadArguments) {
  const Tensor a = be_->zeros(DType::e4m3, {128, 256});
  const void* p = a.view().data;
  auto message = [&](CeilingMode mode, const void* x, int64_t K, int64_t blocks) {
    try {
      cuda::bench::tensor_ceiling(mode, x, 128, p, 128, K, blocks, 1.0f, nullptr, -1, nullptr);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(CeilingMode::bare, p, 200, 2).find("multiple of 128"), std::string::npos);
  EXPECT_NE(message(CeilingMode::bare, static_cast<const uint8_t*>(p) + 8, 256, 2).find("16-byte aligned"),
            std::string::npos);
  EXPECT_NE(message(CeilingMode::bare, p, 256, 0).find("positive"), std::string::npos);
}

}  // namespace
}  // namespace fp8moe::testing
