// The grouped FP8 GEMMs of the CUDA backend (src/cuda/moe/moe_api.hpp: contiguous, masked, K-grouped
// Wgrad) against the CPU backend's ops on the same quantized inputs:
//   1. small-integer inputs with power-of-two scales (exact arithmetic): D bit for bit equal to the
//      CPU op for every grouped tile, bf16 and f32, with D poisoned (NaN) first, so every row the
//      kernel must write is checked (padding rows and rows past a count are exact zeros), and with
//      accumulation (rows the op must leave alone keep their NaN bits);
//   2. random inputs: relative error vs the CPU op at FP32 rounding level (the dense GEMM tests'
//      bound) and calc_diff < 1e-3 vs the unquantized product; expert loads 0.7x..1.3x of the mean,
//      empty experts, G in {1, 3, 4, 8};
//   3. the masked GEMM replayed from a CUDA graph with the counts changed on the device in between;
//   4. bad arguments. Skips without a Hopper GPU.
#include <cuda_runtime.h>

#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "cuda/moe/moe_api.hpp"
#include "cuda_test_util.hpp"
#include "grouped_testing.hpp"

namespace fp8moe::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// contiguous: with the 192-row tiles of the contiguous GEMM.
std::vector<cuda::GemmTile> grouped_tiles(bool b_1x128, bool contiguous = false) {
  std::vector<cuda::GemmTile> v;
  for (const cuda::GemmTile& t : cuda::gemm_tiles(b_1x128))
    if (cuda::grouped_tile_ok(t, b_1x128, contiguous)) v.push_back(t);
  return v;
}

// Device tensor [R, C] with every byte 0xFF (NaN in f32 and bf16).
Tensor poisoned(Backend& be, DType dt, int64_t R, int64_t C) {
  Tensor h = Tensor::host(dt, {R, C});
  std::memset(h.view().data, 0xFF, h.view().nbytes());
  return to_device(be, h);
}

// got == want bit for bit (both host [R, N]); reports the first differing element.
void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  const int64_t N = want.size(1), mis = first_mismatch(got, want);
  EXPECT_EQ(mis, -1) << what << ": first mismatch at [" << (mis >= 0 ? mis / N : 0) << ", "
                     << (mis >= 0 ? mis % N : 0) << "] got " << (mis >= 0 ? load_float(got.view(), mis) : 0.0f)
                     << " want " << (mis >= 0 ? load_float(want.view(), mis) : 0.0f);
}

// sum over columns [c0, c1) of x[i, c] * y[j, c] in FP64 (x, y f32).
double dot_rows(const Tensor& x, int64_t i, const Tensor& y, int64_t j, int64_t c0, int64_t c1) {
  const float* xp = x.ptr<float>() + i * x.size(1);
  const float* yp = y.ptr<float>() + j * y.size(1);
  double s = 0;
  for (int64_t c = c0; c < c1; ++c) s += double(xp[c]) * double(yp[c]);
  return s;
}

// Random f32 [R, C] and its 1x128 (or 128x128) quantization.
struct Quantized {
  Tensor f32;
  QuantizedTensor q;
};
Quantized random_quantized(std::mt19937_64& rng, int64_t R, int64_t C, ScaleKind kind) {
  Quantized x{random_normal(rng, DType::f32, {R, C}), make_quantized_host(R, C, DType::e4m3, kind)};
  if (kind == ScaleKind::tile_1x128) quantize_1x128(x.f32.view(), x.q.view());
  else quantize_128x128(x.f32.view(), x.q.view());
  return x;
}

// Checks a random-input result: finite, rel. error vs the CPU op, calc_diff vs the exact product.
void check_random(const Tensor& got_t, const Tensor& want_t, const std::vector<double>& exact, const std::string& what) {
  const std::vector<double> got = to_doubles(got_t.view()), want = to_doubles(want_t.view());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_TRUE(std::isfinite(got[i])) << what << ": NaN/Inf at [" << i / size_t(got_t.size(1)) << ", "
                                       << i % size_t(got_t.size(1)) << "] (unwritten row?)";
  const double kerr = rel_error(got, want), cd = calc_diff(got, exact);
  EXPECT_LT(kerr, 1e-3) << what << ": kernel error vs the CPU op";
  EXPECT_LT(cd, 1e-3) << what << ": calc_diff vs the unquantized product";
  std::cout << "[ info     ] " << what << ": rel err vs CPU op " << kerr << ", calc_diff vs unquantized " << cd << "\n";
}

