// The FP8 GEMMs with emulated Tensor Core accumulation (src/cuda/emulation/gemm_fp8_emulated.cu) against
// the CPU backend's (gemm_fp8_ref's emulate branch), bit for bit (memcmp of D):
//   1. dense, through the Backend: M and N off the 64-row tile grid, K = 128..4096, mantissa bits
//      14 and 13, promotion never / every 32 / every 256, f32 and bf16 outputs, accumulation into
//      f32, 128x128 and 1x128 (Wgrad) B; a padded D row stride whose pad columns stay untouched;
//   2. every arithmetic path of the kernel (FP32 integer sum for bits <= 18, double sum up to 51,
//      the reference's formula at 52), N_c = 64 and 96, inputs whose scales and values spread over
//      many binades so that truncation drops whole terms;
//   3. NaN operands and an infinite scale: NaN exactly where the CPU has NaN, other bits equal;
//   4. the grouped GEMMs through the Backend: contiguous (uneven and empty experts, padding rows,
//      accumulation leaving padding rows alone), masked (full and empty groups), K-grouped Wgrad
//      (empty segments, a one-block segment, ignored trailing tokens, accumulation leaving empty
//      segments alone), D poisoned with NaN first so every row the op must write is checked;
//   5. routing (cuda and cublaslt backends) and bad accumulation settings.
// Skips without a Hopper GPU.
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "cuda/moe/moe_api.hpp"
#include "cuda_test_util.hpp"
#include "grouped_testing.hpp"

namespace fp8moe::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
// (mantissa bits, N_c) of the grouped cases: the report's 14 bits never / often / rarely promoted.
constexpr std::pair<int, int> kGroupedSettings[] = {{14, 0}, {14, 32}, {14, 256}, {13, 0}};

GemmOptions tc_options(int bits, int promote_every, bool accumulate = false) {
  GemmOptions o;
  o.accumulate = accumulate;
  o.accum.mode = AccumMode::tensor_core;
  o.accum.mantissa_bits = bits;
  o.accum.promote_every = promote_every;
  return o;
}

std::string opt_str(const GemmOptions& o) {
  return "bits=" + std::to_string(o.accum.mantissa_bits) + " N_c=" + std::to_string(o.accum.promote_every) +
         (o.accumulate ? " accumulate" : "");
}

// Random [R, C] values quantized to e4m3 with `kind` scales (fp32 scales: not powers of two, so
// pre-scaled products round). spread > 0: every 128-wide tile scaled by 2^U(-spread, spread) and
// one value in 16 by 2^U(-spread, spread) more, so that scales and products span many binades.
QuantizedTensor random_quantized(std::mt19937_64& rng, int64_t R, int64_t C, ScaleKind kind, int spread = 0) {
  Tensor x = random_normal(rng, DType::f32, {R, C});
  if (spread > 0) {
    std::uniform_int_distribution<int> e(-spread, spread), pick(0, 15);
    const int64_t tiles = (C + kQuantGroup - 1) / kQuantGroup;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < tiles; ++t) {
        const float tile = std::ldexp(1.0f, e(rng));
        for (int64_t c = t * kQuantGroup; c < std::min(C, (t + 1) * kQuantGroup); ++c)
          x.ptr<float>()[r * C + c] *= pick(rng) == 0 ? tile * std::ldexp(1.0f, e(rng)) : tile;
      }
  }
  QuantizedTensor q = make_quantized_host(R, C, DType::e4m3, kind);
  if (kind == ScaleKind::tile_1x128) quantize_1x128(x.view(), q.view());
  else quantize_128x128(x.view(), q.view());
  return q;
}

// Host f32 [R, C] of small integers (the D an accumulating GEMM starts from).
Tensor small_int_f32(std::mt19937_64& rng, int64_t R, int64_t C) {
  Tensor t = Tensor::host(DType::f32, {R, C});
  std::uniform_int_distribution<int> v(-100, 100);
  for (int64_t i = 0; i < R * C; ++i) t.ptr<float>()[i] = float(v(rng));
  return t;
}

// Device tensor [R, C] with every byte 0xFF (NaN in f32 and bf16).
Tensor poisoned(Backend& be, DType dt, int64_t R, int64_t C) {
  Tensor h = Tensor::host(dt, {R, C});
  std::memset(h.view().data, 0xFF, h.view().nbytes());
  return to_device(be, h);
}

Tensor copy_host(const Tensor& t) {
  Tensor c = Tensor::host(t.dtype(), {t.size(0), t.size(1)});
  std::memcpy(c.view().data, t.view().data, t.view().nbytes());
  return c;
}

