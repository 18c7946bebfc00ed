// Loss-curve comparison helpers (include/fp8moe/loss_compare.hpp).
#include "fp8moe/loss_compare.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fp8moe/error.hpp"

namespace fp8moe {

LossCurve read_loss_curve(const std::string& metrics_path, const std::string& name) {
  std::ifstream in(metrics_path);
  FP8MOE_CHECK(in.good(), "compare: cannot open '" << metrics_path << "'");
  LossCurve c;
  c.name = name;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    // A resumed run appends: a step seen again replaces everything from it on.
    const double step = j.at("step").get<double>();
    while (!c.steps.empty() && c.steps.back() >= step) {
      c.steps.pop_back();
      c.loss.pop_back();
    }
    while (!c.val_steps.empty() && c.val_steps.back() >= step) {
      c.val_steps.pop_back();
      c.val_loss.pop_back();
    }
    c.steps.push_back(step);
    c.loss.push_back(j.at("loss").get<double>());
    if (j.contains("val_loss")) {
      c.val_steps.push_back(step);
      c.val_loss.push_back(j["val_loss"].get<double>());
    }
  }
  FP8MOE_CHECK(!c.steps.empty(), "compare: '" << metrics_path << "' holds no steps");
  return c;
}

LossCurve truncate_curve(const LossCurve& c, double horizon) {
  if (horizon <= 0) return c;
  LossCurve t;
  t.name = c.name;
  for (size_t i = 0; i < c.steps.size() && c.steps[i] < horizon; ++i) {
    t.steps.push_back(c.steps[i]);
    t.loss.push_back(c.loss[i]);
  }
  for (size_t i = 0; i < c.val_steps.size() && c.val_steps[i] < horizon; ++i) {
    t.val_steps.push_back(c.val_steps[i]);
    t.val_loss.push_back(c.val_loss[i]);
  }
  FP8MOE_CHECK(!t.steps.empty(), "compare: run '" << c.name << "' has no step before the horizon " << horizon);
  return t;
}

std::vector<double> ema_smooth(const std::vector<double>& x, double a) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = i == 0 ? x[0] : a * y[i - 1] + (1 - a) * x[i];
  return y;
}

std::vector<double> relative_error(const std::vector<double>& run, const std::vector<double>& base) {
  const size_t n = std::min(run.size(), base.size());
  std::vector<double> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = (run[i] - base[i]) / base[i];
  return r;
}

double tail_mean(const std::vector<double>& x, double frac) {
  FP8MOE_CHECK(!x.empty(), "tail_mean: empty series");
  const size_t n = std::max<size_t>(1, size_t(double(x.size()) * frac));
  double s = 0;
  for (size_t i = x.size() - n; i < x.size(); ++i) s += x[i];
  return s / double(n);
}

namespace {

double final_val(const LossCurve& c) { return c.val_loss.empty() ? NAN : c.val_loss.back(); }
double rel(double run, double base) { return (run - base) / base; }

// Standard error of the mean of x: sample standard deviation / sqrt(n); NaN below two values.
double standard_error(const std::vector<double>& x) {
  const size_t n = x.size();
  if (n < 2) return NAN;
  double mean = 0, ss = 0;
  for (double v : x) mean += v;
  mean /= double(n);
  for (double v : x) ss += (v - mean) * (v - mean);
  return std::sqrt(ss / double(n - 1) / double(n));
}

}  // namespace

Comparison compare_runs(const std::vector<CompareRun>& runs) {
  std::map<int, const CompareRun*> bf16;  // by seed
  for (const CompareRun& r : runs)
    if (r.recipe == "bf16") bf16[r.seed] = &r;
  FP8MOE_CHECK(bf16.count(0), "compare: no bf16 run of seed 0 (the baseline)");
  Comparison cmp;
  cmp.bf16_seeds = int(bf16.size());
  cmp.bf16_train_min = cmp.bf16_val_min = INFINITY;
  cmp.bf16_train_max = cmp.bf16_val_max = -INFINITY;
  double train_sum = 0, val_sum = 0;
  for (const auto& [seed, r] : bf16) {
    const double t = tail_mean(r->curve.loss), v = final_val(r->curve);
    cmp.bf16_train_min = std::min(cmp.bf16_train_min, t), cmp.bf16_train_max = std::max(cmp.bf16_train_max, t);
    cmp.bf16_val_min = std::min(cmp.bf16_val_min, v), cmp.bf16_val_max = std::max(cmp.bf16_val_max, v);
    train_sum += t, val_sum += v;
  }
  cmp.bf16_train_spread = (cmp.bf16_train_max - cmp.bf16_train_min) / (train_sum / double(bf16.size()));
  cmp.bf16_val_spread = (cmp.bf16_val_max - cmp.bf16_val_min) / (val_sum / double(bf16.size()));
  for (const CompareRun& r : runs) {
    const bool is_bf16 = r.recipe == "bf16";
    const auto base_it = bf16.find(is_bf16 ? 0 : r.seed);
    FP8MOE_CHECK(base_it != bf16.end(), "compare: run '" << r.curve.name << "' (seed " << r.seed
                                                         << ") has no bf16 run of the same seed");
    const LossCurve& base = base_it->second->curve;
    RunComparison c;
    c.name = r.curve.name, c.recipe = r.recipe, c.baseline = base.name, c.seed = r.seed;
    c.train = tail_mean(r.curve.loss), c.val = final_val(r.curve);
    c.train_rel = rel(c.train, tail_mean(base.loss));
    c.val_rel = rel(c.val, final_val(base));
    const std::vector<double> e = relative_error(ema_smooth(r.curve.loss), ema_smooth(base.loss));
    // The first tenth of training (warm-up, loss falling fast) is left out.
    double sum = 0;
    size_t n = 0;
    for (size_t i = e.size() / 10; i < e.size(); ++i, ++n) {
      sum += e[i];
      c.smooth_rel_max_abs = std::max(c.smooth_rel_max_abs, std::fabs(e[i]));
    }
    c.smooth_rel_mean = n ? sum / double(n) : 0.0;
    constexpr double kTol = 1e-12;
    c.inside_bf16_train = c.train >= cmp.bf16_train_min - kTol && c.train <= cmp.bf16_train_max + kTol;
    c.inside_bf16_val = c.val >= cmp.bf16_val_min - kTol && c.val <= cmp.bf16_val_max + kTol;
    cmp.runs.push_back(c);
    if (is_bf16) continue;
    RecipeComparison& m = cmp.recipes[r.recipe];
    m.seeds += 1;
    m.train += c.train, m.val += c.val;
    m.bf16_train += tail_mean(base.loss), m.bf16_val += final_val(base);
  }
  for (auto& [recipe, m] : cmp.recipes) {
    const double n = double(m.seeds);
    m.train /= n, m.val /= n, m.bf16_train /= n, m.bf16_val /= n;
    m.train_rel = rel(m.train, m.bf16_train);
    m.val_rel = rel(m.val, m.bf16_val);
    std::vector<double> train_rel, val_rel;  // the recipe's same-seed differences
    for (const RunComparison& c : cmp.runs)
      if (c.recipe == recipe) train_rel.push_back(c.train_rel), val_rel.push_back(c.val_rel);
    m.train_rel_se = standard_error(train_rel);
    m.val_rel_se = standard_error(val_rel);
  }
  return cmp;
}

}  // namespace fp8moe