// Captures launch(stream) in a CUDA graph, after one launch outside the capture (which sets the
// kernel attributes and loads the driver entry point), then for each of `runs` replays: prepare(i)
// writes the inputs, the graph runs, check(i) reads the output.
void replay_from_graph(const std::function<void(cudaStream_t)>& launch, size_t runs,
                       const std::function<void(size_t)>& prepare, const std::function<void(size_t)>& check) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  launch(s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  launch(s);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t i = 0; i < runs; ++i) {
    prepare(i);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    check(i);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

class CudaGroupedGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    FP8MOE_REQUIRE_SM90();
    be_ = make_cuda_backend();
    cpu_ = make_backend("cpu");
  }
  std::unique_ptr<Backend> be_, cpu_;
};

// ---- contiguous ---------------------------------------------------------------------------------

struct ContiguousCase {
  int64_t G, mean, N, K, extra;  // extra: padding rows after the last segment
  std::vector<int64_t> empty;    // experts without tokens
  std::string str() const {
    return "G=" + std::to_string(G) + " mean=" + std::to_string(mean) + " N=" + std::to_string(N) +
           " K=" + std::to_string(K) + " extra=" + std::to_string(extra);
  }
};

TEST_F(CudaGroupedGemm, ContiguousSmallIntegersExactForEveryTile) {
  auto rng = make_rng();
  // The last case's segments of 4..8 blocks take the 192-row tiles at every phase (tiles starting
  // at a block's row 0 or 64, ending inside the segment or in its last block).
  const ContiguousCase cases[] = {{1, 200, 128, 256, 0, {}},      {3, 150, 256, 384, 70, {1}},
                                  {4, 90, 384, 128, 256, {0, 3}}, {2, 300, 128, 1024, 5, {}},
                                  {4, 700, 128, 256, 130, {2}}};
  for (const ContiguousCase& c : cases) {
    const ExpertRows L = expert_rows(random_expert_counts(rng, c.G, c.mean, c.empty), c.extra);
    const int64_t R = L.rows();
    // Padding rows of A hold values too: their D rows must still come out zero.
    QuantizedTensor a = small_int_quantized(rng, R, c.K, ScaleKind::tile_1x128);
    QuantizedTensor b = small_int_quantized(rng, c.G * c.N, c.K, ScaleKind::block_128x128);
    Tensor rg = i32_tensor(L.row_group);
    QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
    Tensor rgd = to_device(*be_, rg);
    for (DType dt : {DType::f32, DType::bf16}) {
      Tensor want = Tensor::host(dt, {R, c.N});
      cpu_->grouped_gemm_fp8_contiguous(a, b, rg, c.G, want, {});
      for (const cuda::GemmTile& t : grouped_tiles(false, /*contiguous=*/true)) {
        Tensor d = poisoned(*be_, dt, R, c.N);
        cuda::grouped_gemm_fp8_contiguous_cuda(ad, bd, rgd, c.G, d, false, nullptr, &t);
        expect_same_bits(be_->to_host(d), want,
                         "contiguous " + c.str() + " " + std::string(dtype_name(dt)) + " tile " + cuda::tile_name(t));
      }
    }
  }
}

