// `fp8moe compare`: trains one config and data under bf16 and fp8 (and optionally the ablations),
// over one or more seeds and more BF16 seeds, then reports the relative loss error of each run
// against BF16 of the same seed per step (EMA-smoothed 0.9, as the report's Figure 10) and at the
// end (or at --horizon), the means over the seeds, and the BF16 seed-to-seed spread, with SVG
// plots (loss_compare.hpp). Runs go to <out>/<recipe>[-seed<k>]/ (seed --seed + k).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <csignal>
#include <filesystem>
#include <map>
#include <regex>
#include <tuple>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/loss_compare.hpp"
#include "fp8moe/model_recipe.hpp"
#include "fp8moe/plot.hpp"
#include "fp8moe/safetensors.hpp"
#include "train_options.hpp"

namespace fp8moe {
namespace {

namespace fs = std::filesystem;

struct CompareArgs {
  TrainOptions base;
  std::vector<std::string> recipes{"bf16", "fp8"};
  int seeds = 1;             // seeds per recipe: base, base + 1, ...
  int bf16_seeds = 2;        // BF16 runs with different seeds, for the noise floor (at least `seeds`)
  double horizon = 0;        // compare at this step (0: the end)
  bool analyze_only = false; // reuse existing runs
};

void on_interrupt(int) {
  Trainer::stop_flag().store(true);
  std::signal(SIGINT, SIG_DFL);
}

// <out>/<recipe> for seed 0, <out>/<recipe>-seed<k> for seed k.
std::string run_name(const std::string& recipe, int k) {
  return k == 0 ? recipe : recipe + "-seed" + std::to_string(k);
}

// The options of every run (seed by seed, so that an interrupted comparison already holds whole
// pairs; then the extra BF16 seeds of the noise floor), each checked with its folder before any
// is trained.
struct PlannedRun {
  std::string name;
  int seed_index;
  TrainOptions opt;
};

std::vector<PlannedRun> planned_runs(const CompareArgs& args) {
  const int bf16_seeds = std::max(args.seeds, args.bf16_seeds);
  std::vector<PlannedRun> plan;
  for (int k = 0; k < bf16_seeds; ++k)
    for (const std::string& r : args.recipes) {
      if (k >= (r == "bf16" ? bf16_seeds : args.seeds)) continue;
      TrainOptions o = args.base;
      o.recipe = r;
      o.seed = args.base.seed + uint64_t(k);
      o.out_dir = (fs::path(args.base.out_dir) / run_name(r, k)).string();
      validate_train_options(o);
      check_run_folder(o.out_dir, o.resume, o.overwrite);
      plan.push_back({run_name(r, k), k, o});
    }
  return plan;
}

// Trains the runs and reads their curves.
std::vector<CompareRun> train_runs(const CompareArgs& args) {
  std::vector<CompareRun> runs;
  for (const auto& [name, k, o] : planned_runs(args)) {
    std::printf("== %s (recipe %s, seed %llu)\n", name.c_str(), o.recipe.c_str(), (unsigned long long)o.seed);
    const TrainSummary s = Trainer(o).run();
    if (s.interrupted)
      throw Interrupted("compare: " + name + " " + interrupted_message(s) + "; the finished runs are in " + args.base.out_dir);
    const LossCurve c = read_loss_curve((fs::path(o.out_dir) / "metrics.jsonl").string(), name);
    runs.push_back({o.recipe, k, truncate_curve(c, args.horizon)});
  }
  return runs;
}

// The runs found in `out`: every <recipe>[-seed<k>]/metrics.jsonl of a known recipe, by seed, bf16
// first.
std::vector<CompareRun> found_runs(const std::string& out, double horizon) {
  const std::vector<std::string> known = Recipe::names();
  const std::regex name_re("(.+)-seed([0-9]+)");
  std::vector<CompareRun> runs;
  FP8MOE_CHECK(fs::is_directory(out), "compare: --analyze-only: --out '" << out << "' is not a folder");
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    const fs::path metrics = e.path() / "metrics.jsonl";
    if (!e.is_directory() || !fs::exists(metrics)) continue;
    std::smatch m;
    const bool seeded = std::regex_match(name, m, name_re);
    const std::string recipe = seeded ? m[1].str() : name;
    if (std::find(known.begin(), known.end(), recipe) == known.end()) continue;
    runs.push_back({recipe, seeded ? std::stoi(m[2].str()) : 0, truncate_curve(read_loss_curve(metrics.string(), name), horizon)});
  }
  FP8MOE_CHECK(!runs.empty(), "compare: no runs (<recipe>[-seed<k>]/metrics.jsonl) in '" << out << "'");
  std::sort(runs.begin(), runs.end(), [](const CompareRun& a, const CompareRun& b) {
    return std::tuple(a.seed, a.recipe != "bf16", a.recipe) < std::tuple(b.seed, b.recipe != "bf16", b.recipe);
  });
  return runs;
}

void compare_command(CompareArgs& args) {
  std::signal(SIGINT, on_interrupt);
  const std::string out = args.base.out_dir;
  FP8MOE_CHECK(!args.recipes.empty() && args.recipes[0] == "bf16",
               "compare: the first recipe must be bf16 (the baseline), got '" << (args.recipes.empty() ? "" : args.recipes[0]) << "'");
  FP8MOE_CHECK(args.seeds >= 1, "compare: --seeds must be >= 1, got " << args.seeds);
  FP8MOE_CHECK(args.bf16_seeds >= 1, "compare: --bf16-seeds must be >= 1, got " << args.bf16_seeds);
  FP8MOE_CHECK(std::isfinite(args.horizon) && args.horizon >= 0,
               "compare: --horizon must be >= 0 (0: the end), got " << args.horizon);
  const std::vector<CompareRun> runs = args.analyze_only ? found_runs(out, args.horizon) : train_runs(args);
  double first_end = INFINITY, last_end = -INFINITY;
  for (const CompareRun& r : runs) {
    first_end = std::min(first_end, r.curve.steps.back());
    last_end = std::max(last_end, r.curve.steps.back());
  }
  if (first_end != last_end)
    std::printf("note: the runs end at steps %.0f to %.0f; --horizon %.0f compares them at the same step\n", first_end,
                last_end, first_end + 1);
  const Comparison cmp = compare_runs(runs);

  std::map<std::string, const LossCurve*> by_name;
  for (const CompareRun& r : runs) by_name[r.curve.name] = &r.curve;
  nlohmann::json report = nlohmann::json::object();
  std::vector<PlotSeries> loss_series, rel_series;
  std::printf("\n%s; relative errors against the bf16 run of the same seed (bf16 rows: against bf16 seed 0)\n",
              args.horizon > 0 ? ("at step " + std::to_string(int64_t(args.horizon))).c_str() : "at the end");
  std::printf("%-18s %12s %12s %14s %14s %16s %16s\n", "run", "train loss", "val loss", "train rel err", "val rel err",
              "mean rel smooth", "max |rel| smooth");
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunComparison& c = cmp.runs[i];
    std::printf("%-18s %12.4f %12.4f %13.3f%% %13.3f%% %15.3f%% %15.3f%%\n", c.name.c_str(), c.train, c.val,
                100 * c.train_rel, 100 * c.val_rel, 100 * c.smooth_rel_mean, 100 * c.smooth_rel_max_abs);
    report[c.name] = {{"recipe", c.recipe}, {"seed_index", c.seed}, {"baseline", c.baseline},
                      {"train_loss", c.train}, {"val_loss", c.val}, {"train_rel_err", c.train_rel},
                      {"val_rel_err", c.val_rel}, {"mean_rel_err_smoothed", c.smooth_rel_mean},
                      {"max_abs_rel_err_smoothed", c.smooth_rel_max_abs}, {"steps", runs[i].curve.steps.size()},
                      {"inside_bf16_spread_train", c.inside_bf16_train}, {"inside_bf16_spread_val", c.inside_bf16_val}};
    const LossCurve& curve = runs[i].curve;
    loss_series.push_back({c.name, curve.steps, ema_smooth(curve.loss)});
    if (c.name == c.baseline) continue;
    const LossCurve& base = *by_name.at(c.baseline);
    std::vector<double> pct = relative_error(ema_smooth(curve.loss), ema_smooth(base.loss));
    for (double& v : pct) v *= 100;
    rel_series.push_back({c.name + " vs " + c.baseline, std::vector<double>(curve.steps.begin(), curve.steps.begin() + long(pct.size())), pct});
  }
  report["bf16_seed_spread"] = {{"seeds", cmp.bf16_seeds}, {"train_rel", cmp.bf16_train_spread},
                                {"val_rel", cmp.bf16_val_spread}};
  std::printf("\nBF16 seed-to-seed spread over %d seeds: train %.3f%%, validation %.3f%% (max - min) / mean\n",
              cmp.bf16_seeds, 100 * cmp.bf16_train_spread, 100 * cmp.bf16_val_spread);
  for (const RunComparison& c : cmp.runs)
    if (c.recipe != "bf16" && cmp.bf16_seeds > 1)
      std::printf("%-18s train loss %s the BF16 seed range [%.4f, %.4f]; validation %s [%.4f, %.4f]\n", c.name.c_str(),
                  c.inside_bf16_train ? "inside" : "outside", cmp.bf16_train_min, cmp.bf16_train_max,
                  c.inside_bf16_val ? "inside" : "outside", cmp.bf16_val_min, cmp.bf16_val_max);
  for (const auto& [recipe, m] : cmp.recipes) {
    std::printf("%-18s mean over %d seeds: train %.4f against bf16 %.4f (%+.3f%%), validation %.4f against %.4f (%+.3f%%)\n",
                recipe.c_str(), m.seeds, m.train, m.bf16_train, 100 * m.train_rel, m.val, m.bf16_val, 100 * m.val_rel);
    if (m.seeds > 1)
      std::printf("%-18s standard error of the mean same-seed difference: train %.3f%%, validation %.3f%%\n", "",
                  100 * m.train_rel_se, 100 * m.val_rel_se);
    auto verdict = [](double rel) {
      return std::isnan(rel) ? "n/a" : RecipeComparison::within_report_bar(rel) ? "met" : "not met";
    };
    std::printf("%-18s the report's bar (|relative error| <= 0.25%%): train %s, validation %s\n", "",
                verdict(m.train_rel), verdict(m.val_rel));
    report["recipes"][recipe] = {{"seeds", m.seeds}, {"train_loss", m.train}, {"val_loss", m.val},
                                 {"bf16_train_loss", m.bf16_train}, {"bf16_val_loss", m.bf16_val},
                                 {"train_rel_err", m.train_rel}, {"val_rel_err", m.val_rel},
                                 {"train_rel_err_se", m.seeds > 1 ? nlohmann::json(m.train_rel_se) : nlohmann::json()},
                                 {"val_rel_err_se", m.seeds > 1 ? nlohmann::json(m.val_rel_se) : nlohmann::json()},
                                 {"train_within_0_25pct", RecipeComparison::within_report_bar(m.train_rel)},
                                 {"val_within_0_25pct", RecipeComparison::within_report_bar(m.val_rel)}};
  }
  PlotOptions lo;
  lo.title = "training loss (EMA 0.9)";
  lo.y_label = "loss";
  write_file_atomic((fs::path(out) / "loss.svg").string(), render_line_chart_svg(loss_series, lo));
  PlotOptions ro;
  ro.title = "relative loss error vs bf16 (EMA 0.9)";
  ro.y_label = "%";
  write_file_atomic((fs::path(out) / "relative_error.svg").string(), render_line_chart_svg(rel_series, ro));
  write_file_atomic((fs::path(out) / "compare.json").string(), report.dump(2) + "\n");
  std::printf("wrote %s/{compare.json, loss.svg, relative_error.svg}\n", out.c_str());
}

void add_compare(CLI::App& app) {
  static CompareArgs args;
  args.base.out_dir = "runs/compare";
  auto* cmd = app.add_subcommand("compare", "Train under bf16 and fp8 (and ablations) and compare the losses");
  cli::add_train_options(cmd, args.base);
  cmd->add_option("--recipes", args.recipes, "recipes, bf16 first")->delimiter(',')->capture_default_str();
  cmd->add_option("--seeds", args.seeds, "seeds per recipe (--seed, --seed + 1, ...), each run against bf16 of its seed")
      ->capture_default_str();
  cmd->add_option("--bf16-seeds", args.bf16_seeds, "BF16 runs with different seeds (noise floor; at least --seeds)")
      ->capture_default_str();
  cmd->add_option("--horizon", args.horizon, "compare at this step: the losses the runs had then (0: the end)")
      ->capture_default_str();
  cmd->add_flag("--analyze-only", args.analyze_only,
                "compare the runs found in --out (<recipe>[-seed<k>]/metrics.jsonl) without training");
  cmd->callback([] { compare_command(args); });
}

const bool registered = cli::register_command(&add_compare);

}  // namespace
}  // namespace fp8moe
