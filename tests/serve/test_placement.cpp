// Expert placement (include/fp8moe/placement.hpp): EPLB's README example map, the inverse maps,
// balance on skewed loads, and the errors of bad input. The comparison with the reference
// algorithm on random lognormal loads is eplb_reference.py (ctest serve_eplb_reference).
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "fp8moe/error.hpp"
#include "fp8moe/placement.hpp"
#include "testing.hpp"

namespace fp8moe {
namespace {

const ExpertLoads kReadme = {{90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86},
                             {20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27}};

TEST(Placement, ReadmeExampleMap) {
  const ExpertPlacement p = place_experts(kReadme, {16, 2, 8, 4});
  EXPECT_TRUE(p.hierarchical);
  const std::vector<std::vector<int32_t>> expected = {{5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1},
                                                      {7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1}};
  EXPECT_EQ(p.phy_to_log, expected);
}

TEST(Placement, InverseMapsAndCounts) {
  const ExpertPlacement p = place_experts(kReadme, {16, 2, 8, 4});
  for (int64_t l = 0; l < p.layers; ++l) {
    int32_t total = 0;
    for (int64_t e = 0; e < p.experts; ++e) {
      const auto& slots = p.log_to_phy[size_t(l)][size_t(e)];
      ASSERT_EQ(int64_t(slots.size()), p.replicas[size_t(l)][size_t(e)]);
      ASSERT_GE(slots.size(), 1u);
      for (size_t r = 0; r < slots.size(); ++r) {
        EXPECT_EQ(p.phy_to_log[size_t(l)][size_t(slots[r])], e);
        EXPECT_EQ(p.phy_replica[size_t(l)][size_t(slots[r])], int32_t(r));
      }
      total += p.replicas[size_t(l)][size_t(e)];
    }
    EXPECT_EQ(total, 16);
  }
}

ExpertLoads lognormal_loads(int64_t layers, int64_t experts, double sigma, unsigned seed) {
  std::mt19937 rng(seed);
  std::lognormal_distribution<double> d(0.0, sigma);
  ExpertLoads loads(static_cast<size_t>(layers), std::vector<double>(static_cast<size_t>(experts)));
  for (auto& row : loads)
    for (double& v : row) v = d(rng);
  return loads;
}

// The hierarchical policy keeps every group on one node: the token's group-limited routing
// reaches no node it did not reach before.
TEST(Placement, HierarchicalKeepsGroupsOnNodes) {
  const ExpertLoads loads = lognormal_loads(4, 64, 1.0, 3);
  const ExpertPlacement p = place_experts(loads, {80, 4, 16, 8});
  for (int64_t l = 0; l < p.layers; ++l)
    for (int64_t s = 0; s < 80; ++s) {
      const int64_t node = p.gpu_of_slot(s) / 4, group = p.phy_to_log[size_t(l)][size_t(s)] / 8;
      for (int64_t s2 = 0; s2 < 80; ++s2) {
        if (p.phy_to_log[size_t(l)][size_t(s2)] / 8 == group) {
          EXPECT_EQ(p.gpu_of_slot(s2) / 4, node);
        }
      }
    }
}

TEST(Placement, BalancesSkewedLoads) {
  const ExpertLoads loads = lognormal_loads(3, 256, 1.5, 11);
  const ExpertPlacement p = place_experts(loads, {288, 4, 32, 1});  // one group: the global policy
  const PlacementBalance before = placement_balance(loads, identity_placement(3, 256, 4, 32));
  const PlacementBalance after = placement_balance(loads, p);
  EXPECT_GT(before.overall(), 1.3);
  EXPECT_LT(after.overall(), 1.1);
  for (int64_t l = 0; l < 3; ++l) EXPECT_NEAR(before.mean[size_t(l)], after.mean[size_t(l)], 1e-9 * before.mean[size_t(l)]);
}

TEST(Placement, GlobalWhenGroupsDoNotDivide) {
  const ExpertPlacement p = place_experts(kReadme, {18, 3, 6, 4});  // 4 groups on 3 nodes
  EXPECT_FALSE(p.hierarchical);
  EXPECT_LT(placement_balance(kReadme, p).overall(), placement_balance(kReadme, identity_placement(2, 12, 3, 6)).overall());
}

using testing::expect_error;

TEST(Placement, BadInput) {
  expect_error([] { place_experts({{1, 2, 3}, {1, 2}}, {4, 1, 2, 1}); }, "layer 1 have 2 experts, layer 0 has 3");
  expect_error([] { place_experts({}, {4, 1, 2, 1}); }, "no loads");
  expect_error([] { place_experts(kReadme, {10, 2, 2, 4}); }, "10 slots for 12 experts");
  expect_error([] { place_experts(kReadme, {16, 2, 6, 4}); }, "16 slots are not divisible by 6 GPUs");
  expect_error([] { place_experts(kReadme, {16, 3, 8, 4}); }, "8 GPUs are not divisible by 3 nodes");
  expect_error([] { place_experts(kReadme, {16, 2, 8, 5}); }, "12 experts are not divisible by 5 groups");
  expect_error([] { place_experts(kReadme, {18, 3, 6, 4}, PlacementPolicy::hierarchical); },
               "4 groups divisible by the 3 nodes");
  expect_error([] { place_experts({{1, -2}}, {2, 1, 1, 1}); }, "layer 0 expert 1");
}

TEST(Placement, ReadsLoadFiles) {
  const std::string dir = ::testing::TempDir();
  {
    std::ofstream(dir + "/l.json") << "[[1, 2], [3, 4]]";
    std::ofstream(dir + "/l.txt") << "1, 2\n3 4\n";
    std::ofstream(dir + "/m.jsonl") << "{\"step\": 0, \"expert_loads\": [[1, 2], [3, 4]]}\n{\"step\": 1}\n"
                                       "{\"step\": 2, \"expert_loads\": [[1, 0], [0, 1]]}\n";
    std::ofstream(dir + "/bad.txt") << "1 2\n3 x\n";
  }
  const ExpertLoads want = {{1, 2}, {3, 4}};
  EXPECT_EQ(read_expert_loads(dir + "/l.json"), want);
  EXPECT_EQ(read_expert_loads(dir + "/l.txt"), want);
  EXPECT_EQ(read_expert_loads(dir + "/m.jsonl"), (ExpertLoads{{2, 2}, {3, 5}}));
  expect_error([&] { read_expert_loads(dir + "/bad.txt"); }, "line 2: 'x' is not a number");
  expect_error([&] { read_expert_loads(dir + "/missing.json"); }, "cannot open");
}

}  // namespace
}  // namespace fp8moe
