// The low-latency mode of the expert-parallel kernels (src/cuda/ep/ep_low_latency.cu) against its
// host reference (src/parallel/runtime/ep_reference.hpp) and the CPU backend's moe_combine, byte
// for byte: P ranks as P buffers on one GPU, one stream each, for 2, 4 and 8 ranks, top-8 of 256
// experts, hidden 256 to 7168, 1 to 128 tokens per rank, ranks with no tokens, experts with none,
// several steps on one group; the received masked layout (counts, per-source counts, FP8 rows,
// group-major scales, source slots) and the combined sums, outputs poisoned first. Dispatch and
// combine captured in one CUDA graph per rank and replayed with new data give the same results
// (no host synchronization inside), before and after eager steps on the same group. Bad input
// (too many tokens, a buffer too small, the other mode's calls, ids out of range, an expert listed
// twice past the buffer) and a peer that never joins fail with fp8moe::Error. The received layout
// fed to the masked grouped GEMM gives the CPU's bits. Skips without a GPU (the GEMM: without sm_90).
// Run: build/tests/cuda/test_cuda_ep_low_latency (FP8MOE_SEED=<n> replays a seed).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cuda/ep/ep_api.hpp"
#include "cuda_test_util.hpp"
#include "ep_masked_testing.hpp"
#include "fp8moe/error.hpp"
#include "moe_routing.hpp"
#include "parallel/runtime/ep_reference.hpp"