// got == want bit for bit (host [R, N]); reports the first differing element.
void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  const int64_t N = want.size(1), mis = first_mismatch(got, want);
  EXPECT_EQ(mis, -1) << what << ": first mismatch at [" << (mis >= 0 ? mis / N : 0) << ", "
                     << (mis >= 0 ? mis % N : 0) << "] got " << (mis >= 0 ? load_float(got.view(), mis) : 0.0f)
                     << " want " << (mis >= 0 ? load_float(want.view(), mis) : 0.0f);
}

class CudaGemmEmulated : public ::testing::Test {
 protected:
  void SetUp() override {
    FP8MOE_REQUIRE_SM90();
    be_ = make_cuda_backend();
    cpu_ = make_backend("cpu");
  }
  // D of gemm_fp8 on both backends (D starting from d0 when accumulating), compared bit for bit.
  void expect_dense_equal(const QuantizedTensor& a, const QuantizedTensor& b, DType dt, const GemmOptions& o,
                          const std::string& what, const Tensor* d0 = nullptr) {
    const int64_t M = a.values.size(0), N = b.values.size(0);
    Tensor want = d0 ? copy_host(*d0) : Tensor::host(dt, {M, N});
    cpu_->gemm_fp8(a, b, want, o);
    Tensor d = d0 ? to_device(*be_, *d0) : poisoned(*be_, dt, M, N);
    be_->gemm_fp8(to_device(*be_, a), to_device(*be_, b), d, o);
    expect_same_bits(be_->to_host(d), want, what + " " + std::string(dtype_name(dt)) + " " + opt_str(o));
  }
  std::unique_ptr<Backend> be_, cpu_;
};

// ---- dense --------------------------------------------------------------------------------------

TEST_F(CudaGemmEmulated, DenseMatchesCpuBitForBit) {
  auto rng = make_rng();
  struct Case {
    int64_t M, N, K;
    bool b_1x128;
  };
  const Case cases[] = {{1, 40, 128, false},    {77, 200, 384, false},  {130, 136, 1024, false},
                        {64, 64, 4096, false},  {200, 250, 2048, true}, {33, 129, 256, true}};
  for (const Case& c : cases) {
    const ScaleKind bkind = c.b_1x128 ? ScaleKind::tile_1x128 : ScaleKind::block_128x128;
    const QuantizedTensor a = random_quantized(rng, c.M, c.K, ScaleKind::tile_1x128);
    const QuantizedTensor b = random_quantized(rng, c.N, c.K, bkind);
    const Tensor d0 = small_int_f32(rng, c.M, c.N);
    const std::string what = "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) +
                             (c.b_1x128 ? " B 1x128" : " B 128x128");
    for (int bits : {14, 13})
      for (int nc : {0, 32, 256}) {
        expect_dense_equal(a, b, DType::f32, tc_options(bits, nc), what);
        expect_dense_equal(a, b, DType::bf16, tc_options(bits, nc), what);
        expect_dense_equal(a, b, DType::f32, tc_options(bits, nc, true), what, &d0);
      }
  }
}

TEST_F(CudaGemmEmulated, EveryArithmeticPathMatchesCpu) {
  auto rng = make_rng();
  const int64_t M = 96, N = 72, K = 640;
  for (int spread : {0, 12}) {
    const QuantizedTensor a = random_quantized(rng, M, K, ScaleKind::tile_1x128, spread);
    const QuantizedTensor b = random_quantized(rng, N, K, ScaleKind::block_128x128, spread);
    // Bits 1..18 sum in FP32, 19..51 in double, 52 by the reference's formula.
    for (int bits : {1, 7, 18, 19, 40, 51, 52})
      for (int nc : {0, 64, 96, 160})
        expect_dense_equal(a, b, DType::f32, tc_options(bits, nc), "spread=" + std::to_string(spread));
  }
}

TEST_F(CudaGemmEmulated, ZeroTilesAndRowsMatchCpu) {
  auto rng = make_rng();
  const int64_t M = 70, N = 100, K = 512;
  QuantizedTensor a = random_quantized(rng, M, K, ScaleKind::tile_1x128);
  QuantizedTensor b = random_quantized(rng, N, K, ScaleKind::block_128x128);
  // Zero values: a whole A row, a 32-wide step of every A row, a 128-wide block of B.
  std::memset(a.values.ptr<uint8_t>() + 5 * K, 0, size_t(K));
  for (int64_t r = 0; r < M; ++r) std::memset(a.values.ptr<uint8_t>() + r * K + 160, 0, 32);
  for (int64_t r = 0; r < N; ++r) std::memset(b.values.ptr<uint8_t>() + r * K + 256, 0, 128);
  for (int nc : {0, 32})
    for (DType dt : {DType::f32, DType::bf16}) expect_dense_equal(a, b, dt, tc_options(14, nc), "zero tiles");
}

