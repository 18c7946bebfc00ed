// The parallel layout's validation, the dispatch layout and node-limited routing, on one process
// (the multi-rank ones are test_parallel_mpi.cpp and parallel_train.sh, under mpirun).
//   ctest --test-dir build -R ParallelLayout
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "fp8moe/backend.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/parallel.hpp"
#include "moe_routing.hpp"
#include "parallel/runtime/dispatch_layout.hpp"

namespace fp8moe {
namespace {

ModelConfig experts(int64_t n, int64_t topk = 2) {
  ModelConfig c;
  c.n_routed_experts = n;
  c.num_experts_per_tok = topk;
  return c;
}

ParallelOptions opts(int64_t dp, int64_t ep, int64_t rpn = 0, int64_t max_nodes = 0) {
  ParallelOptions o;
  o.dp = dp;
  o.ep = ep;
  o.ranks_per_node = rpn;
  o.max_nodes = max_nodes;
  return o;
}

void expect_error(const ParallelOptions& o, int64_t world, const ModelConfig& c, const std::string& needle) {
  try {
    make_parallel_layout(o, world, 0, c);
    ADD_FAILURE() << "no error, expected one naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(ParallelLayout, ShardsExpertsInsideDataParallel) {
  const ParallelLayout l = make_parallel_layout(opts(4, 2), 4, 3, experts(8));
  EXPECT_EQ(l.dp, 4);
  EXPECT_EQ(l.ep, 2);
  EXPECT_EQ(l.experts_per_rank, 4);
  EXPECT_EQ(l.ep_rank(), 1);
  EXPECT_EQ(l.ep_group(), 1);
  EXPECT_EQ(l.first_expert(), 4);
  EXPECT_EQ(l.nodes, 1);
  const ParallelLayout n = make_parallel_layout(opts(4, 4, 2, 1), 4, 0, experts(8));
  EXPECT_EQ(n.nodes, 2);
  EXPECT_EQ(n.ranks_per_node, 2);
  EXPECT_EQ(n.max_nodes, 1);
  ModelConfig c = experts(8);
  c.n_group = 4;
  c.topk_group = 4;
  apply_node_limited_routing(n, c);
  EXPECT_EQ(c.n_group, 2);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(make_parallel_layout(opts(4, 4, 2), 4, 0, experts(8)).max_nodes, 2);  // min(4, nodes)
}

TEST(ParallelLayout, PipelineRanksHoldConsecutiveDataParallelBlocks) {
  ParallelOptions o = opts(0, 2);
  o.pp = 2;
  const ParallelLayout l = make_parallel_layout(o, 8, 5, experts(8));
  EXPECT_EQ(l.dp, 4);  // 0: the world over --pp
  EXPECT_EQ(l.pp_rank(), 1);
  EXPECT_EQ(l.dp_rank(), 1);
  EXPECT_EQ(l.ep_rank(), 1);
  o.pp = 3;
  expect_error(o, 8, experts(8), "--pp 3 must divide the world size 8");
}

TEST(ParallelLayout, ImpossibleLayoutsNameTheOption) {
  expect_error(opts(2, 3), 2, experts(8), "--ep 3 must divide --dp 2");
  expect_error(opts(4, 4), 4, experts(6), "must divide the routed experts (n_routed_experts = 6");
  expect_error(opts(3, 0), 4, experts(8), "--dp 3 must divide the world size 4");
  expect_error(opts(2, 0), 4, experts(8), "--pp 1 x --dp 2 = 2 ranks, the world has 4");
  expect_error(opts(4, 4, 3), 4, experts(8), "--ranks-per-node 3 must divide the world size 4");
  expect_error(opts(4, 4, 2, 3), 4, experts(8), "--max-nodes 3 is larger than the nodes of an expert-parallel group (2");
  expect_error(opts(4, 4, 0, 2), 4, experts(8), "--max-nodes 2 is larger");
  expect_error(opts(4, 4, 1, 1), 4, experts(8, 3), "cannot hold top-k = 3");
  ParallelOptions t = opts(2, 2);
  t.ep_transport = "nccl";
  expect_error(t, 2, experts(8), "--ep-transport must be comm, nvlink or auto, got 'nccl'");
  for (const char* ok : {"comm", "nvlink", "auto"}) {
    t.ep_transport = ok;
    EXPECT_EQ(make_parallel_layout(t, 2, 1, experts(8)).ep_transport, ok);
  }
}

// idx [T, k] distinct experts per token from a seeded generator.
std::vector<int32_t> random_routing(int64_t T, int64_t K, int64_t E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return testing::random_expert_ids(rng, T, K, E);
}

TEST(DispatchLayout, OneRowPerDestinationRankAndOneReturnedRowPerSlot) {
  const int64_t T = 37, K = 3, P = 4, epr = 2;
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<int32_t> idx = random_routing(T, K, P * epr, seed);
  const ep::DispatchLayout l = ep::dispatch_layout(idx.data(), T, K, P, epr);
  int64_t row = 0, total_slots = 0;
  std::set<int32_t> slots;
  for (int64_t d = 0; d < P; ++d) {
    int64_t expect_rows = 0, expect_slots = 0, prev = -1;
    for (int64_t t = 0; t < T; ++t) {
      int64_t here = 0;
      for (int64_t j = 0; j < K; ++j) here += idx[size_t(t * K + j)] / epr == d;
      EXPECT_EQ(l.token_in_rank[size_t(t * P + d)], here > 0);
      expect_rows += here > 0;
      expect_slots += here;
    }
    ASSERT_EQ(l.tokens_per_rank[size_t(d)], expect_rows) << "rank " << d;
    EXPECT_EQ(l.slots_per_rank[size_t(d)], expect_slots) << "rank " << d;
    for (int64_t i = 0; i < expect_rows; ++i, ++row) {  // each sent row names its token and its slots
      const int32_t t = l.send_token[size_t(row)];
      EXPECT_GT(t, prev) << "tokens ascending within a rank";
      prev = t;
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = idx[size_t(t * K + j)], local = l.send_expert[size_t(row * K + j)];
        EXPECT_EQ(local, e / epr == d ? e - d * epr : -1);
        if (local >= 0) {
          const int32_t r = l.slot_row[size_t(t * K + j)];
          EXPECT_GE(r, total_slots);
          EXPECT_LT(r, total_slots + expect_slots);
          slots.insert(r);
        }
      }
    }
    total_slots += expect_slots;
  }
  EXPECT_EQ(row, l.sent_rows());
  EXPECT_EQ(int64_t(slots.size()), T * K);  // every slot a row of its own
  for (int64_t e = 0; e < P * epr; ++e) {
    int64_t n = 0;
    for (int32_t v : idx) n += v == e;
    EXPECT_EQ(l.tokens_per_expert[size_t(e)], n);
  }
}

TEST(NodeLimitedRouting, NoTokenReachesMoreThanMaxNodes) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto be = make_backend("cpu");
  for (const auto& [nodes, max_nodes, E, K] : {std::tuple{4, 1, 16, 3}, std::tuple{4, 2, 16, 6}, std::tuple{8, 4, 32, 8}}) {
    ModelConfig c = experts(E, K);
    const ParallelLayout l = make_parallel_layout(opts(nodes * 2, nodes * 2, 2, max_nodes), nodes * 2, 0, c);
    ASSERT_EQ(l.nodes, nodes);
    apply_node_limited_routing(l, c);
    const int64_t T = 200;
    Tensor logits = Tensor::host(DType::f32, {T, E}), bias = Tensor::host(DType::f32, {E});
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 2.f);
    for (int64_t i = 0; i < T * E; ++i) logits.ptr<float>()[i] = nd(rng);
    for (int64_t e = 0; e < E; ++e) bias.ptr<float>()[e] = 0.1f * nd(rng);
    Tensor scores = Tensor::host(DType::f32, {T, E}), idx = Tensor::host(DType::i32, {T, K}),
           w = Tensor::host(DType::f32, {T, K});
    be->moe_route(logits.view(), bias.view(), scores.view(), idx.view(), w.view(), c.n_group, c.topk_group, true, 1.0);
    const int64_t per_node = E / nodes;
    int64_t reached_max = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::set<int64_t> reached;
      for (int64_t j = 0; j < K; ++j) reached.insert(idx.ptr<int32_t>()[t * K + j] / per_node);
      EXPECT_LE(int64_t(reached.size()), max_nodes) << "token " << t;
      reached_max = std::max<int64_t>(reached_max, int64_t(reached.size()));
    }
    EXPECT_EQ(reached_max, std::min<int64_t>(max_nodes, K)) << "the limit is reached, not undershot";
  }
}

}  // namespace
}  // namespace fp8moe
