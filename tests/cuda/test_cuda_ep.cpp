// The expert-parallel kernels over peer memory (src/cuda/ep/) against the host reference of the
// Comm path (src/parallel/runtime/ep_reference.hpp, built on its dispatch layout) and the CPU
// backend's moe_combine, byte for byte: P ranks as P buffers on one GPU, one stream each, for 2,
// 4 and 8 ranks, top-8 of 256 experts, uniform and skewed loads, experts and whole ranks with no
// tokens, ranks that send nothing, several channel counts, the two-hop dispatch over nodes of 1, 2
// and 4 ranks, and several steps in a row on one group (the step counters and the buffers' reuse). Outputs are poisoned before every step. Bad
// arguments and a peer that never joins fail with fp8moe::Error, the latter after the timeout.
// Skips without a GPU. Run: build/tests/cuda/test_cuda_ep (FP8MOE_SEED=<n> replays a seed).
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cuda/ep/ep_api.hpp"
#include "cuda_test_util.hpp"
#include "fp8moe/error.hpp"
#include "moe_routing.hpp"
#include "parallel/runtime/ep_reference.hpp"

namespace fp8moe::testing {
namespace {

using cuda::ep::EpConfig;
using cuda::ep::EpGroup;

// Several ranks in this process: set before the first CUDA call (ep_api.hpp).
const bool kLocalRanks = (cuda::ep::prepare_local_ranks(), true);

// A device allocation of n elements of T, filled from the host or with a byte.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count, int byte = 0) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, byte, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) {
    EXPECT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  std::vector<T> host() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  TensorView view(DType dt, int64_t rows, int64_t cols) const { return TensorView(p, dt, {rows, cols}, Device::cuda); }
};

template <class T>
std::vector<T> device_to_host(const void* p, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

struct Case {
  int ranks = 2;
  int num_sms = 20;
  int64_t hidden = 512;
  std::vector<int64_t> tokens;  // per rank
  double skew = 0;
  std::vector<int64_t> empty;   // experts never chosen
  int steps = 2;                // routings run one after the other on one group
  bool pull = false;            // EpConfig::pull_combine
  int ranks_per_node = 0;       // EpConfig::ranks_per_node: below `ranks`, the two-hop dispatch
};

std::string describe(const Case& c) {
  std::string s = std::to_string(c.ranks) + " ranks, num_sms " + std::to_string(c.num_sms) + ", D " +
                  std::to_string(c.hidden) + ", tokens";
  for (int64_t t : c.tokens) s += " " + std::to_string(t);
  return s + ", skew " + std::to_string(c.skew) + ", " + std::to_string(c.empty.size()) + " empty experts" +
         (c.pull ? ", pull combine" : "") +
         (c.ranks_per_node ? ", " + std::to_string(c.ranks_per_node) + " ranks per node" : "");
}

constexpr int64_t kExperts = 256, kTopk = 8;

void run_case(const Case& cs) {
  SCOPED_TRACE(describe(cs));
  std::mt19937_64 rng = make_rng();
  const int P = cs.ranks;
  const int64_t D = cs.hidden, G = D / 128, k = kTopk, epr = kExperts / P;
  int64_t T_max = 1;
  for (int64_t t : cs.tokens) T_max = std::max(T_max, t);
  EpConfig cfg;
  cfg.ranks = P;
  cfg.max_tokens = T_max;
  cfg.hidden = D;
  cfg.topk = k;
  cfg.experts = kExperts;
  cfg.num_sms = cs.num_sms;
  cfg.pull_combine = cs.pull;
  cfg.ranks_per_node = cs.ranks_per_node;
  auto group = EpGroup::local(cfg);
  auto cpu = make_cpu_backend();
  std::uniform_int_distribution<int> byte(0, 255), e(-3, 3);
  std::uniform_real_distribution<float> u(0.01f, 1.0f), val(-4.0f, 4.0f);

  for (int step = 0; step < cs.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // The tokens of every rank.
    std::vector<ep::RankTokens> src(static_cast<size_t>(P));
    std::vector<ep::DispatchLayout> layouts;
    for (int p = 0; p < P; ++p) {
      ep::RankTokens& s = src[size_t(p)];
      s.tokens = cs.tokens[size_t(p)];
      RoutingSpec rs;
      rs.tokens = s.tokens;
      rs.topk = k;
      rs.groups = kExperts;
      rs.skew = cs.skew;
      rs.empty = cs.empty;
      const Tensor ids = random_routing(rng, rs);
      s.idx.assign(ids.ptr<int32_t>(), ids.ptr<int32_t>() + s.tokens * k);
      for (int64_t i = 0; i < s.tokens * k; ++i) s.w.push_back(u(rng));
      for (int64_t i = 0; i < s.tokens * D; ++i) s.x.push_back(uint8_t(byte(rng)));
      for (int64_t i = 0; i < s.tokens * G; ++i) s.scales.push_back(std::ldexp(1.0f, e(rng)));
      layouts.push_back(ep::dispatch_layout(s.idx.data(), s.tokens, k, P, epr));
    }
    const std::vector<ep::RankReceived> want = ep::reference_dispatch(src, layouts, D, G);

    // Device inputs: scales in the quantized layout [G, scale_ld(T)] (padding columns poisoned).
    std::vector<std::unique_ptr<Dev<int32_t>>> idx, slot_row;
    std::vector<std::unique_ptr<Dev<float>>> w, scales;
    std::vector<std::unique_ptr<Dev<uint8_t>>> x;
    for (int p = 0; p < P; ++p) {
      const ep::RankTokens& s = src[size_t(p)];
      const int64_t T = s.tokens, ld = scale_ld(T);
      std::vector<float> sc(size_t(G * ld), -7.0f);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < G; ++g) sc[size_t(g * ld + t)] = s.scales[size_t(t * G + g)];
      idx.push_back(std::make_unique<Dev<int32_t>>(s.idx));
      w.push_back(std::make_unique<Dev<float>>(s.w));
      x.push_back(std::make_unique<Dev<uint8_t>>(s.x));
      scales.push_back(std::make_unique<Dev<float>>(sc));
      slot_row.push_back(std::make_unique<Dev<int32_t>>(size_t(T * k), 0xA5));
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    for (int p = 0; p < P; ++p)
      group->rank(p).notify(idx[size_t(p)]->view(DType::i32, src[size_t(p)].tokens, k));
    for (int p = 0; p < P; ++p) {
      const cuda::ep::EpCounts& n = group->rank(p).counts();
      ASSERT_EQ(n.recv_counts(p), want[size_t(p)].recv_counts) << "rank " << p;
      for (int q = 0; q < P; ++q) {
        ASSERT_EQ(n.tokens_to(q, p), layouts[size_t(q)].tokens_per_rank[size_t(p)]);
        ASSERT_EQ(n.slots_to(q, p), layouts[size_t(q)].slots_per_rank[size_t(p)]);
      }
      std::vector<int64_t> loads(size_t(epr), 0);
      for (int q = 0; q < P; ++q)
        for (int64_t e2 = 0; e2 < epr; ++e2) loads[size_t(e2)] += layouts[size_t(q)].tokens_per_expert[size_t(p * epr + e2)];
      ASSERT_EQ(n.expert_counts(p), loads) << "rank " << p;
    }
    for (int p = 0; p < P; ++p) {
      // Poison this rank's receive regions before any rank writes into them.
      const auto r = group->rank(p).received();
      ASSERT_EQ(cudaMemset(r.x.values.data, 0x5A, size_t(r.rows * D) + 1), cudaSuccess);
      ASSERT_EQ(cudaMemset(r.x.scales.data, 0xFF, size_t(G * scale_ld(r.rows)) * 4), cudaSuccess);
      ASSERT_EQ(cudaMemset(r.weights.data, 0xFF, size_t(r.rows * k) * 4), cudaSuccess);
      ASSERT_EQ(cudaMemset(r.ids.data, 0xFF, size_t(r.rows * k) * 4), cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int p = 0; p < P; ++p) {
      const int64_t T = src[size_t(p)].tokens;
      QuantizedView q{x[size_t(p)]->view(DType::e4m3, T, D), scales[size_t(p)]->view(DType::f32, G, scale_ld(T)),
                      ScaleKind::tile_1x128};
      group->rank(p).dispatch(q, w[size_t(p)]->view(DType::f32, T, k), idx[size_t(p)]->view(DType::i32, T, k),
                              slot_row[size_t(p)]->view(DType::i32, T, k));
    }
    for (int p = 0; p < P; ++p) group->rank(p).check();

    for (int d = 0; d < P; ++d) {
      SCOPED_TRACE("rank " + std::to_string(d));
      const auto r = group->rank(d).received();
      const ep::RankReceived& ref = want[size_t(d)];
      const int64_t n = r.rows;
      ASSERT_EQ(n * D, int64_t(ref.x.size()));
      const auto gx = device_to_host<uint8_t>(r.x.values.data, size_t(n * D) + 1);
      EXPECT_EQ(std::memcmp(gx.data(), ref.x.data(), size_t(n * D)), 0) << "FP8 rows";
      EXPECT_EQ(gx[size_t(n * D)], 0x5A) << "a byte past the rows";
      const int64_t ld = scale_ld(n);
      const auto gs = device_to_host<float>(r.x.scales.data, size_t(G * ld));
      int64_t bad = -1;
      for (int64_t g = 0; g < G && bad < 0; ++g)
        for (int64_t i = 0; i < ld && bad < 0; ++i) {
          const float expect = i < n ? ref.scales[size_t(i * G + g)] : 1.0f;
          if (std::memcmp(&gs[size_t(g * ld + i)], &expect, 4) != 0) bad = g * ld + i;
        }
      EXPECT_EQ(bad, -1) << "scales (group-major, padding 1)";
      const auto gw = device_to_host<float>(r.weights.data, size_t(n * k));
      EXPECT_EQ(std::memcmp(gw.data(), ref.w.data(), gw.size() * 4), 0) << "weights";
      const auto gi = device_to_host<int32_t>(r.ids.data, size_t(n * k));
      EXPECT_EQ(gi, ref.idx) << "expert ids";
      EXPECT_EQ(slot_row[size_t(d)]->host(), layouts[size_t(d)].slot_row) << "slot_row";
    }

    // Combine: each rank's rows, one per slot it holds, random BF16; weighted, then once more
    // accumulated onto the first result and unweighted.
    std::vector<std::vector<uint16_t>> rows(static_cast<size_t>(P));
    std::vector<std::unique_ptr<Dev<uint16_t>>> rows_dev;
    for (int d = 0; d < P; ++d) {
      const int64_t n = group->rank(d).counts().returned(d);
      for (int64_t i = 0; i < n * D; ++i) {
        const float f = val(rng);
        uint32_t b;
        std::memcpy(&b, &f, 4);
        rows[size_t(d)].push_back(uint16_t(b >> 16));
      }
      rows_dev.push_back(std::make_unique<Dev<uint16_t>>(rows[size_t(d)]));
    }
    // Pull, odd steps: the rows written straight into the buffer's combine input (even steps:
    // copied there by combine()).
    const bool in_place = cs.pull && step % 2 == 1;
    if (in_place) {
      for (int d = 0; d < P; ++d) {
        ASSERT_EQ(cudaMemcpy(group->rank(d).combine_input().data, rows_dev[size_t(d)]->p,
                             rows[size_t(d)].size() * 2, cudaMemcpyDeviceToDevice),
                  cudaSuccess);
      }
    }
    for (int pass = 0; pass < 2; ++pass) {
      SCOPED_TRACE(pass == 0 ? "weighted combine" : "unweighted, accumulated");
      std::vector<std::unique_ptr<Dev<float>>> out;
      std::vector<std::vector<float>> start(static_cast<size_t>(P));
      for (int p = 0; p < P; ++p) {
        const int64_t T = src[size_t(p)].tokens;
        for (int64_t i = 0; i < T * D; ++i) start[size_t(p)].push_back(pass == 0 ? std::nanf("") : val(rng));
        out.push_back(std::make_unique<Dev<float>>(start[size_t(p)]));
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (int p = 0; p < P; ++p) {
        const int64_t T = src[size_t(p)].tokens, n = group->rank(p).counts().returned(p);
        group->rank(p).combine(in_place ? group->rank(p).combine_input() : rows_dev[size_t(p)]->view(DType::bf16, n, D), slot_row[size_t(p)]->view(DType::i32, T, k),
                               pass == 0 ? w[size_t(p)]->view(DType::f32, T, k) : TensorView(),
                               out[size_t(p)]->view(DType::f32, T, D), pass == 1);
      }
      for (int p = 0; p < P; ++p) group->rank(p).check();
      for (int p = 0; p < P; ++p) {
        SCOPED_TRACE("source " + std::to_string(p));
        const int64_t T = src[size_t(p)].tokens;
        std::vector<uint16_t> back = ep::reference_combine_rows(rows, layouts, p, D);
        std::vector<float> ref = start[size_t(p)];
        if (T > 0) {
          TensorView y(back.data(), DType::bf16, {int64_t(back.size()) / D, D});
          TensorView sr(const_cast<int32_t*>(layouts[size_t(p)].slot_row.data()), DType::i32, {T, k});
          TensorView wv(src[size_t(p)].w.data(), DType::f32, {T, k});
          TensorView o(ref.data(), DType::f32, {T, D});
          cpu->moe_combine(y, sr, pass == 0 ? wv : TensorView(), o, pass == 1);
        }
        const auto got = out[size_t(p)]->host();
        EXPECT_EQ(std::memcmp(got.data(), ref.data(), ref.size() * 4), 0) << "combined rows";
      }
    }
  }
}

TEST(CudaEp, TwoRanksUniform) {
  FP8MOE_REQUIRE_GPU();
  run_case({2, 20, 512, {300, 517}, 0, {}, 3});
}

TEST(CudaEp, TwoRanksFullHiddenSkewed) {
  FP8MOE_REQUIRE_GPU();
  run_case({2, 20, 7168, {1024, 777}, 1.5, {}, 2});
}

TEST(CudaEp, FourRanksUnevenWithEmptyExpertsAndASilentRank) {
  FP8MOE_REQUIRE_GPU();
  // Rank 2 sends nothing; experts 0..63 (all of rank 0's) and a few others never chosen.
  std::vector<int64_t> empty;
  for (int64_t e = 0; e < 64; ++e) empty.push_back(e);
  for (int64_t e : {100, 101, 200, 255}) empty.push_back(e);
  run_case({4, 20, 1024, {640, 33, 0, 1000}, 1.0, empty, 2});
}

TEST(CudaEp, EightRanks) {
  FP8MOE_REQUIRE_GPU();
  run_case({8, 20, 512, {256, 511, 1, 0, 300, 129, 64, 400}, 0.5, {7, 8, 9}, 2});
}

TEST(CudaEp, TwoRanksPullCombine) {
  FP8MOE_REQUIRE_GPU();
  Case c{2, 20, 7168, {600, 257}, 1.0, {}, 2};
  c.pull = true;
  run_case(c);
}

TEST(CudaEp, FourRanksPullCombineWithASilentRank) {
  FP8MOE_REQUIRE_GPU();
  std::vector<int64_t> empty;
  for (int64_t e = 64; e < 128; ++e) empty.push_back(e);
  Case c{4, 20, 512, {300, 0, 41, 700}, 0.5, empty, 3};
  c.pull = true;
  run_case(c);
}

TEST(CudaEp, EightRanksPullCombine) {
  FP8MOE_REQUIRE_GPU();
  Case c{8, 20, 256, {256, 11, 0, 90, 300, 129, 64, 400}, 0, {3, 4}, 2};
  c.pull = true;
  run_case(c);
}

TEST(CudaEp, EightRanksFewChannels) {
  FP8MOE_REQUIRE_GPU();
  run_case({8, 2, 256, {100, 200, 0, 50, 3, 90, 77, 128}, 0, {}, 2});
}

TEST(CudaEp, FourRanksOddChannelCount) {
  FP8MOE_REQUIRE_GPU();
  run_case({4, 14, 384, {97, 250, 301, 5}, 0, {}, 2});
}

// The two-hop dispatch (ranks as nodes of ranks_per_node): the same bytes on every rank as the
// reference (the single-hop layout), with rows that reach two or more ranks of one node, ranks and
// whole nodes that send nothing, one rank per node, and the combine after it.
TEST(CudaEp, FourRanksAsTwoNodesWithASilentRank) {
  FP8MOE_REQUIRE_GPU();
  std::vector<int64_t> empty;
  for (int64_t e = 0; e < 64; ++e) empty.push_back(e);
  for (int64_t e : {100, 101, 200, 255}) empty.push_back(e);
  Case c{4, 20, 1024, {640, 33, 0, 1000}, 1.0, empty, 2};
  c.ranks_per_node = 2;
  run_case(c);
}

TEST(CudaEp, EightRanksAsTwoNodesOfFour) {
  FP8MOE_REQUIRE_GPU();
  Case c{8, 20, 512, {256, 511, 1, 0, 300, 129, 64, 400}, 0.5, {7, 8, 9}, 2};
  c.ranks_per_node = 4;
  run_case(c);
}

TEST(CudaEp, EightRanksAsFourNodesPullCombineWithASilentNode) {
  FP8MOE_REQUIRE_GPU();
  Case c{8, 20, 256, {256, 11, 0, 0, 300, 129, 64, 400}, 0, {3, 4}, 2};
  c.ranks_per_node = 2;
  c.pull = true;
  run_case(c);
}

TEST(CudaEp, TwoRanksAsTwoNodesFullHidden) {
  FP8MOE_REQUIRE_GPU();
  Case c{2, 20, 7168, {1024, 777}, 1.5, {}, 2};
  c.ranks_per_node = 1;
  run_case(c);
}

TEST(CudaEp, FourRanksAsTwoNodesOneScaleGroup) {  // D 128: a row is one 1x128 tile
  FP8MOE_REQUIRE_GPU();
  Case c{4, 20, 128, {128, 128, 97, 128}, 0, {}, 3};
  c.ranks_per_node = 2;
  run_case(c);
}

TEST(CudaEp, EightRanksAsEightNodesFewChannels) {
  FP8MOE_REQUIRE_GPU();
  Case c{8, 2, 256, {100, 200, 0, 50, 3, 90, 77, 128}, 0, {}, 2};
  c.ranks_per_node = 1;
  run_case(c);
}

EpConfig small_config(int ranks) {
  EpConfig c;
  c.ranks = ranks;
  c.max_tokens = 64;
  c.hidden = 256;
  c.topk = kTopk;
  c.experts = kExperts;
  c.num_sms = 4;
  return c;
}

TEST(CudaEp, BadConfigurationsAreRefused) {
  FP8MOE_REQUIRE_GPU();
  EpConfig c = small_config(2);
  c.num_sms = 5;
  expect_error([&] { EpGroup::local(c); }, "num_sms 5 must be even");
  c.num_sms = 2 * 128 + 2;
  expect_error([&] { EpGroup::local(c); }, "num_sms");
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  c.num_sms = sms + 2;
  expect_error([&] { EpGroup::local(c); }, "above this device's");
  c = small_config(2);
  const size_t worst = cuda::ep::buffer_layout(c).total;
  c.buffer_bytes = worst - 1;
  expect_error([&] { EpGroup::local(c); }, "below the");
  c.buffer_bytes = worst;
  EXPECT_NO_THROW(EpGroup::local(c));
  c = small_config(9);
  expect_error([&] { EpGroup::local(c); }, "ranks");
  c = small_config(3);
  c.experts = 256;  // not a multiple of 3
  expect_error([&] { EpGroup::local(c); }, "split evenly");
  c = small_config(8);
  c.num_sms = sms;  // 8 ranks x all SMs cannot be resident together on one GPU
  expect_error([&] { EpGroup::local(c); }, "resident");
  c = small_config(4);
  c.ranks_per_node = 3;
  expect_error([&] { EpGroup::local(c); }, "ranks_per_node 3 must divide the 4 ranks");
  c.ranks_per_node = 2;
  c.low_latency = true;
  expect_error([&] { EpGroup::local(c); }, "is the normal mode's");
}

TEST(CudaEp, TooManyTokensAndBadIdsAreRefused) {
  FP8MOE_REQUIRE_GPU();
  auto g = EpGroup::local(small_config(2));
  Dev<int32_t> big(size_t(65 * kTopk));
  expect_error([&] { g->rank(0).notify(big.view(DType::i32, 65, kTopk)); }, "worst case of 64");
  std::vector<int32_t> ids(size_t(4 * kTopk));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
  ids[9] = 256;  // token 1, slot 1
  Dev<int32_t> bad(ids);
  std::vector<int32_t> ok_ids(size_t(4 * kTopk));
  for (size_t i = 0; i < ok_ids.size(); ++i) ok_ids[i] = int32_t(i % kTopk);
  Dev<int32_t> ok(ok_ids);
  g->rank(0).notify(bad.view(DType::i32, 4, kTopk));
  g->rank(1).notify(ok.view(DType::i32, 4, kTopk));
  expect_error([&] { g->rank(0).counts(); }, "ep notify on rank 0: idx[1, 1] outside [0, 256)");
  expect_error([&] { g->rank(0).notify(ok.view(DType::i32, 4, kTopk)); }, "cannot be used again");
}

TEST(CudaEp, APeerThatNeverJoinsTimesOut) {
  FP8MOE_REQUIRE_GPU();
  EpConfig c = small_config(4);
  c.timeout_s = 0.2;
  auto g = EpGroup::local(c);
  std::vector<int32_t> ids(size_t(8 * kTopk));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i * 37 % kExperts);
  Dev<int32_t> d(ids);
  for (int p = 0; p < 3; ++p) g->rank(p).notify(d.view(DType::i32, 8, kTopk));  // rank 3 never does
  for (int p = 0; p < 3; ++p)
    expect_error([&] { g->rank(p).counts(); },
                 "ep notify on rank " + std::to_string(p) + ": timed out after 0.2 s waiting for rank 3");
}

}  // namespace
}  // namespace fp8moe::testing
