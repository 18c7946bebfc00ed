// The deployment simulator (src/serve/deploy_sim.hpp): the units' shapes, the overlap against the
// serial sum, how the parts scale with the rates and links, and bad input.
#include <gtest/gtest.h>

#include "fp8moe/model.hpp"
#include "serve/deploy_sim.hpp"
#include "testing.hpp"

namespace fp8moe::serve {
namespace {

ModelConfig v3() { return load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/deepseek-v3.json"); }

TEST(DeploySim, UnitShapes) {
  EXPECT_EQ(report_prefill_unit().slots / (report_prefill_unit().nodes * 8), 9);  // 8 experts + 1 redundant per GPU
  EXPECT_EQ(report_decode_unit().nodes * 8, 320);
  EXPECT_EQ(report_decode_unit().slots, 320);  // one expert per GPU
  EXPECT_EQ(production_decode_unit().nodes * 8, 144);
  EXPECT_EQ(production_decode_unit().slots / 144, 2);
}

TEST(DeploySim, OverlapAndScaling) {
  const ModelConfig cfg = v3();
  for (const DeployUnit& u : {report_prefill_unit(), report_decode_unit(), production_prefill_unit(), production_decode_unit()}) {
    const DeployResult r = simulate_deploy(cfg, u, {}, LinkModel::h800());
    EXPECT_LE(r.time_overlap, r.time_serial) << u.name;
    EXPECT_GE(r.time_overlap, std::max(r.compute, r.comm) * (1 - 1e-12)) << u.name;
    EXPECT_NEAR(r.time_serial, r.compute + r.comm, 1e-12 * r.time_serial) << u.name;
    EXPECT_GT(r.tokens_per_node_s, r.tokens_per_node_s_serial) << u.name;
    LinkModel fast = LinkModel::h800();
    fast.ib_gbps *= 2;
    fast.ib_latency_us = 0;
    LinkModel lat0 = LinkModel::h800();
    lat0.ib_latency_us = 0;
    EXPECT_NEAR(simulate_deploy(cfg, u, {}, fast).ib, simulate_deploy(cfg, u, {}, lat0).ib / 2, 1e-9) << u.name;
    KernelRates faster;
    faster.attention_tflops *= 4;
    faster.decode_attention_tflops *= 4;
    faster.decode_attention_fraction *= 4;
    EXPECT_LT(simulate_deploy(cfg, u, faster, LinkModel::h800()).attn_core, r.attn_core) << u.name;
    EXPECT_GE(r.expert_imbalance, 1.0);
  }
  // Prefill: a token's 4 of 8 groups on 4 nodes of 2 groups each touch 4 (1 - C(6,4)/C(8,4)) nodes,
  // 3/4 of them remote.
  EXPECT_NEAR(simulate_deploy(cfg, report_prefill_unit(), {}, LinkModel::h800()).remote_nodes,
              4 * (1 - 15.0 / 70.0) * 3 / 4, 1e-9);
}

// The redundant experts pay: the same unit with one slot per expert is slower in its experts.
TEST(DeploySim, RedundantExpertsBalance) {
  const ModelConfig cfg = v3();
  DeployUnit u = production_prefill_unit(), plain = u;
  plain.slots = 256;
  const DeployResult a = simulate_deploy(cfg, u, {}, LinkModel::h800()), b = simulate_deploy(cfg, plain, {}, LinkModel::h800());
  EXPECT_LT(a.expert_imbalance, b.expert_imbalance);
  EXPECT_LT(a.experts, b.experts);
}

TEST(DeploySim, BadInput) {
  const ModelConfig cfg = v3();
  DeployUnit u = report_prefill_unit();
  u.slots = 300;
  testing::expect_error([&] { simulate_deploy(cfg, u, {}, LinkModel::h800()); }, "300 expert slots are not divisible by 32 GPUs");
  u = report_prefill_unit();
  u.attention_tp = 3;
  testing::expect_error([&] { simulate_deploy(cfg, u, {}, LinkModel::h800()); }, "attention TP groups of 3");
  KernelRates r;
  r.gemm_tflops = 0;
  testing::expect_error([&] { simulate_deploy(cfg, report_decode_unit(), r, LinkModel::h800()); }, "rates must be > 0");
  r = KernelRates{};
  r.decode_attention_tflops = 0;
  testing::expect_error([&] { check_rates(r, LinkModel::h800()); }, "rates must be > 0");
  LinkModel l = LinkModel::h800();
  l.ib_latency_us = -1;
  testing::expect_error([&] { check_rates({}, l); }, "latencies >= 0");
}

}  // namespace
}  // namespace fp8moe::serve
