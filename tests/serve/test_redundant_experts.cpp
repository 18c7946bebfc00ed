// Redundant experts in the engine (EngineOptions::expert_slots): requests through the batching
// scheduler generate the same greedy tokens with and without copies of the experts, while the
// placement is recomputed from the online loads every few steps with requests in flight; the
// tokens per virtual GPU spread less once the placement has seen the loads.
// Run: ctest --test-dir build -R test_redundant_experts
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <numeric>

#include "fp8moe/model.hpp"
#include "serve/scheduler.hpp"
#include "serve_testing.hpp"
#include "testing.hpp"

namespace fp8moe::serve {
namespace {

std::vector<int32_t> prompt_of(int64_t n, int64_t seed) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(int32_t((i * 29 + seed * 13) % 150 + 40));
  return p;
}

// 12 requests of different lengths, greedy, through one scheduler; the outputs in request order.
std::vector<std::vector<int32_t>> serve_all(Engine& e) {
  Scheduler s(e, {});
  std::vector<std::vector<int32_t>> out(12);
  for (size_t i = 0; i < out.size(); ++i) {
    Request r;
    r.prompt = prompt_of(8 + int64_t(i) * 5, int64_t(i));
    r.max_tokens = 16;
    r.on_done = [&out, i](const std::string&, const std::vector<int32_t>& t) { out[i] = t; };
    s.submit(std::move(r));
  }
  while (s.step()) {
  }
  return out;
}

// max / mean of the tokens per virtual GPU, over the MoE layers.
double spread(const Engine& e) {
  double mx = 0, sum = 0;
  int64_t n = 0;
  for (const auto& row : e.gpu_tokens()) {
    mx += double(*std::max_element(row.begin(), row.end()));
    sum += double(std::accumulate(row.begin(), row.end(), int64_t(0)));
    n = int64_t(row.size());
  }
  return mx / (sum / double(n));
}

void check_recipe(const std::string& recipe, bool shared_as_routed = false) {
  auto be = make_backend(testing_env::backend_name());
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  cfg.initializer_range = 0.1;  // peaked logits: greedy choices are not near-ties
  Model model(cfg, Recipe::from_name(recipe), *be, 5);
  // Skewed routing, as trained models have it: the selection bias favours a few experts.
  WeightSet w = weights_of(model);
  Tensor bias = Tensor::host(DType::f32, {cfg.n_routed_experts});
  const float favour[8] = {0.12f, 0.08f, 0.f, 0.f, 0.06f, 0.f, 0.f, 0.f};
  std::copy(favour, favour + 8, bias.ptr<float>());
  be->copy(w.tensors.at("model.layers.1.mlp.gate.e_score_correction_bias").view(), bias.view());
  EngineOptions base;
  base.cache = CacheDType::f32;
  base.cache_blocks = 64;
  base.shared_as_routed = shared_as_routed;  // the shared expert's group stays past the slots
  base.expert_gpus = 4;  // one node: the global policy (2 groups of unequal load cannot balance 2 nodes)
  EngineOptions red = base;
  red.expert_slots = 12;     // 4 redundant copies, 3 slots per GPU
  red.rebalance_every = 5;   // steps: the placement moves while requests are in flight

  Engine plain(w, *be, base), copies(w, *be, red);
  const auto want = serve_all(plain);
  const ExpertPlacement first = copies.placement();
  const auto got = serve_all(copies);
  EXPECT_EQ(got, want) << recipe << ": replication changed the generated tokens";
  for (const auto& t : got) EXPECT_EQ(t.size(), 16u);
  EXPECT_NE(copies.placement().phy_to_log, first.phy_to_log) << "the placement was never recomputed";
  // The second pass runs under placements learned from the first one's loads.
  plain.reset_gpu_tokens();
  copies.reset_gpu_tokens();
  EXPECT_EQ(serve_all(copies), want);
  serve_all(plain);
  const double before = spread(plain), after = spread(copies);
  std::cout << recipe << (shared_as_routed ? " (shared expert as routed)" : "") << ": max / mean tokens per virtual GPU " << before << " with one copy per expert, " << after
            << " with 4 redundant copies\n";
  for (const Engine* e : {&plain, &copies}) {
    std::cout << (e == &plain ? "  one copy:" : "  copies:  ");
    for (int64_t v : e->gpu_tokens()[0]) std::cout << " " << v;
    std::cout << " tokens per GPU\n";
  }
  EXPECT_GT(before, 1.25);  // the bias skews the routing
  EXPECT_LT(after, 1.12);
}

TEST(RedundantExperts, SameTokensAndBetterSpreadFp32) { check_recipe("fp32"); }
TEST(RedundantExperts, SameTokensAndBetterSpreadFp8) { check_recipe("fp8"); }
TEST(RedundantExperts, SameTokensWithSharedAsRoutedFp8) { check_recipe("fp8", true); }

TEST(RedundantExperts, PlacementOfTheWrongShape) {
  auto be = make_backend(testing_env::backend_name());
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  Model model(cfg, Recipe::from_name("fp32"), *be, 5);
  EngineOptions o;
  o.expert_slots = 12;
  o.expert_gpus = 4;
  Engine e(weights_of(model), *be, o);
  const ExpertLoads loads(1, std::vector<double>(8, 1.0));
  testing::expect_error([&] { e.set_placement(place_experts(loads, {16, 1, 4, 1})); }, "16 slots on 1 x 4 GPUs");
  o.expert_slots = 6;
  testing::expect_error([&] { Engine(weights_of(model), *be, o); }, "6 slots for 8 experts");
}

}  // namespace
}  // namespace fp8moe::serve