TEST_F(CudaGroupedGemm, ContiguousAccumulatesAndLeavesPaddingForEveryTile) {
  auto rng = make_rng();
  // The last case has more 128x128 and 128x192 tiles than the H200 has SMs (each CTA's staging
  // tiles are reused), and N = 1280 is no multiple of 192.
  const ContiguousCase cases[] = {{3, 150, 256, 256, 100, {2}}, {1, 100, 128, 128, 0, {}}, {8, 340, 1280, 256, 37, {3}}};
  for (const ContiguousCase& c : cases) {
    const ExpertRows L = expert_rows(random_expert_counts(rng, c.G, c.mean, c.empty), c.extra);
    const int64_t R = L.rows();
    QuantizedTensor a = small_int_quantized(rng, R, c.K, ScaleKind::tile_1x128);
    QuantizedTensor b = small_int_quantized(rng, c.G * c.N, c.K, ScaleKind::block_128x128);
    Tensor rg = i32_tensor(L.row_group);
    // D before: small integers on expert rows, NaN on padding rows (which must keep their bits).
    Tensor d0 = Tensor::host(DType::f32, {R, c.N});
    std::uniform_int_distribution<int> v(-100, 100);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t n = 0; n < c.N; ++n) d0.ptr<float>()[r * c.N + n] = L.row_group[size_t(r)] >= 0 ? float(v(rng)) : kNaN;
    Tensor want = Tensor::host(DType::f32, {R, c.N});
    std::memcpy(want.ptr<float>(), d0.ptr<float>(), d0.view().nbytes());
    GemmOptions acc;
    acc.accumulate = true;
    cpu_->grouped_gemm_fp8_contiguous(a, b, rg, c.G, want, acc);
    QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
    Tensor rgd = to_device(*be_, rg);
    for (const cuda::GemmTile& t : grouped_tiles(false, /*contiguous=*/true)) {
      Tensor d = to_device(*be_, d0);
      cuda::grouped_gemm_fp8_contiguous_cuda(ad, bd, rgd, c.G, d, true, nullptr, &t);
      expect_same_bits(be_->to_host(d), want, "contiguous accumulate " + c.str() + " tile " + cuda::tile_name(t));
    }
  }
}

TEST_F(CudaGroupedGemm, ContiguousRandomAgainstReference) {
  auto rng = make_rng();
  const ContiguousCase cases[] = {{1, 300, 256, 128, 0, {}},
                                  {3, 200, 384, 640, 0, {1}},
                                  {4, 256, 512, 1024, 128, {2}},
                                  {8, 128, 256, 2048, 0, {0, 5}},
                                  // large enough for the 128-row tiles (f32 D: their FP32-staged variants)
                                  {8, 340, 1280, 256, 37, {3}}};
  for (const ContiguousCase& c : cases) {
    const ExpertRows L = expert_rows(random_expert_counts(rng, c.G, c.mean, c.empty), c.extra);
    const int64_t R = L.rows(), N = c.N, K = c.K;
    Quantized a = random_quantized(rng, R, K, ScaleKind::tile_1x128);
    Quantized b = random_quantized(rng, c.G * N, K, ScaleKind::block_128x128);
    std::vector<double> exact(size_t(R * N), 0.0);
#pragma omp parallel for schedule(dynamic, 16)
    for (int64_t r = 0; r < R; ++r) {
      const int32_t g = L.row_group[size_t(r)];
      if (g >= 0)
        for (int64_t n = 0; n < N; ++n) exact[size_t(r * N + n)] = dot_rows(a.f32, r, b.f32, g * N + n, 0, K);
    }
    Tensor rg = i32_tensor(L.row_group);
    QuantizedTensor ad = to_device(*be_, a.q), bd = to_device(*be_, b.q);
    Tensor rgd = to_device(*be_, rg);
    for (DType dt : {DType::f32, DType::bf16}) {
      Tensor want = Tensor::host(dt, {R, N});
      cpu_->grouped_gemm_fp8_contiguous(a.q, b.q, rg, c.G, want, {});
      Tensor d = poisoned(*be_, dt, R, N);
      be_->grouped_gemm_fp8_contiguous(ad, bd, rgd, c.G, d, {});
      check_random(be_->to_host(d), want, exact,
                   "contiguous " + c.str() + " " + std::string(dtype_name(dt)) + " tile " +
                       cuda::tile_name(cuda::grouped_gemm_tile(R, N, K, false, dt == DType::f32)));
    }
  }
}