namespace fp8moe::testing {
namespace {

using cuda::ep::EpConfig;
using cuda::ep::EpGroup;

// Several ranks in this process: set before the first CUDA call (ep_api.hpp).
const bool kLocalRanks = (cuda::ep::prepare_local_ranks(), true);

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count, int byte = 0) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, byte, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  void upload(const std::vector<T>& h) {
    ASSERT_LE(h.size(), n);
    if (h.empty()) return;
    EXPECT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> host(size_t count) const {
    std::vector<T> h(count);
    if (count > 0) {
      EXPECT_EQ(cudaMemcpy(h.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
  TensorView view(DType dt, int64_t rows, int64_t cols) const { return TensorView(p, dt, {rows, cols}, Device::cuda); }
};

template <class T>
std::vector<T> device_to_host(const void* p, size_t n) {
  std::vector<T> h(n);
  if (n > 0) {
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return h;
}

constexpr int64_t kExperts = 256, kTopk = 8;

uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return uint16_t(b >> 16);
}

struct LlCase {
  int ranks = 2;
  int64_t max_tokens = 128;  // N
  int64_t hidden = 512;
  std::vector<int64_t> tokens;  // per rank, <= N
  double skew = 0;
  std::vector<int64_t> empty;  // experts never chosen
  int steps = 2;
  int num_sms = 20;
};

std::string describe(const LlCase& c) {
  std::string s = std::to_string(c.ranks) + " ranks, N " + std::to_string(c.max_tokens) + ", D " +
                  std::to_string(c.hidden) + ", num_sms " + std::to_string(c.num_sms) + ", tokens";
  for (int64_t t : c.tokens) s += " " + std::to_string(t);
  return s + ", skew " + std::to_string(c.skew) + ", " + std::to_string(c.empty.size()) + " empty experts";
}

// One rank's device inputs and outputs, sized for N tokens (reused by every step, and by graphs).
struct RankDev {
  std::unique_ptr<Dev<int32_t>> idx;
  std::unique_ptr<Dev<float>> w, scales, out;
  std::unique_ptr<Dev<uint8_t>> x;
  std::unique_ptr<Dev<uint16_t>> rows;  // [E_l * M, D] the experts' outputs, masked layout
};

// The whole setting of one test: the group, the device buffers, each step's inputs on the host.
struct LlHarness {
  LlCase cs;
  int P;
  int64_t D, G, k = kTopk, epr, N, M, R;
  std::unique_ptr<EpGroup> group;
  std::vector<RankDev> dev;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::mt19937_64 rng;
  // FP8 codes of integers in [-6, 6] and scales in {1/2, 1, 2} (exact GEMMs), instead of any byte
  // and scales in 2^[-3, 3].
  bool small_ints = false;

  // This step's inputs and the experts' rows (host).
  std::vector<ep::RankTokens> src;
  std::vector<std::vector<uint16_t>> rows;  // [P][R * D]
  std::vector<std::vector<float>> start;    // [P][T * D] out before the combine

  explicit LlHarness(const LlCase& c) : cs(c), P(c.ranks), rng(make_rng()) {
    D = c.hidden, G = D / 128, epr = kExperts / P, N = c.max_tokens, M = P * N, R = epr * M;
    EpConfig cfg;
    cfg.ranks = P;
    cfg.max_tokens = N;
    cfg.hidden = D;
    cfg.topk = k;
    cfg.experts = kExperts;
    cfg.num_sms = c.num_sms;
    cfg.low_latency = true;
    group = EpGroup::local(cfg);
    dev.resize(size_t(P));
    for (auto& r : dev) {
      r.idx = std::make_unique<Dev<int32_t>>(size_t(N * k));
      r.w = std::make_unique<Dev<float>>(size_t(N * k));
      r.x = std::make_unique<Dev<uint8_t>>(size_t(N * D));
      r.scales = std::make_unique<Dev<float>>(size_t(G * scale_ld(N)));
      r.out = std::make_unique<Dev<float>>(size_t(N * D));
      r.rows = std::make_unique<Dev<uint16_t>>(size_t(R * D), 0xFF);  // NaN past the counts
    }
    rows.assign(size_t(P), std::vector<uint16_t>(size_t(R * D), 0));
  }

  int64_t T(int p) const { return cs.tokens[size_t(p)]; }

  // New routing, rows and scales for every rank, uploaded. full_rows: every expert row random
  // (the rows a graph's combine reads are fixed before the routing is known), else only those
  // below the counts.
  void new_inputs(bool full_rows) {
    std::uniform_int_distribution<int> byte(0, 255), ex(small_ints ? -1 : -3, small_ints ? 1 : 3), small(-6, 6);
    std::uniform_real_distribution<float> u(0.01f, 1.0f), val(-4.0f, 4.0f);
    src.assign(size_t(P), {});
    for (int p = 0; p < P; ++p) {
      ep::RankTokens& s = src[size_t(p)];
      s.tokens = T(p);
      RoutingSpec rs;
      rs.tokens = s.tokens;
      rs.topk = k;
      rs.groups = kExperts;
      rs.skew = cs.skew;
      rs.empty = cs.empty;
      const Tensor ids = random_routing(rng, rs);
      s.idx.assign(ids.ptr<int32_t>(), ids.ptr<int32_t>() + s.tokens * k);
      for (int64_t i = 0; i < s.tokens * k; ++i) s.w.push_back(u(rng));
      for (int64_t i = 0; i < s.tokens * D; ++i)
        s.x.push_back(small_ints ? e4m3_encode(float(small(rng))) : uint8_t(byte(rng)));
      for (int64_t i = 0; i < s.tokens * G; ++i) s.scales.push_back(std::ldexp(1.0f, ex(rng)));
      const int64_t ld = scale_ld(s.tokens);
      std::vector<float> sc(size_t(G * ld), -7.0f);  // padding columns poisoned
      for (int64_t t = 0; t < s.tokens; ++t)
        for (int64_t g = 0; g < G; ++g) sc[size_t(g * ld + t)] = s.scales[size_t(t * G + g)];
      RankDev& r = dev[size_t(p)];
      r.idx->upload(s.idx);
      r.w->upload(s.w);
      r.x->upload(s.x);
      r.scales->upload(sc);
    }
    // The experts' rows: random below each expert's count (or everywhere), NaN on the device past it.
    std::vector<int64_t> count(size_t(kExperts), 0);
    for (const auto& s : src)
      for (int32_t x : s.idx) ++count[size_t(x)];
    for (int d = 0; d < P; ++d) {
      std::vector<uint16_t>& h = rows[size_t(d)];
      for (int64_t e = 0; e < epr; ++e) {
        const int64_t n = full_rows ? M : count[size_t(d * epr + e)];
        for (int64_t i = (e * M) * D; i < (e * M + n) * D; ++i) h[size_t(i)] = bf16_bits(val(rng));
        if (n > 0) {
          ASSERT_EQ(cudaMemcpy(dev[size_t(d)].rows->p + e * M * D, h.data() + e * M * D, size_t(n * D) * 2,
                               cudaMemcpyHostToDevice),
                    cudaSuccess);
        }
      }
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  // Poisons what the dispatch writes and the combine's outputs (start: NaN, or random to accumulate on).
  void poison(bool accumulate) {
    std::uniform_real_distribution<float> val(-4.0f, 4.0f);
    start.assign(size_t(P), {});
    for (int p = 0; p < P; ++p) {
      const auto r = group->rank(p).low_latency_received();
      ASSERT_EQ(cudaMemset(r.x.values.data, 0x5A, size_t(R * D)), cudaSuccess);
      ASSERT_EQ(cudaMemset(r.x.scales.data, 0xFF, size_t(G * scale_ld(R)) * 4), cudaSuccess);
      ASSERT_EQ(cudaMemset(r.counts.data, 0xFF, size_t(epr) * 4), cudaSuccess);
      ASSERT_EQ(cudaMemset(r.src_counts.data, 0xFF, size_t(epr * P) * 4), cudaSuccess);
      ASSERT_EQ(cudaMemset(r.src_slot.data, 0xFF, size_t(R) * 4), cudaSuccess);
      for (int64_t i = 0; i < T(p) * D; ++i) start[size_t(p)].push_back(accumulate ? val(rng) : std::nanf(""));
      dev[size_t(p)].out->upload(start[size_t(p)]);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  QuantizedView x_view(int p) const {
    const RankDev& r = dev[size_t(p)];
    return QuantizedView{r.x->view(DType::e4m3, T(p), D), r.scales->view(DType::f32, G, scale_ld(T(p))),
                         ScaleKind::tile_1x128};
  }
  void dispatch(int p, bool hook = false) {
    group->rank(p).low_latency_dispatch(x_view(p), dev[size_t(p)].idx->view(DType::i32, T(p), k), hook);
  }
  void combine(int p, bool weighted, bool accumulate, bool hook = false) {
    const RankDev& r = dev[size_t(p)];
    group->rank(p).low_latency_combine(r.rows->view(DType::bf16, R, D),
                                       weighted ? r.w->view(DType::f32, T(p), k) : TensorView(),
                                       r.out->view(DType::f32, T(p), D), accumulate, hook);
  }

  void expect_dispatched() {
    const auto want = ep::reference_low_latency_dispatch(src, k, epr, D, G);
    for (int d = 0; d < P; ++d) {
      SCOPED_TRACE("rank " + std::to_string(d));
      const auto r = group->rank(d).low_latency_received();
      ASSERT_EQ(r.rows_per_expert, M);
      const auto counts = device_to_host<int32_t>(r.counts.data, size_t(epr));
      const auto src_counts = device_to_host<int32_t>(r.src_counts.data, size_t(epr * P));
      const auto slots = device_to_host<int32_t>(r.src_slot.data, size_t(R));
      const int64_t ld = scale_ld(R);
      const auto scales = device_to_host<float>(r.x.scales.data, size_t(G * ld));
      int64_t bad_count = -1, bad_rows = -1, bad_scale = -1, bad_slot = -1;
      for (int64_t e = 0; e < epr; ++e) {
        const ep::LowLatencyExpert& ref = want[size_t(d)][size_t(e)];
        const int64_t n = int64_t(ref.src_slot.size());
        bool ok = counts[size_t(e)] == n;
        for (int q = 0; q < P; ++q) ok &= src_counts[size_t(e * P + q)] == ref.src_counts[size_t(q)];
        if (!ok && bad_count < 0) bad_count = e;
        if (!ok) continue;
        const auto x = device_to_host<uint8_t>(static_cast<uint8_t*>(r.x.values.data) + e * M * D, size_t(n * D));
        if (std::memcmp(x.data(), ref.x.data(), x.size()) != 0 && bad_rows < 0) bad_rows = e;
        for (int64_t i = 0; i < n; ++i) {
          if (slots[size_t(e * M + i)] != ref.src_slot[size_t(i)] && bad_slot < 0) bad_slot = e;
          for (int64_t g = 0; g < G; ++g)
            if (std::memcmp(&scales[size_t(g * ld + e * M + i)], &ref.scales[size_t(i * G + g)], 4) != 0 &&
                bad_scale < 0)
              bad_scale = e;
        }
      }
      EXPECT_EQ(bad_count, -1) << "counts per expert and source (first bad local expert)";
      EXPECT_EQ(bad_rows, -1) << "FP8 rows (first bad local expert)";
      EXPECT_EQ(bad_scale, -1) << "scales, group-major (first bad local expert)";
      EXPECT_EQ(bad_slot, -1) << "source slots (first bad local expert)";
      int64_t bad_pad = -1;  // scale padding columns past the E_l * M rows: 1
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = R; i < ld; ++i)
          if (scales[size_t(g * ld + i)] != 1.0f && bad_pad < 0) bad_pad = g;
      EXPECT_EQ(bad_pad, -1) << "scale padding";
    }
  }

  void expect_combined(bool weighted, bool accumulate) {
    for (int p = 0; p < P; ++p) {
      SCOPED_TRACE("source " + std::to_string(p));
      const int64_t Tp = T(p);
      std::vector<float> ref = start[size_t(p)];
      if (Tp > 0) {
        std::vector<uint16_t> back = ep::reference_low_latency_combine_rows(src, rows, p, k, epr, M, D);
        std::vector<int32_t> slot_row(size_t(Tp * k));
        for (int64_t i = 0; i < Tp * k; ++i) slot_row[size_t(i)] = int32_t(i);
        TensorView y(back.data(), DType::bf16, {Tp * k, D});
        TensorView sr(slot_row.data(), DType::i32, {Tp, k});
        TensorView wv(src[size_t(p)].w.data(), DType::f32, {Tp, k});
        TensorView o(ref.data(), DType::f32, {Tp, D});
        cpu->moe_combine(y, sr, weighted ? wv : TensorView(), o, accumulate);
      }
      const auto got = dev[size_t(p)].out->host(size_t(Tp * D));
      EXPECT_EQ(std::memcmp(got.data(), ref.data(), ref.size() * 4), 0) << "combined rows";
    }
  }

  void check_all() {
    for (int p = 0; p < P; ++p) group->rank(p).check();
  }

  // `step(p)` (a dispatch and a weighted combine of rank p) captured in one graph per rank, then
  // replayed twice with new inputs, every result checked.
  void graph_steps(const std::function<void(int)>& step) {
    std::vector<cudaGraphExec_t> exec(static_cast<size_t>(P));
    for (int p = 0; p < P; ++p) {
      cudaStream_t s = group->rank(p).stream();
      ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
      step(p);
      cudaGraph_t graph;
      ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&exec[size_t(p)], graph, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    }
    for (int replay = 0; replay < 2; ++replay) {
      SCOPED_TRACE("replay " + std::to_string(replay));
      new_inputs(true);
      poison(false);
      for (int p = 0; p < P; ++p) ASSERT_EQ(cudaGraphLaunch(exec[size_t(p)], group->rank(p).stream()), cudaSuccess);
      check_all();
      expect_dispatched();
      expect_combined(true, false);
    }
    for (auto e : exec) ASSERT_EQ(cudaGraphExecDestroy(e), cudaSuccess);
  }

  // One eager step: new inputs, dispatch (checked), then a weighted combine and an unweighted one
  // accumulated onto random values.
  void eager_step() {
    new_inputs(false);
    poison(false);
    for (int p = 0; p < P; ++p) dispatch(p);
    check_all();
    expect_dispatched();
    for (int pass = 0; pass < 2; ++pass) {
      SCOPED_TRACE(pass == 0 ? "weighted combine" : "unweighted, accumulated");
      if (pass == 1) {
        std::uniform_real_distribution<float> val(-4.0f, 4.0f);
        for (int p = 0; p < P; ++p) {
          start[size_t(p)].clear();
          for (int64_t i = 0; i < T(p) * D; ++i) start[size_t(p)].push_back(val(rng));
          dev[size_t(p)].out->upload(start[size_t(p)]);
        }
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      for (int p = 0; p < P; ++p) combine(p, pass == 0, pass == 1);
      check_all();
      expect_combined(pass == 0, pass == 1);
    }
  }
};

void run_case(const LlCase& cs) {
  SCOPED_TRACE(describe(cs));
  LlHarness h(cs);
  for (int step = 0; step < cs.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    h.eager_step();
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(CudaEpLowLatency, TwoRanksFullHidden) {
  FP8MOE_REQUIRE_GPU();
  run_case({2, 128, 7168, {128, 77}, 0, {}, 2});
}

TEST(CudaEpLowLatency, TwoRanksOneTokenAndSkewed) {
  FP8MOE_REQUIRE_GPU();
  run_case({2, 16, 512, {1, 16}, 1.5, {}, 3});
}

TEST(CudaEpLowLatency, FourRanksFullHiddenWithEmptyExpertsAndASilentRank) {
  FP8MOE_REQUIRE_GPU();
  // Rank 1 sends nothing; experts 0..63 (all of rank 0's) and a few others never chosen.
  std::vector<int64_t> empty;
  for (int64_t e = 0; e < 64; ++e) empty.push_back(e);
  for (int64_t e : {100, 101, 200, 255}) empty.push_back(e);
  run_case({4, 64, 7168, {64, 0, 33, 1}, 1.0, empty, 2});
}

TEST(CudaEpLowLatency, EightRanks128Tokens) {
  FP8MOE_REQUIRE_GPU();
  run_case({8, 128, 256, {128, 1, 0, 127, 64, 128, 3, 100}, 0.5, {7, 8, 9}, 3});
}

TEST(CudaEpLowLatency, EightRanksFewBlocksAndAllSilentButOne) {
  FP8MOE_REQUIRE_GPU();
  LlCase c{8, 32, 384, {0, 0, 0, 32, 0, 0, 0, 0}, 0, {}, 2};
  c.num_sms = 2;  // each warp serves several experts, each block several local experts
  run_case(c);
}

TEST(CudaEpLowLatency, FourRanksNoTokensAnywhere) {
  FP8MOE_REQUIRE_GPU();
  run_case({4, 8, 256, {0, 0, 0, 0}, 0, {}, 2});
}

// Dispatch and combine of each rank captured in a graph on its stream, replayed twice with new
// routing, rows and scales in the same buffers, between eager steps of the same group: the step
// numbers the kernels wait for come from the device, and nothing in them waits for the host.
TEST(CudaEpLowLatency, CapturedGraphReplaysWithNewData) {
  FP8MOE_REQUIRE_GPU();
  LlCase c{4, 32, 256, {32, 0, 17, 5}, 0.5, {}, 0};
  LlHarness h(c);
  h.eager_step();
  ASSERT_FALSE(::testing::Test::HasFailure());
  h.graph_steps([&](int p) {
    h.dispatch(p);
    h.combine(p, true, false);
  });
  h.eager_step();
}

// With the receive hook, every rank's send launch runs first, then other work on the rank's
// stream (it overwrites a scratch buffer), then the receive launch: the same bits as one launch,
// eagerly and captured in a graph with the hooks inside it.
TEST(CudaEpLowLatency, ReceiveHookCompletesTheStepLater) {
  FP8MOE_REQUIRE_GPU();
  LlCase c{4, 32, 512, {32, 0, 17, 5}, 0.5, {}, 0};
  LlHarness h(c);
  Dev<uint8_t> scratch(size_t(64) << 20);
  auto other_work = [&](int p) {
    ASSERT_EQ(cudaMemsetAsync(scratch.p, p, size_t(64) << 20, h.group->rank(p).stream()), cudaSuccess);
  };
  auto hooked_step = [&](bool weighted, bool accumulate) {
    for (int p = 0; p < h.P; ++p) h.dispatch(p, true);
    for (int p = 0; p < h.P; ++p) EXPECT_TRUE(h.group->rank(p).receive_pending());
    for (int p = 0; p < h.P; ++p) other_work(p);
    for (int p = 0; p < h.P; ++p) h.group->rank(p).low_latency_receive();
    h.check_all();
    h.expect_dispatched();
    for (int p = 0; p < h.P; ++p) h.combine(p, weighted, accumulate, true);
    for (int p = 0; p < h.P; ++p) other_work(p);
    for (int p = 0; p < h.P; ++p) h.group->rank(p).low_latency_receive();
    h.check_all();
    h.expect_combined(weighted, accumulate);
  };
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("eager step " + std::to_string(step));
    h.new_inputs(false);
    h.poison(step == 1);
    hooked_step(step == 0, step == 1);
    ASSERT_FALSE(::testing::Test::HasFailure());
  }
  h.eager_step();  // one-launch steps after hooked ones
  h.graph_steps([&](int p) {
    h.dispatch(p, true);
    other_work(p);
    h.group->rank(p).low_latency_receive();
    h.combine(p, true, false, true);
    other_work(p);
    h.group->rank(p).low_latency_receive();
  });
  // While a receive is pending, the rank refuses every other low-latency call, and loses nothing.
  h.new_inputs(false);
  h.poison(false);
  for (int p = 0; p < h.P; ++p) h.dispatch(p, true);
  expect_error([&] { h.dispatch(0, true); }, "dispatch queued with a hook has not been received");
  expect_error([&] { h.group->rank(0).low_latency_received(); }, "has not been received");
  expect_error([&] { h.combine(0, true, false); }, "has not been received");
  for (int p = 0; p < h.P; ++p) h.group->rank(p).low_latency_receive();
  h.check_all();
  h.expect_dispatched();
}

// The received layout is the masked grouped GEMM's A: the CUDA GEMM on a rank's received rows,
// scales and device counts gives the bits of the CPU masked GEMM on the reference's rows laid out
// the same way (small integers: exact), with the rows past each count left poisoned.
TEST(CudaEpLowLatency, ReceivedLayoutFeedsTheMaskedGroupedGemm) {
  FP8MOE_REQUIRE_SM90();
  LlHarness h(LlCase{2, 64, 256, {64, 23}, 0.5, {}, 0});
  h.small_ints = true;
  h.new_inputs(false);
  h.poison(false);
  for (int p = 0; p < h.P; ++p) h.dispatch(p);
  h.check_all();
  h.expect_dispatched();
  auto be = make_cuda_backend();
  const int64_t F = 128, epr = h.epr, M = h.M, R = h.R, D = h.D, G = h.G;
  const QuantizedTensor b = small_int_quantized(h.rng, epr * F, D, ScaleKind::block_128x128);
  const QuantizedTensor bd = to_device(*be, b);
  const auto want = ep::reference_low_latency_dispatch(h.src, h.k, epr, D, G);
  for (int d = 0; d < h.P; ++d) {
    SCOPED_TRACE("rank " + std::to_string(d));
    const MaskedRows mr = masked_rows(want[size_t(d)], M, D);
    Tensor expect = Tensor::host(DType::f32, {R, F});
    h.cpu->grouped_gemm_fp8_masked(mr.a, b, mr.counts, epr, expect, {});
    const auto r = h.group->rank(d).low_latency_received();
    Tensor got = be->zeros(DType::f32, {R, F});
    be->grouped_gemm_fp8_masked(r.x, bd, r.counts, epr, got, {});
    EXPECT_EQ(first_mismatch(be->to_host(got), expect), -1) << "masked grouped GEMM on the received layout";
  }
}

EpConfig small_config(int ranks) {
  EpConfig c;
  c.ranks = ranks;
  c.max_tokens = 4;
  c.hidden = 256;
  c.topk = kTopk;
  c.experts = kExperts;
  c.num_sms = 4;
  c.low_latency = true;
  return c;
}

TEST(CudaEpLowLatency, BadInputIsRefused) {
  FP8MOE_REQUIRE_GPU();
  EpConfig c = small_config(2);
  const size_t need = cuda::ep::buffer_layout(c).total;
  c.buffer_bytes = need - 1;
  expect_error([&] { EpGroup::local(c); }, "low-latency buffer of");
  c.buffer_bytes = need;
  EXPECT_NO_THROW(EpGroup::local(c));
  c = small_config(2);
  c.pull_combine = true;
  expect_error([&] { EpGroup::local(c); }, "pull_combine is an option of the normal mode");

  auto g = EpGroup::local(small_config(2));
  Dev<int32_t> idx(size_t(5 * kTopk));
  Dev<uint8_t> x(size_t(5 * 256));
  Dev<float> sc(size_t(2 * 8)), out(size_t(5 * 256));
  QuantizedView q5{x.view(DType::e4m3, 5, 256), sc.view(DType::f32, 2, 8), ScaleKind::tile_1x128};
  expect_error([&] { g->rank(0).low_latency_dispatch(q5, idx.view(DType::i32, 5, kTopk)); },
               "5 tokens above the buffer's 4 per rank");
  expect_error([&] { g->rank(0).low_latency_combine(TensorView(), TensorView(), out.view(DType::f32, 4, 256), false); },
               "no low-latency dispatch before it");
  expect_error([&] { g->rank(0).notify(idx.view(DType::i32, 4, kTopk)); }, "made for the low-latency mode");
  expect_error([&] { g->rank(0).low_latency_receive(); }, "no dispatch or combine was queued with a hook");
  EpConfig normal = small_config(2);
  normal.low_latency = false;
  auto gn = EpGroup::local(normal);
  QuantizedView q4{x.view(DType::e4m3, 4, 256), sc.view(DType::f32, 2, 4), ScaleKind::tile_1x128};
  expect_error([&] { gn->rank(0).low_latency_dispatch(q4, idx.view(DType::i32, 4, kTopk)); }, "made for the normal mode");
}

// Runs one low-latency dispatch on every rank of a 2-rank group, rank 0 with `ids0`, rank 1 with
// valid ids, and expects rank 0's check to throw `needle` and rank 1's to pass.
void expect_dispatch_error(const std::vector<int32_t>& ids0, const std::string& needle) {
  auto g = EpGroup::local(small_config(2));
  const int64_t T = int64_t(ids0.size()) / kTopk;
  std::vector<int32_t> ok_ids(size_t(T * kTopk));
  for (size_t i = 0; i < ok_ids.size(); ++i) ok_ids[i] = int32_t((i * 37) % kExperts);
  Dev<int32_t> bad(ids0.size()), ok(ok_ids.size());
  bad.upload(ids0);
  ok.upload(ok_ids);
  Dev<uint8_t> x(size_t(T * 256));
  Dev<float> sc(size_t(2 * scale_ld(T)));
  QuantizedView q{x.view(DType::e4m3, T, 256), sc.view(DType::f32, 2, scale_ld(T)), ScaleKind::tile_1x128};
  g->rank(0).low_latency_dispatch(q, bad.view(DType::i32, T, kTopk));
  g->rank(1).low_latency_dispatch(q, ok.view(DType::i32, T, kTopk));
  expect_error([&] { g->rank(0).check(); }, needle);
  EXPECT_NO_THROW(g->rank(1).check());
  expect_error([&] { g->rank(0).low_latency_dispatch(q, ok.view(DType::i32, T, kTopk)); }, "cannot be used again");
}

TEST(CudaEpLowLatency, ExpertIdOutOfRangeIsReported) {
  FP8MOE_REQUIRE_GPU();
  std::vector<int32_t> ids(size_t(4 * kTopk));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
  ids[9] = 256;  // token 1, slot 1
  expect_dispatch_error(ids, "ep low-latency dispatch on rank 0: idx[1, 1] outside [0, 256)");
}

TEST(CudaEpLowLatency, MoreRowsForAnExpertThanTheBufferIsReported) {
  FP8MOE_REQUIRE_GPU();
  // Every slot of 4 tokens names expert 5: 32 rows for one (expert, source) region of N = 4.
  std::vector<int32_t> ids(size_t(4 * kTopk), 5);
  expect_dispatch_error(ids, "ep low-latency dispatch on rank 0: 32 slots for expert 5, above the buffer's 4 rows");
}

TEST(CudaEpLowLatency, APeerThatNeverJoinsTimesOut) {
  FP8MOE_REQUIRE_GPU();
  EpConfig c = small_config(4);
  c.timeout_s = 0.2;
  auto g = EpGroup::local(c);
  std::vector<int32_t> ids(size_t(4 * kTopk));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i * 37 % kExperts);
  Dev<int32_t> d(ids.size());
  d.upload(ids);
  Dev<uint8_t> x(size_t(4 * 256));
  Dev<float> sc(size_t(2 * 4));
  QuantizedView q{x.view(DType::e4m3, 4, 256), sc.view(DType::f32, 2, 4), ScaleKind::tile_1x128};
  for (int p = 0; p < 3; ++p) g->rank(p).low_latency_dispatch(q, d.view(DType::i32, 4, kTopk));  // rank 3 never does
  for (int p = 0; p < 3; ++p)
    expect_error([&] { g->rank(p).check(); },
                 "ep low-latency dispatch on rank " + std::to_string(p) + ": timed out after 0.2 s waiting for rank 3");
}

}  // namespace
}  // namespace fp8moe::testing
