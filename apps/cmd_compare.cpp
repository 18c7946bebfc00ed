// `fp8moe compare`: trains one config, seed and data under bf16 and fp8 (and optionally the
// ablations and more BF16 seeds), then reports the relative loss error of each recipe against BF16
// per step (EMA-smoothed 0.9, as the report's Figure 10) and at the end, next to the BF16
// seed-to-seed spread, with SVG plots. Runs go to <out>/<recipe>[-seed<n>]/.
#include <cmath>
#include <cstdio>
#include <csignal>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "fp8moe/loss_compare.hpp"
#include "fp8moe/plot.hpp"
#include "fp8moe/safetensors.hpp"
#include "train_options.hpp"

namespace fp8moe {
namespace {

namespace fs = std::filesystem;

struct CompareArgs {
  TrainOptions base;
  std::vector<std::string> recipes{"bf16", "fp8"};
  int bf16_seeds = 2;        // BF16 runs with different seeds, for the noise floor
  bool analyze_only = false; // reuse existing runs
};

void on_interrupt(int) { Trainer::stop_flag().store(true); }

void compare_command(CompareArgs& args) {
  std::signal(SIGINT, on_interrupt);
  const std::string out = args.base.out_dir;
  struct Run {
    std::string name, recipe;
    uint64_t seed;
  };
  std::vector<Run> runs;
  for (auto& r : args.recipes) runs.push_back({r, r, args.base.seed});
  for (int s = 1; s < args.bf16_seeds; ++s) runs.push_back({"bf16-seed" + std::to_string(s), "bf16", args.base.seed + uint64_t(s)});
  std::vector<LossCurve> curves;
  for (const Run& r : runs) {
    TrainOptions o = args.base;
    o.recipe = r.recipe;
    o.seed = r.seed;
    o.out_dir = (fs::path(out) / r.name).string();
    if (!args.analyze_only) {
      std::printf("== %s (recipe %s, seed %llu)\n", r.name.c_str(), r.recipe.c_str(), (unsigned long long)r.seed);
      Trainer(o).run();
      if (Trainer::stop_flag().load()) return;
    }
    curves.push_back(read_loss_curve((fs::path(o.out_dir) / "metrics.jsonl").string(), r.name));
  }
  const LossCurve& base = curves[0];
  FP8MOE_CHECK(base.name == "bf16", "compare: the first recipe must be bf16 (the baseline), got '" << base.name << "'");
  const std::vector<double> base_s = ema_smooth(base.loss);
  nlohmann::json report = nlohmann::json::object();
  std::vector<PlotSeries> loss_series, rel_series;
  // BF16 noise floor: final losses of the BF16 seeds.
  std::vector<double> bf16_final, bf16_val;
  for (auto& c : curves)
    if (c.name.rfind("bf16", 0) == 0) {
      bf16_final.push_back(tail_mean(c.loss));
      bf16_val.push_back(c.val_loss.empty() ? NAN : c.val_loss.back());
    }
  auto spread = [](const std::vector<double>& v) {
    double lo = INFINITY, hi = -INFINITY, mean = 0;
    for (double x : v) lo = std::min(lo, x), hi = std::max(hi, x), mean += x;
    mean /= double(v.size());
    return std::array<double, 3>{lo, hi, mean};
  };
  const auto tr = spread(bf16_final), va = spread(bf16_val);
  std::printf("\n%-18s %12s %12s %14s %14s %16s\n", "run", "train loss", "val loss", "train rel err", "val rel err",
              "max |rel| smooth");
  for (auto& c : curves) {
    const std::vector<double> s = ema_smooth(c.loss);
    const std::vector<double> rel = relative_error(s, base_s);
    double max_rel = 0;
    // The first tenth of training (warm-up, loss falling fast) is left out of the maximum.
    for (size_t i = rel.size() / 10; i < rel.size(); ++i) max_rel = std::max(max_rel, std::fabs(rel[i]));
    const double train_final = tail_mean(c.loss), val_final = c.val_loss.empty() ? NAN : c.val_loss.back();
    const double train_rel = (train_final - tail_mean(base.loss)) / tail_mean(base.loss);
    const double val_rel = (val_final - base.val_loss.back()) / base.val_loss.back();
    std::printf("%-18s %12.4f %12.4f %13.3f%% %13.3f%% %15.3f%%\n", c.name.c_str(), train_final, val_final, 100 * train_rel,
                100 * val_rel, 100 * max_rel);
    report[c.name] = {{"train_loss", train_final}, {"val_loss", val_final}, {"train_rel_err", train_rel},
                      {"val_rel_err", val_rel}, {"max_abs_rel_err_smoothed", max_rel}, {"steps", c.steps.size()}};
    loss_series.push_back({c.name, c.steps, s});
    if (&c != &base) {
      std::vector<double> pct(rel.size());
      for (size_t i = 0; i < rel.size(); ++i) pct[i] = 100 * rel[i];
      rel_series.push_back({c.name + " vs bf16", std::vector<double>(c.steps.begin(), c.steps.begin() + long(rel.size())), pct});
    }
  }
  const double tr_spread = (tr[1] - tr[0]) / tr[2], va_spread = (va[1] - va[0]) / va[2];
  report["bf16_seed_spread"] = {{"seeds", bf16_final.size()}, {"train_rel", tr_spread}, {"val_rel", va_spread}};
  std::printf("\nBF16 seed-to-seed spread over %zu seeds: train %.3f%%, validation %.3f%% (max - min) / mean\n",
              bf16_final.size(), 100 * tr_spread, 100 * va_spread);
  for (auto& c : curves)
    if (c.name.rfind("fp8", 0) == 0) {
      const double f = tail_mean(c.loss), v = c.val_loss.empty() ? NAN : c.val_loss.back();
      const bool inside = bf16_final.size() > 1 && f >= tr[0] - 1e-12 && f <= tr[1] + 1e-12;
      const bool inside_val = bf16_val.size() > 1 && v >= va[0] - 1e-12 && v <= va[1] + 1e-12;
      std::printf("%-18s train loss %s the BF16 seed range [%.4f, %.4f]; validation %s [%.4f, %.4f]\n", c.name.c_str(),
                  inside ? "inside" : "outside", tr[0], tr[1], inside_val ? "inside" : "outside", va[0], va[1]);
      report[c.name]["inside_bf16_spread_train"] = inside;
      report[c.name]["inside_bf16_spread_val"] = inside_val;
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
  cmd->add_option("--bf16-seeds", args.bf16_seeds, "BF16 runs with different seeds (noise floor)")->capture_default_str();
  cmd->add_flag("--analyze-only", args.analyze_only, "compare existing runs in --out without training");
  cmd->callback([] { compare_command(args); });
}

const bool registered = cli::register_command(&add_compare);

}  // namespace
}  // namespace fp8moe