// The 192-row tiles over more 128-row blocks than the tile table's scan takes at once (1024): a
// segment runs across the chunk boundary. Small integers, exact against the CPU op.
TEST_F(CudaGroupedGemm, ContiguousTallTilesAcrossScanChunks) {
  auto rng = make_rng();
  const int64_t G = 4, N = 128, K = 128;
  const ExpertRows L = expert_rows({70001, 0, 45000, 29950}, 300);
  const int64_t R = L.rows();
  ASSERT_GT(R, 1024 * 128);
  QuantizedTensor a = small_int_quantized(rng, R, K, ScaleKind::tile_1x128);
  QuantizedTensor b = small_int_quantized(rng, G * N, K, ScaleKind::block_128x128);
  Tensor rg = i32_tensor(L.row_group);
  QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
  Tensor rgd = to_device(*be_, rg);
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor want = Tensor::host(dt, {R, N});
    cpu_->grouped_gemm_fp8_contiguous(a, b, rg, G, want, {});
    cuda::GemmTile t{192, 128};
    t.f32_staging = dt == DType::f32;
    Tensor d = poisoned(*be_, dt, R, N);
    cuda::grouped_gemm_fp8_contiguous_cuda(ad, bd, rgd, G, d, false, nullptr, &t);
    expect_same_bits(be_->to_host(d), want, "contiguous R=" + std::to_string(R) + " tile " + cuda::tile_name(t));
  }
}

// The contiguous GEMM on 192-row tiles captured in a CUDA graph (tile table allocation, build and
// release inside it) and replayed with new expert layouts written to row_group on the device.
TEST_F(CudaGroupedGemm, ContiguousTallTilesReplayFromCudaGraphWithNewLayouts) {
  auto rng = make_rng();
  const int64_t G = 3, R = 1024, N = 256, K = 256;
  QuantizedTensor a = small_int_quantized(rng, R, K, ScaleKind::tile_1x128);
  QuantizedTensor b = small_int_quantized(rng, G * N, K, ScaleKind::block_128x128);
  QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
  auto layout = [&](const std::vector<int64_t>& counts) {
    int64_t used = 0;
    for (int64_t c : counts) used += round_up(c, kQuantGroup);
    return i32_tensor(expert_rows(counts, R - used).row_group);
  };
  const std::vector<std::vector<int64_t>> runs{{300, 0, 500}, {0, 1000, 0}, {0, 0, 0}, {129, 257, 300}};
  Tensor rgd = to_device(*be_, layout(runs[0]));
  Tensor nan_host = Tensor::host(DType::f32, {R, N});
  std::memset(nan_host.view().data, 0xFF, nan_host.view().nbytes());
  Tensor d = to_device(*be_, nan_host);
  const cuda::GemmTile t{192, 128, true, 1, false, true};
  Tensor rg;
  replay_from_graph(
      [&](cudaStream_t s) { cuda::grouped_gemm_fp8_contiguous_cuda(ad, bd, rgd, G, d, false, s, &t); }, runs.size(),
      [&](size_t i) {
        rg = layout(runs[i]);
        be_->copy(rgd, rg);
        be_->copy(d, nan_host);
      },
      [&](size_t i) {
        Tensor want = Tensor::host(DType::f32, {R, N});
        cpu_->grouped_gemm_fp8_contiguous(a, b, rg, G, want, {});
        expect_same_bits(be_->to_host(d), want,
                         "graph replay, counts " + std::to_string(runs[i][0]) + " " + std::to_string(runs[i][1]) +
                             " " + std::to_string(runs[i][2]));
      });
}

// ---- masked -------------------------------------------------------------------------------------

struct MaskedCase {
  int64_t G, Mmax, N, K;
  std::string str() const {
    return "G=" + std::to_string(G) + " M_max=" + std::to_string(Mmax) + " N=" + std::to_string(N) +
           " K=" + std::to_string(K);
  }
};

// Counts in [0, M_max], with a full and an empty group when G >= 2.
std::vector<int64_t> random_counts(std::mt19937_64& rng, int64_t G, int64_t Mmax) {
  std::uniform_int_distribution<int64_t> u(0, Mmax);
  std::vector<int64_t> counts(static_cast<size_t>(G));
  for (auto& c : counts) c = u(rng);
  if (G >= 2) counts[0] = Mmax, counts[1] = 0;
  return counts;
}

