// `fp8moe plot`: loss curves from metrics JSON-lines files (written by `fp8moe train`) as SVG.
//   fp8moe plot runs/fp8/metrics.jsonl runs/bf16/metrics.jsonl -o loss.svg --keys loss,val_loss
#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/plot.hpp"
#include "fp8moe/safetensors.hpp"

namespace fp8moe {
namespace {

struct PlotArgs {
  std::vector<std::string> files;
  std::string out = "loss.svg";
  std::vector<std::string> keys{"loss", "val_loss"};
  std::string title = "training loss";
  bool log_y = false;
};

void plot_command(const PlotArgs& args) {
  std::vector<PlotSeries> series;
  for (const std::string& f : args.files) {
    std::ifstream in(f);
    FP8MOE_CHECK(in.good(), "plot: cannot open '" << f << "'");
    std::vector<PlotSeries> per_key(args.keys.size());
    std::string line;
    int lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (line.empty()) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        FP8MOE_CHECK(false, "plot: " << f << ":" << lineno << ": not JSON: " << e.what());
      }
      if (!j.contains("step")) continue;
      for (size_t k = 0; k < args.keys.size(); ++k)
        if (j.contains(args.keys[k]) && j[args.keys[k]].is_number()) {
          per_key[k].x.push_back(j["step"].get<double>());
          per_key[k].y.push_back(j[args.keys[k]].get<double>());
        }
    }
    for (size_t k = 0; k < args.keys.size(); ++k) {
      if (per_key[k].x.empty()) continue;
      per_key[k].label = (args.files.size() > 1 ? f + " " : "") + args.keys[k];
      series.push_back(std::move(per_key[k]));
    }
  }
  FP8MOE_CHECK(!series.empty(), "plot: no values for keys in the given files");
  PlotOptions opt;
  opt.title = args.title;
  opt.y_label = args.keys.size() == 1 ? args.keys[0] : "value";
  opt.log_y = args.log_y;
  write_file_atomic(args.out, render_line_chart_svg(series, opt));
  std::cout << "wrote " << args.out << " (" << series.size() << " series)\n";
}

void add_plot(CLI::App& app) {
  static PlotArgs args;
  auto* cmd = app.add_subcommand("plot", "Render loss curves from metrics.jsonl files to SVG");
  cmd->add_option("files", args.files, "metrics JSON-lines files")->required()->check(CLI::ExistingFile);
  cmd->add_option("-o,--out", args.out, "output SVG file")->capture_default_str();
  cmd->add_option("--keys", args.keys, "metrics to plot")->delimiter(',')->capture_default_str();
  cmd->add_option("--title", args.title, "chart title");
  cmd->add_flag("--log-y", args.log_y, "logarithmic y axis");
  cmd->callback([] { plot_command(args); });
}

const bool registered = cli::register_command(&add_plot);

}  // namespace
}  // namespace fp8moe
