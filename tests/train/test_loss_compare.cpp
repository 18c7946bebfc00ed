// compare_runs and truncate_curve (fp8moe/loss_compare.hpp): same-seed pairing, means over seeds,
// the BF16 seed spread, the verdicts, and the errors for incomplete sets of runs.
#include <gtest/gtest.h>

#include <cmath>

#include "fp8moe/loss_compare.hpp"
#include "testing.hpp"

using namespace fp8moe;
using fp8moe::testing::expect_error;

namespace {

// 20 steps of a constant training loss, validation at steps 9 and 19.
CompareRun run(const std::string& recipe, int seed, double loss, double val) {
  CompareRun r;
  r.recipe = recipe;
  r.seed = seed;
  r.curve.name = seed == 0 ? recipe : recipe + "-seed" + std::to_string(seed);
  for (int s = 0; s < 20; ++s) {
    r.curve.steps.push_back(s);
    r.curve.loss.push_back(loss);
  }
  r.curve.val_steps = {9, 19};
  r.curve.val_loss = {val + 1, val};
  return r;
}

}  // namespace

TEST(LossCompare, PairsRunsBySeedAndAveragesOverSeeds) {
  const std::vector<CompareRun> runs = {run("bf16", 0, 2.00, 3.00), run("fp8", 0, 2.02, 2.97),
                                        run("bf16", 1, 2.02, 3.03), run("fp8", 1, 2.0402, 3.0603),
                                        run("bf16", 2, 1.98, 2.97)};
  const Comparison c = compare_runs(runs);
  ASSERT_EQ(c.runs.size(), runs.size());
  EXPECT_EQ(c.bf16_seeds, 3);
  EXPECT_NEAR(c.bf16_train_spread, (2.02 - 1.98) / 2.0, 1e-12);
  EXPECT_NEAR(c.bf16_val_spread, (3.03 - 2.97) / 3.0, 1e-12);

  // Each fp8 run against the bf16 run of its seed.
  const RunComparison& f0 = c.runs[1];
  EXPECT_EQ(f0.baseline, "bf16");
  EXPECT_NEAR(f0.train_rel, 0.01, 1e-12);
  EXPECT_NEAR(f0.val_rel, -0.01, 1e-12);
  EXPECT_NEAR(f0.smooth_rel_mean, 0.01, 1e-12);
  EXPECT_NEAR(f0.smooth_rel_max_abs, 0.01, 1e-12);
  EXPECT_TRUE(f0.inside_bf16_train);  // 2.02: the top of [1.98, 2.02]
  EXPECT_TRUE(f0.inside_bf16_val);
  const RunComparison& f1 = c.runs[3];
  EXPECT_EQ(f1.baseline, "bf16-seed1");
  EXPECT_NEAR(f1.train_rel, 0.01, 1e-12);
  EXPECT_NEAR(f1.val_rel, 0.01, 1e-12);
  EXPECT_FALSE(f1.inside_bf16_train);  // 2.0402 > 2.02
  EXPECT_FALSE(f1.inside_bf16_val);

  // BF16 rows against BF16 seed 0: the seed-to-seed noise.
  EXPECT_EQ(c.runs[4].baseline, "bf16");
  EXPECT_NEAR(c.runs[4].train_rel, -0.01, 1e-12);
  EXPECT_EQ(c.runs[0].train_rel, 0.0);

  // The recipe's mean over its two seeds against BF16's mean over the same two seeds (not three).
  ASSERT_EQ(c.recipes.size(), 1u);
  const RecipeComparison& m = c.recipes.at("fp8");
  EXPECT_EQ(m.seeds, 2);
  EXPECT_NEAR(m.bf16_train, 2.01, 1e-12);
  EXPECT_NEAR(m.train, (2.02 + 2.0402) / 2, 1e-12);
  EXPECT_NEAR(m.train_rel, 0.01, 1e-12);
  EXPECT_NEAR(m.val_rel, ((2.97 + 3.0603) / 2) / ((3.00 + 3.03) / 2) - 1, 1e-12);
  // Standard error of the mean of the same-seed differences: train {+1%, +1%} -> 0; val {-1%, +1%}
  // -> sample sd sqrt(2) % over sqrt(2) seeds = 1%.
  EXPECT_NEAR(m.train_rel_se, 0.0, 1e-12);
  EXPECT_NEAR(m.val_rel_se, 0.01, 1e-12);
}

TEST(LossCompare, OneSeedHasNoStandardError) {
  const Comparison c = compare_runs({run("bf16", 0, 2.00, 3.00), run("fp8", 0, 2.02, 2.97)});
  EXPECT_TRUE(std::isnan(c.recipes.at("fp8").train_rel_se));
  EXPECT_TRUE(std::isnan(c.recipes.at("fp8").val_rel_se));
}

TEST(LossCompare, IncompleteRunSetsAreRefused) {
  expect_error([] { compare_runs({run("fp8", 0, 2, 3)}); }, "no bf16 run of seed 0");
  expect_error([] { compare_runs({run("bf16", 0, 2, 3), run("fp8", 1, 2, 3)}); },
               "run 'fp8-seed1' (seed 1) has no bf16 run of the same seed");
}

TEST(LossCompare, TruncateCurveKeepsTheStepsBeforeTheHorizon) {
  const LossCurve c = run("bf16", 0, 2, 3).curve;
  const LossCurve t = truncate_curve(c, 10);
  ASSERT_EQ(t.steps.size(), 10u);
  EXPECT_EQ(t.steps.back(), 9);
  ASSERT_EQ(t.val_loss.size(), 1u);
  EXPECT_EQ(t.val_loss[0], 4.0);  // the validation of step 9
  EXPECT_EQ(truncate_curve(c, 0).steps.size(), 20u);
  LossCurve late = c;
  late.steps.assign(20, 0);
  for (int s = 0; s < 20; ++s) late.steps[size_t(s)] = 100 + s;  // a run that starts at step 100
  expect_error([&] { truncate_curve(late, 50); }, "run 'bf16' has no step before the horizon 50");
}