TEST_F(CudaGroupedGemm, MaskedSmallIntegersExactForEveryTile) {
  auto rng = make_rng();
  const MaskedCase cases[] = {{1, 37, 128, 256}, {2, 100, 256, 128}, {3, 200, 128, 384}, {4, 64, 256, 256}, {2, 129, 384, 128},
                              {3, 192, 256, 128}};  // M_max multiples of 64: the staged-only tiles' TMA stores
  for (const MaskedCase& c : cases) {
    const std::vector<int64_t> counts = random_counts(rng, c.G, c.Mmax);
    QuantizedTensor a = small_int_quantized(rng, c.G * c.Mmax, c.K, ScaleKind::tile_1x128);
    QuantizedTensor b = small_int_quantized(rng, c.G * c.N, c.K, ScaleKind::block_128x128);
    Tensor cnt = i32_tensor(counts);
    QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
    Tensor cntd = to_device(*be_, cnt);
    std::string cs;
    for (int64_t v : counts) cs.append(" ").append(std::to_string(v));
    for (DType dt : {DType::f32, DType::bf16}) {
      Tensor want = Tensor::host(dt, {c.G * c.Mmax, c.N});
      cpu_->grouped_gemm_fp8_masked(a, b, cnt, c.G, want, {});
      for (const cuda::GemmTile& t : grouped_tiles(false)) {
        Tensor d = poisoned(*be_, dt, c.G * c.Mmax, c.N);
        cuda::grouped_gemm_fp8_masked_cuda(ad, bd, cntd, c.G, d, false, nullptr, &t);
        expect_same_bits(be_->to_host(d), want,
                         "masked " + c.str() + " counts" + cs + " " + std::string(dtype_name(dt)) + " tile " + cuda::tile_name(t));
      }
    }
  }
}

TEST_F(CudaGroupedGemm, MaskedRandomAgainstReference) {
  auto rng = make_rng();
  const MaskedCase cases[] = {{4, 256, 512, 1024}, {1, 100, 256, 512}, {2, 200, 384, 128}};
  for (const MaskedCase& c : cases) {
    const std::vector<int64_t> counts = random_counts(rng, c.G, c.Mmax);
    const int64_t R = c.G * c.Mmax, N = c.N;
    Quantized a = random_quantized(rng, R, c.K, ScaleKind::tile_1x128);
    Quantized b = random_quantized(rng, c.G * N, c.K, ScaleKind::block_128x128);
    std::vector<double> exact(size_t(R * N), 0.0);
#pragma omp parallel for schedule(dynamic, 16)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t g = r / c.Mmax;
      if (r % c.Mmax < counts[size_t(g)])
        for (int64_t n = 0; n < N; ++n) exact[size_t(r * N + n)] = dot_rows(a.f32, r, b.f32, g * N + n, 0, c.K);
    }
    Tensor cnt = i32_tensor(counts);
    QuantizedTensor ad = to_device(*be_, a.q), bd = to_device(*be_, b.q);
    Tensor cntd = to_device(*be_, cnt);
    for (DType dt : {DType::f32, DType::bf16}) {
      Tensor want = Tensor::host(dt, {R, N});
      cpu_->grouped_gemm_fp8_masked(a.q, b.q, cnt, c.G, want, {});
      Tensor d = poisoned(*be_, dt, R, N);
      be_->grouped_gemm_fp8_masked(ad, bd, cntd, c.G, d, {});
      check_random(be_->to_host(d), want, exact, "masked " + c.str() + " " + std::string(dtype_name(dt)));
    }
  }
}

// The counts are read on the device only: a captured launch replays correctly for new counts.
TEST_F(CudaGroupedGemm, MaskedReplaysFromCudaGraphWithNewCounts) {
  auto rng = make_rng();
  const int64_t G = 3, Mmax = 96, N = 256, K = 256;
  QuantizedTensor a = small_int_quantized(rng, G * Mmax, K, ScaleKind::tile_1x128);
  QuantizedTensor b = small_int_quantized(rng, G * N, K, ScaleKind::block_128x128);
  QuantizedTensor ad = to_device(*be_, a), bd = to_device(*be_, b);
  const std::vector<std::vector<int64_t>> runs{{96, 0, 40}, {10, 96, 0}, {0, 0, 0}};
  Tensor cntd = to_device(*be_, i32_tensor(runs[0]));
  Tensor nan_host = Tensor::host(DType::bf16, {G * Mmax, N});
  std::memset(nan_host.view().data, 0xFF, nan_host.view().nbytes());
  Tensor d = to_device(*be_, nan_host);
  Tensor cnt;
  replay_from_graph(
      [&](cudaStream_t s) { cuda::grouped_gemm_fp8_masked_cuda(ad, bd, cntd, G, d, false, s); }, runs.size(),
      [&](size_t i) {
        cnt = i32_tensor(runs[i]);
        be_->copy(cntd, cnt);
        be_->copy(d, nan_host);
      },
      [&](size_t i) {
        Tensor want = Tensor::host(DType::bf16, {G * Mmax, N});
        cpu_->grouped_gemm_fp8_masked(a, b, cnt, G, want, {});
        expect_same_bits(be_->to_host(d), want,
                         "graph replay, counts " + std::to_string(runs[i][0]) + " " + std::to_string(runs[i][1]) +
                             " " + std::to_string(runs[i][2]));
      });
}

