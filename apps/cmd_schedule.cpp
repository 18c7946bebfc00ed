// `fp8moe schedule`: pipeline schedules (report §3.2.1, Table 2, Figure 5) generated, validated and
// simulated on the CPU. Draws the per-rank time line of one method (or all) in the terminal and as
// SVG, then prints bubble, activations and parameters of every method next to Table 2's formulas.
//   fp8moe schedule --method dualpipe --pp 8 --micro-batches 20 --svg dualpipe.svg
// --json prints the op lists, time lines and the comparison instead.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.hpp"
#include "fp8moe/schedule.hpp"

namespace fp8moe {
namespace {

using namespace fp8moe::pipeline;

struct ScheduleArgs {
  std::string method = "dualpipe";
  int pp = 8;
  int micro_batches = 20;
  OpCosts costs;
  std::string svg;
  double columns_per_unit = 0;
  bool color = false;
  bool json = false;
};

// "out.svg" -> "out-zb1p.svg" when several methods are drawn.
std::string svg_path_for(const std::string& path, Method method, bool several) {
  if (!several) return path;
  const auto dot = path.rfind('.');
  const std::string suffix = "-" + std::string(method_name(method));
  return dot == std::string::npos ? path + suffix : path.substr(0, dot) + suffix + path.substr(dot);
}

nlohmann::json schedule_json(const Schedule& s, const Simulation& sim) {
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < s.num_ranks; ++r) {
    nlohmann::json ops = nlohmann::json::array(), timeline = nlohmann::json::array();
    for (const Op& op : s.rank_ops[r]) ops.push_back(op_label(s, op));
    for (const TimedOp& t : sim.ranks[r].compute)
      timeline.push_back({{"op", op_label(s, s.rank_ops[r][size_t(t.op_index)])}, {"start", t.start}, {"end", t.end}});
    ranks.push_back({{"rank", r},
                     {"bubble", sim.ranks[r].bubble},
                     {"peak_activations", sim.ranks[r].peak_activations},
                     {"parameter_stages", sim.ranks[r].parameter_stages},
                     {"ops", ops},
                     {"timeline", timeline}});
  }
  return {{"method", method_name(s.method)}, {"ranks", s.num_ranks},       {"stages", s.num_stages},
          {"micro_batches", s.num_micro_batches}, {"makespan", sim.makespan}, {"bubble", sim.bubble},
          {"peak_activations", sim.peak_activations}, {"per_rank", ranks}};
}

void schedule_command(const ScheduleArgs& args) {
  check_costs(args.costs);
  const bool all = args.method == "all";
  const std::vector<Method> methods = all ? all_methods() : std::vector<Method>{parse_method(args.method)};
  nlohmann::json drawn = nlohmann::json::array();
  for (Method method : methods) {
    Schedule s;
    try {
      s = make_schedule(method, args.pp, args.micro_batches);
    } catch (const Error&) {
      if (!all) throw;  // asked for this method: its constraint is the error
      continue;         // --method all: the table below says why it is missing
    }
    validate_schedule(s);
    const Simulation sim = simulate(s, args.costs);
    if (args.json) {
      drawn.push_back(schedule_json(s, sim));
    } else {
      TextTimelineOptions text;
      text.columns_per_unit = args.columns_per_unit;
      text.color = args.color;
      std::printf("%s\n", render_timeline_text(s, sim, args.costs, text).c_str());
    }
    if (!args.svg.empty()) {
      const std::string path = svg_path_for(args.svg, method, all);
      std::ofstream out(path);
      FP8MOE_CHECK(out, "svg: cannot write '" << path << "'");
      out << render_timeline_svg(s, sim, args.costs);
      if (!args.json) std::printf("wrote %s\n\n", path.c_str());
    }
  }
  const auto rows = compare_methods(args.pp, args.micro_batches, args.costs);
  if (!args.json) {
    std::printf("%s", render_comparison_table(args.pp, args.micro_batches, args.costs, rows).c_str());
    return;
  }
  nlohmann::json table = nlohmann::json::array();
  for (const auto& r : rows) {
    if (!r.refused.empty()) {
      table.push_back({{"method", method_name(r.method)}, {"refused", r.refused}});
      continue;
    }
    table.push_back({{"method", method_name(r.method)},
                     {"ranks", r.ranks},
                     {"makespan", r.sim.makespan},
                     {"bubble", r.sim.bubble},
                     {"bubble_table2", r.formula.bubble},
                     {"activations", r.sim.peak_activations},
                     {"activations_table2", r.formula.activations},
                     {"parameter_stages", r.sim.parameter_stages},
                     {"parameter_stages_table2", r.formula.parameter_stages}});
  }
  const nlohmann::json out = {{"pp", args.pp},
                              {"micro_batches", args.micro_batches},
                              {"costs",
                               {{"F", args.costs.forward},
                                {"B", args.costs.backward},
                                {"W", args.costs.weight},
                                {"F&B", args.costs.forward_backward},
                                {"comm", args.costs.comm_latency}}},
                              {"schedules", drawn},
                              {"comparison", table}};
  std::printf("%s\n", out.dump(2).c_str());
}

void add_schedule(CLI::App& app) {
  static ScheduleArgs args;
  auto* cmd = app.add_subcommand(
      "schedule", "Pipeline schedules (1F1B, ZB1P, DualPipe, DualPipeV): draw, validate, compare with Table 2");
  cmd->add_option("--method", args.method, "1f1b, zb1p, dualpipe, dualpipev or all")
      ->check(CLI::IsMember({"1f1b", "zb1p", "dualpipe", "dualpipev", "all"}))
      ->capture_default_str();
  cmd->add_option("--pp", args.pp, "pipeline stages (ranks; DualPipeV folds them onto pp/2 ranks)")
      ->capture_default_str();
  cmd->add_option("--micro-batches", args.micro_batches, "micro-batches per step")->capture_default_str();
  cmd->add_option("--cost-f", args.costs.forward, "time of a forward chunk F")->capture_default_str();
  cmd->add_option("--cost-b", args.costs.backward, "time of a full backward chunk B (input + weights)")
      ->capture_default_str();
  cmd->add_option("--cost-w", args.costs.weight, "time of a backward-for-weights chunk W")->capture_default_str();
  cmd->add_option("--cost-fb", args.costs.forward_backward, "time of an overlapped F&B pair")
      ->capture_default_str();
  cmd->add_option("--comm", args.costs.comm_latency, "point-to-point latency between ranks")->capture_default_str();
  cmd->add_option("--svg", args.svg, "also write the time line as SVG (with --method all: FILE-<method>.svg)");
  cmd->add_option("--columns-per-unit", args.columns_per_unit, "text columns per time unit (0: fit the labels)");
  cmd->add_flag("--color", args.color, "colour the text time line (ANSI)");
  cmd->add_flag("--json", args.json, "print JSON: op lists, time lines and the comparison");
  cmd->callback([] { schedule_command(args); });
}

const bool registered = cli::register_command(&add_schedule);

}  // namespace
}  // namespace fp8moe
