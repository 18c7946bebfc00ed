// Comparing training runs the way the report's Figure 10 does: losses smoothed by an exponential
// moving average (0.9), the relative error of a run against a baseline per step, and a final loss
// averaged over the last steps so one noisy batch does not decide the verdict. Runs of several
// seeds are paired seed by seed (each recipe against BF16 with the same seed) and their means
// compared, next to the BF16 seed-to-seed spread: the noise a difference is read against.
#pragma once
#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace fp8moe {

struct LossCurve {
  std::string name;
  std::vector<double> steps, loss;   // training loss per step
  std::vector<double> val_steps, val_loss;
};

// Reads a metrics.jsonl written by the trainer.
LossCurve read_loss_curve(const std::string& metrics_path, const std::string& name);
// The curve up to (not including) step `horizon`: what the run had seen at that point (0: all).
LossCurve truncate_curve(const LossCurve& c, double horizon);
// y_t = a * y_{t-1} + (1 - a) * x_t, y_0 = x_0 (bias-free start).
std::vector<double> ema_smooth(const std::vector<double>& x, double a = 0.9);
// (run - base) / base elementwise over the common prefix of the two series.
std::vector<double> relative_error(const std::vector<double>& run, const std::vector<double>& base);
// Mean of the last `frac` of the values (at least one).
double tail_mean(const std::vector<double>& x, double frac = 0.1);

// One run of a comparison: its recipe, its seed index (0, 1, ...: the same index means the same
// seed for every recipe) and its curve (curve.name names the run).
struct CompareRun {
  std::string recipe;
  int seed = 0;
  LossCurve curve;
};

// A run against its baseline: the BF16 run of the same seed, or for a BF16 run the BF16 run of
// seed 0 (so the BF16 rows show the seed-to-seed noise). Final losses: tail_mean of the training
// loss, the last validation loss (NaN without one). Relative errors (run - base) / base; the
// smoothed ones over the EMA-smoothed training losses, after the first tenth of the steps.
struct RunComparison {
  std::string name, recipe, baseline;
  int seed = 0;
  double train = 0, val = 0, train_rel = 0, val_rel = 0;
  double smooth_rel_mean = 0, smooth_rel_max_abs = 0;
  bool inside_bf16_train = false, inside_bf16_val = false;  // inside [min, max] of the BF16 seeds
};
// A recipe over its seeds: the mean of its final losses against the mean of the BF16 runs of the
// same seeds, and the standard error of the mean of its same-seed relative differences
// (RunComparison::train_rel, val_rel): sample standard deviation / sqrt(seeds), NaN for one seed.
// The seed-to-seed scatter of those differences is the noise a recipe's mean is read against.
struct RecipeComparison {
  // The report's bar (DeepSeek-V3 §3.3): FP8 within 0.25% relative of BF16. False for NaN.
  static bool within_report_bar(double rel) { return std::fabs(rel) <= 0.0025; }

  int seeds = 0;
  double train = 0, val = 0, bf16_train = 0, bf16_val = 0, train_rel = 0, val_rel = 0;
  double train_rel_se = 0, val_rel_se = 0;
};
struct Comparison {
  std::vector<RunComparison> runs;                  // in the order given
  std::map<std::string, RecipeComparison> recipes;  // every recipe but bf16
  int bf16_seeds = 0;
  double bf16_train_min = 0, bf16_train_max = 0, bf16_val_min = 0, bf16_val_max = 0;
  double bf16_train_spread = 0, bf16_val_spread = 0;  // (max - min) / mean over the BF16 seeds
};
// Needs a BF16 run of seed 0 and, for every other run, a BF16 run of its seed.
Comparison compare_runs(const std::vector<CompareRun>& runs);

}  // namespace fp8moe