// ---- K-grouped Wgrad ----------------------------------------------------------------------------

struct WgradCase {
  int64_t N, K, R;               // R token columns; offsets[G] <= R
  std::vector<int64_t> offsets;  // G + 1 segment starts, multiples of 128
  std::string str() const {
    std::string s = "N=" + std::to_string(N) + " K=" + std::to_string(K) + " R=" + std::to_string(R) + " offsets";
    for (int64_t o : offsets) s.append(" ").append(std::to_string(o));
    return s;
  }
};

TEST_F(CudaGroupedGemm, WgradSmallIntegersExactForEveryTile) {
  auto rng = make_rng();
  const WgradCase cases[] = {{256, 384, 768, {0, 256, 256, 640}},
                             {200, 136, 384, {0, 384}},
                             {128, 256, 640, {0, 0, 128, 512, 512}},
                             {64, 128, 128, {0, 128}}};
  GemmOptions acc;
  acc.accumulate = true;
  for (const WgradCase& c : cases) {
    const int64_t G = int64_t(c.offsets.size()) - 1;
    // Token columns past offsets[G] hold values too: they must be ignored.
    QuantizedTensor dy = small_int_quantized(rng, c.N, c.R, ScaleKind::tile_1x128);
    QuantizedTensor x = small_int_quantized(rng, c.K, c.R, ScaleKind::tile_1x128);
    Tensor off = i32_tensor(c.offsets);
    QuantizedTensor dyd = to_device(*be_, dy), xd = to_device(*be_, x);
    Tensor offd = to_device(*be_, off);
    Tensor want = Tensor::host(DType::f32, {G * c.N, c.K});
    cpu_->grouped_wgrad_fp8(dy, x, off, want, {});
    // Accumulation: small integers before, NaN on the rows of empty segments (left alone).
    Tensor d0 = Tensor::host(DType::f32, {G * c.N, c.K});
    std::uniform_int_distribution<int> v(-100, 100);
    for (int64_t r = 0; r < G * c.N; ++r) {
      const int64_t g = r / c.N;
      const bool empty = c.offsets[size_t(g)] == c.offsets[size_t(g + 1)];
      for (int64_t k = 0; k < c.K; ++k) d0.ptr<float>()[r * c.K + k] = empty ? kNaN : float(v(rng));
    }
    Tensor want_acc = Tensor::host(DType::f32, {G * c.N, c.K});
    std::memcpy(want_acc.ptr<float>(), d0.ptr<float>(), d0.view().nbytes());
    cpu_->grouped_wgrad_fp8(dy, x, off, want_acc, acc);
    for (const cuda::GemmTile& t : grouped_tiles(true)) {
      Tensor d = poisoned(*be_, DType::f32, G * c.N, c.K);
      cuda::grouped_wgrad_fp8_cuda(dyd, xd, offd, d, false, nullptr, &t);
      expect_same_bits(be_->to_host(d), want, "wgrad " + c.str() + " tile " + cuda::tile_name(t));
      Tensor da = to_device(*be_, d0);
      cuda::grouped_wgrad_fp8_cuda(dyd, xd, offd, da, true, nullptr, &t);
      expect_same_bits(be_->to_host(da), want_acc, "wgrad accumulate " + c.str() + " tile " + cuda::tile_name(t));
    }
  }
}