TEST_F(CudaGemmEmulated, PaddedRowStrideLeavesPadsAlone) {
  auto rng = make_rng();
  const int64_t M = 100, N = 90, K = 384, ld = N + 7;
  const QuantizedTensor a = random_quantized(rng, M, K, ScaleKind::tile_1x128);
  const QuantizedTensor b = random_quantized(rng, N, K, ScaleKind::block_128x128);
  const QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
  for (DType dt : {DType::f32, DType::bf16}) {
    const GemmOptions o = tc_options(14, 0);
    Tensor want = Tensor::host(dt, {M, N});
    cpu_->gemm_fp8(a, b, want, o);
    Tensor buf = poisoned(*be_, dt, M, ld);
    TensorView dv = buf.view();
    dv.shape[1] = N;
    cuda::gemm_fp8_emulated(ad, bd, dv, o, nullptr);
    const Tensor h = be_->to_host(buf);
    Tensor got = Tensor::host(dt, {M, N});
    const size_t es = dtype_size(dt);
    bool pads_ok = true;
    for (int64_t r = 0; r < M; ++r) {
      const auto* row = static_cast<const uint8_t*>(h.view().data) + r * ld * int64_t(es);
      std::memcpy(static_cast<uint8_t*>(got.view().data) + r * N * int64_t(es), row, size_t(N) * es);
      for (size_t i = size_t(N) * es; i < size_t(ld) * es; ++i) pads_ok &= row[i] == 0xFF;
    }
    expect_same_bits(got, want, std::string("padded stride ") + std::string(dtype_name(dt)));
    EXPECT_TRUE(pads_ok) << "write past N (row padding changed), " << dtype_name(dt);
  }
}

TEST_F(CudaGemmEmulated, NanWhereCpuHasNan) {
  auto rng = make_rng();
  const int64_t M = 80, N = 200, K = 512;
  QuantizedTensor a = random_quantized(rng, M, K, ScaleKind::tile_1x128);
  QuantizedTensor b = random_quantized(rng, N, K, ScaleKind::block_128x128);
  a.values.ptr<uint8_t>()[3 * K + 17] = 0x7F;   // e4m3 NaN, first K block of row 3
  a.values.ptr<uint8_t>()[40 * K + 300] = 0xFF;  // -NaN, third K block of row 40
  b.scales.ptr<float>()[1 * b.scales.size(1) + 2] = std::numeric_limits<float>::infinity();  // rows 128.., block 2
  const QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
  for (int nc : {0, 32, 256}) {
    const GemmOptions o = tc_options(14, nc);
    Tensor want = Tensor::host(DType::f32, {M, N});
    cpu_->gemm_fp8(a, b, want, o);
    Tensor d = poisoned(*be_, DType::f32, M, N);
    be_->gemm_fp8(ad, bd, d, o);
    const Tensor got = be_->to_host(d);
    int64_t nan_mismatch = -1, bit_mismatch = -1, nans = 0;
    for (int64_t i = 0; i < M * N; ++i) {
      const float g = got.ptr<float>()[i], w = want.ptr<float>()[i];
      nans += std::isnan(w);
      if (std::isnan(g) != std::isnan(w)) {
        if (nan_mismatch < 0) nan_mismatch = i;
      } else if (!std::isnan(w) && std::memcmp(&g, &w, 4) != 0 && bit_mismatch < 0) {
        bit_mismatch = i;
      }
    }
    EXPECT_GT(nans, 0) << "the inputs were meant to give NaN outputs";
    EXPECT_EQ(nan_mismatch, -1) << opt_str(o) << ": NaN differs at [" << nan_mismatch / N << ", " << nan_mismatch % N
                                << "]";
    EXPECT_EQ(bit_mismatch, -1) << opt_str(o) << ": bits differ at [" << bit_mismatch / N << ", "
                                << bit_mismatch % N << "]";
  }
}

// ---- grouped ------------------------------------------------------------------------------------