TEST_F(CudaGroupedGemm, WgradRandomAgainstReference) {
  auto rng = make_rng();
  struct Case {
    int64_t G, mean, N, K;
    std::vector<int64_t> empty;
  };
  const Case cases[] = {{4, 300, 256, 384, {2}}, {1, 500, 128, 200, {}}, {8, 200, 384, 256, {0, 7}}};
  for (const Case& c : cases) {
    const ExpertRows L = expert_rows(random_expert_counts(rng, c.G, c.mean, c.empty), 128);
    const int64_t R = L.rows(), N = c.N, K = c.K;
    // dy [R, N] and x [R, K] token-major, quantized along the tokens to dy_t [N, R], x_t [K, R].
    Tensor dy = random_normal(rng, DType::f32, {R, N}), x = random_normal(rng, DType::f32, {R, K});
    QuantizedTensor dyq = make_quantized_host(N, R, DType::e4m3, ScaleKind::tile_1x128);
    QuantizedTensor xq = make_quantized_host(K, R, DType::e4m3, ScaleKind::tile_1x128);
    quantize_128x1(dy, dyq);
    quantize_128x1(x, xq);
    Tensor dyt = Tensor::host(DType::f32, {N, R}), xt = Tensor::host(DType::f32, {K, R});
    for (int64_t t = 0; t < R; ++t) {
      for (int64_t n = 0; n < N; ++n) dyt.ptr<float>()[n * R + t] = dy.ptr<float>()[t * N + n];
      for (int64_t k = 0; k < K; ++k) xt.ptr<float>()[k * R + t] = x.ptr<float>()[t * K + k];
    }
    std::vector<double> exact(size_t(c.G * N * K));
#pragma omp parallel for schedule(dynamic, 16)
    for (int64_t r = 0; r < c.G * N; ++r) {
      const int64_t g = r / N, n = r % N;
      for (int64_t k = 0; k < K; ++k)
        exact[size_t(r * K + k)] = dot_rows(dyt, n, xt, k, L.offsets[size_t(g)], L.offsets[size_t(g + 1)]);
    }
    Tensor off = i32_tensor(L.offsets);
    Tensor want = Tensor::host(DType::f32, {c.G * N, K});
    cpu_->grouped_wgrad_fp8(dyq, xq, off, want, {});
    Tensor d = poisoned(*be_, DType::f32, c.G * N, K);
    be_->grouped_wgrad_fp8(to_device(*be_, dyq), to_device(*be_, xq), to_device(*be_, off), d, {});
    check_random(be_->to_host(d), want, exact,
                 "wgrad G=" + std::to_string(c.G) + " R=" + std::to_string(R) + " N=" + std::to_string(N) +
                     " K=" + std::to_string(K));
  }
}

// ---- argument checks ----------------------------------------------------------------------------

TEST_F(CudaGroupedGemm, RejectsBadArguments) {
  Backend& be = *be_;
  const int64_t R = 256, K = 256, N = 128, G = 2;
  QuantizedTensor a = be.empty_quantized(R, K, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor b = be.empty_quantized(G * N, K, DType::e4m3, ScaleKind::block_128x128);
  Tensor rg = be.zeros(DType::i32, {R});
  Tensor d = be.zeros(DType::bf16, {R, N});
  GemmOptions acc;
  acc.accumulate = true;
  // Contiguous.
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, rg, 0, d, {}); }, "groups must be positive");
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, rg, 3, d, {}); }, "do not split into 3 groups");
  QuantizedTensor b192 = be.empty_quantized(2 * 192, K, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b192, rg, 2, be.zeros(DType::bf16, {R, 192}), {}); },
               "multiple of 128");
  QuantizedTensor b384 = be.empty_quantized(G * N, 384, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b384, rg, G, d, {}); }, "b: expected K = 256");
  QuantizedTensor a100 = be.empty_quantized(R, 100, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor b100 = be.empty_quantized(G * N, 100, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a100, b100, rg, G, d, {}); }, "multiple of 128");
  QuantizedTensor a_blk = be.empty_quantized(R, K, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a_blk, b, rg, G, d, {}); }, "a: expected 1x128 scales");
  QuantizedTensor b_1x = be.empty_quantized(G * N, K, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b_1x, rg, G, d, {}); }, "b: expected 128x128 scales");
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, be.zeros(DType::f32, {R}), G, d, {}); },
               "row_group must be a contiguous 1-D i32");
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, be.zeros(DType::i32, {R - 1}), G, d, {}); },
               "row_group must have 256 entries");
  Tensor rg_host = Tensor::host(DType::i32, {R});
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, rg_host, G, d, {}); }, "row_group must be on the GPU");
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, rg, G, be.zeros(DType::bf16, {R, N + 8}), {}); },
               "d: expected shape");
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, rg, G, d, acc); }, "accumulate needs an f32");
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, rg, G, be.zeros(DType::f64, {R, N}), {}); },
               "d: expected f32 or bf16");
  for (const cuda::GemmTile& t : {cuda::GemmTile{256, 128, false}, cuda::GemmTile{128, 128, true, 2}})
    expect_error([&] { cuda::grouped_gemm_fp8_contiguous_cuda(a, b, rg, G, d, false, nullptr, &t); }, "unsupported");
  GemmOptions odd;  // a promotion interval that is no multiple of 32
  odd.accum.mode = AccumMode::tensor_core;
  odd.accum.promote_every = 48;
  expect_error([&] { be.grouped_gemm_fp8_contiguous(a, b, rg, G, d, odd); }, "promote_every");
  // Masked.
  Tensor cnt = be.zeros(DType::i32, {G});
  expect_error([&] { be.grouped_gemm_fp8_masked(a, b, cnt, G, be.zeros(DType::f32, {R, N}), acc); },
               "accumulate is unsupported");
  QuantizedTensor a255 = be.empty_quantized(255, K, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { be.grouped_gemm_fp8_masked(a255, b, cnt, G, be.zeros(DType::bf16, {255, N}), {}); },
               "do not split into 2 groups of M_max");
  expect_error([&] { be.grouped_gemm_fp8_masked(a, b, be.zeros(DType::i32, {G + 1}), G, d, {}); },
               "counts must have 2 entries");
  expect_error([&] { be.grouped_gemm_fp8_masked(a, b, be.zeros(DType::i64, {G}), G, d, {}); },
               "counts must be a contiguous 1-D i32");
  // K-grouped Wgrad: dy_t [N, R], x_t [K, R].
  QuantizedTensor dy = be.empty_quantized(N, R, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor x = be.empty_quantized(K, R, DType::e4m3, ScaleKind::tile_1x128);
  Tensor off = be.zeros(DType::i32, {G + 1});
  Tensor dw = be.zeros(DType::f32, {G * N, K});
  QuantizedTensor x384 = be.empty_quantized(K, 384, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { be.grouped_wgrad_fp8(dy, x384, off, dw, {}); }, "x_t: 384 token columns");
  QuantizedTensor dy200 = be.empty_quantized(N, 200, DType::e4m3, ScaleKind::tile_1x128);
  QuantizedTensor x200 = be.empty_quantized(K, 200, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { be.grouped_wgrad_fp8(dy200, x200, off, dw, {}); }, "multiple of 128");
  expect_error([&] { be.grouped_wgrad_fp8(dy, x, be.zeros(DType::i32, {1}), dw, {}); }, "G + 1 >= 2");
  expect_error([&] { be.grouped_wgrad_fp8(dy, x, be.zeros(DType::f32, {G + 1}), dw, {}); },
               "offsets must be a contiguous 1-D i32");
  expect_error([&] { be.grouped_wgrad_fp8(dy, x, off, be.zeros(DType::bf16, {G * N, K}), {}); }, "must be f32");
  expect_error([&] { be.grouped_wgrad_fp8(dy, x, off, be.zeros(DType::f32, {N, K}), {}); }, "d: expected shape");
  QuantizedTensor x_blk = be.empty_quantized(K, R, DType::e4m3, ScaleKind::block_128x128);
  expect_error([&] { be.grouped_wgrad_fp8(dy, x_blk, off, dw, {}); }, "x_t: expected 1x128 scales");
  Tensor off_host = Tensor::host(DType::i32, {G + 1});
  expect_error([&] { be.grouped_wgrad_fp8(dy, x, off_host, dw, {}); }, "offsets must be on the GPU");
}

}  // namespace
}  // namespace fp8moe::testing