TEST_F(CudaGemmEmulated, ContiguousMatchesCpu) {
  auto rng = make_rng();
  struct Case {
    int64_t G, mean, N, K, extra;
    std::vector<int64_t> empty;
  };
  const Case cases[] = {{3, 100, 128, 384, 70, {1}}, {4, 90, 256, 1024, 0, {0, 3}}, {1, 200, 128, 256, 5, {}}};
  for (const Case& c : cases) {
    const ExpertRows L = expert_rows(random_expert_counts(rng, c.G, c.mean, c.empty), c.extra);
    const int64_t R = L.rows();
    // Padding rows of A hold values too: their D rows must still come out zero.
    const QuantizedTensor a = random_quantized(rng, R, c.K, ScaleKind::tile_1x128);
    const QuantizedTensor b = random_quantized(rng, c.G * c.N, c.K, ScaleKind::block_128x128);
    const Tensor rg = i32_tensor(L.row_group);
    const QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
    const Tensor rgd = to_device(*be_, rg);
    // Accumulation: small integers on expert rows, NaN on padding rows (which keep their bits).
    Tensor d0 = small_int_f32(rng, R, c.N);
    for (int64_t r = 0; r < R; ++r)
      if (L.row_group[size_t(r)] < 0)
        for (int64_t n = 0; n < c.N; ++n) d0.ptr<float>()[r * c.N + n] = kNaN;
    const std::string what = "contiguous G=" + std::to_string(c.G) + " R=" + std::to_string(R) +
                             " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K);
    for (auto [bits, nc] : kGroupedSettings) {
      for (DType dt : {DType::f32, DType::bf16}) {
        const GemmOptions o = tc_options(bits, nc);
        Tensor want = Tensor::host(dt, {R, c.N});
        cpu_->grouped_gemm_fp8_contiguous(a, b, rg, c.G, want, o);
        Tensor d = poisoned(*be_, dt, R, c.N);
        be_->grouped_gemm_fp8_contiguous(ad, bd, rgd, c.G, d, o);
        expect_same_bits(be_->to_host(d), want, what + " " + std::string(dtype_name(dt)) + " " + opt_str(o));
      }
      const GemmOptions o = tc_options(bits, nc, true);
      Tensor want = copy_host(d0);
      cpu_->grouped_gemm_fp8_contiguous(a, b, rg, c.G, want, o);
      Tensor d = to_device(*be_, d0);
      be_->grouped_gemm_fp8_contiguous(ad, bd, rgd, c.G, d, o);
      expect_same_bits(be_->to_host(d), want, what + " " + opt_str(o));
    }
  }
}

TEST_F(CudaGemmEmulated, MaskedMatchesCpu) {
  auto rng = make_rng();
  struct Case {
    int64_t G, Mmax, N, K;
    std::vector<int64_t> counts;
  };
  const Case cases[] = {{3, 100, 256, 384, {100, 0, 37}}, {2, 129, 128, 128, {65, 129}}, {4, 64, 128, 512, {0, 64, 1, 63}}};
  for (const Case& c : cases) {
    const int64_t R = c.G * c.Mmax;
    const QuantizedTensor a = random_quantized(rng, R, c.K, ScaleKind::tile_1x128);
    const QuantizedTensor b = random_quantized(rng, c.G * c.N, c.K, ScaleKind::block_128x128);
    const Tensor cnt = i32_tensor(c.counts);
    const QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
    const Tensor cntd = to_device(*be_, cnt);
    const std::string what = "masked G=" + std::to_string(c.G) + " M_max=" + std::to_string(c.Mmax) +
                             " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K);
    for (auto [bits, nc] : kGroupedSettings)
      for (DType dt : {DType::f32, DType::bf16}) {
        const GemmOptions o = tc_options(bits, nc);
        Tensor want = Tensor::host(dt, {R, c.N});
        cpu_->grouped_gemm_fp8_masked(a, b, cnt, c.G, want, o);
        Tensor d = poisoned(*be_, dt, R, c.N);
        be_->grouped_gemm_fp8_masked(ad, bd, cntd, c.G, d, o);
        expect_same_bits(be_->to_host(d), want, what + " " + std::string(dtype_name(dt)) + " " + opt_str(o));
      }
  }
}

TEST_F(CudaGemmEmulated, WgradMatchesCpu) {
  auto rng = make_rng();
  struct Case {
    int64_t N, K, R;
    std::vector<int64_t> offsets;  // G + 1 segment starts; tokens past offsets[G] are ignored
  };
  const Case cases[] = {{200, 136, 896, {0, 256, 256, 384, 768}},  // an empty and a one-block segment
                        {64, 128, 128, {0, 128}},
                        {128, 300, 1280, {0, 0, 1152, 1280}}};
  for (const Case& c : cases) {
    const int64_t G = int64_t(c.offsets.size()) - 1;
    const QuantizedTensor dy = random_quantized(rng, c.N, c.R, ScaleKind::tile_1x128);
    const QuantizedTensor x = random_quantized(rng, c.K, c.R, ScaleKind::tile_1x128);
    const Tensor off = i32_tensor(c.offsets);
    const QuantizedTensor dyd = to_device(*be_, dy), xd = to_device(*be_, x);
    const Tensor offd = to_device(*be_, off);
    // Accumulation: small integers before, NaN on the rows of empty segments (left alone).
    Tensor d0 = small_int_f32(rng, G * c.N, c.K);
    for (int64_t g = 0; g < G; ++g)
      if (c.offsets[size_t(g)] == c.offsets[size_t(g + 1)])
        for (int64_t i = g * c.N * c.K; i < (g + 1) * c.N * c.K; ++i) d0.ptr<float>()[i] = kNaN;
    std::string what = "wgrad N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) + " offsets";
    for (int64_t o : c.offsets) what.append(" ").append(std::to_string(o));
    for (auto [bits, nc] : kGroupedSettings)
      for (bool acc : {false, true}) {
        const GemmOptions o = tc_options(bits, nc, acc);
        Tensor want = acc ? copy_host(d0) : Tensor::host(DType::f32, {G * c.N, c.K});
        cpu_->grouped_wgrad_fp8(dy, x, off, want, o);
        Tensor d = acc ? to_device(*be_, d0) : poisoned(*be_, DType::f32, G * c.N, c.K);
        be_->grouped_wgrad_fp8(dyd, xd, offd, d, o);
        expect_same_bits(be_->to_host(d), want, what + " " + opt_str(o));
      }
  }
}

// ---- routing and arguments ----------------------------------------------------------------------

TEST_F(CudaGemmEmulated, CublasLtBackendRoutesToo) {
  auto rng = make_rng();
  auto lt = make_cublaslt_backend();
  const int64_t M = 128, N = 256, K = 512;  // a shape the cublaslt backend would send to cuBLASLt
  const QuantizedTensor a = random_quantized(rng, M, K, ScaleKind::tile_1x128);
  const QuantizedTensor b = random_quantized(rng, N, K, ScaleKind::block_128x128);
  const GemmOptions o = tc_options(14, 0);
  Tensor want = Tensor::host(DType::bf16, {M, N});
  cpu_->gemm_fp8(a, b, want, o);
  Tensor d = poisoned(*lt, DType::bf16, M, N);
  lt->gemm_fp8(to_device(*lt, a), to_device(*lt, b), d, o);
  expect_same_bits(lt->to_host(d), want, "cublaslt backend " + opt_str(o));
}

TEST_F(CudaGemmEmulated, RejectsBadAccumulationSettings) {
  QuantizedTensor a = be_->empty_quantized(64, 256, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor b = be_->empty_quantized(128, 256, DType::e4m3, ScaleKind::block_128x128);
  Tensor d = be_->zeros(DType::bf16, {64, 128});
  expect_error([&] { be_->gemm_fp8(a, b, d, tc_options(14, 48)); }, "promote_every");
  expect_error([&] { be_->gemm_fp8(a, b, d, tc_options(0, 0)); }, "mantissa_bits");
  expect_error([&] { be_->gemm_fp8(a, b, d, tc_options(53, 32)); }, "mantissa_bits");
  expect_error([&] { cuda::gemm_fp8_emulated(a, b, d, GemmOptions{}, nullptr); }, "tensor_core");
  expect_error([&] { be_->gemm_fp8(a, b, d, tc_options(14, 0, true)); }, "accumulate needs an f32");
  QuantizedTensor a100 = be_->empty_quantized(64, 100, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor b100 = be_->empty_quantized(128, 100, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { be_->gemm_fp8(a100, b100, d, tc_options(14, 0)); }, "multiple of 128");
  QuantizedTensor ah = make_quantized_host(64, 256, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { be_->gemm_fp8(ah, b, d, tc_options(14, 0)); }, "must be on the GPU");
  Tensor cnt = be_->zeros(DType::i32, {2});
  QuantizedTensor b2 = be_->empty_quantized(256, 256, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { be_->grouped_gemm_fp8_masked(a, b2, cnt, 2, be_->zeros(DType::f32, {64, 128}),
                                                  tc_options(14, 0, true)); },
               "accumulate is unsupported");
}

}  // namespace
}  // namespace fp8moe::testing
