// Table 2 of the report as formulas, and every method simulated side by side against them.
#include <cstdio>
#include <sstream>

#include "schedule_build.hpp"

namespace fp8moe::pipeline {

Table2Row table2_row(Method method, int pp, const OpCosts& c) {
  switch (method) {
    case Method::OneFOneB: return {(pp - 1) * (c.forward + c.backward), 1, pp};
    case Method::ZB1P: return {(pp - 1) * (c.forward + c.backward - 2 * c.weight), 1, pp};
    case Method::DualPipe:
    case Method::DualPipeV:
      return {(pp / 2 - 1) * (c.forward_backward + c.backward - 3 * c.weight), 2, pp + 1};
  }
  return {};
}

std::vector<MethodComparison> compare_methods(int pp, int micro_batches, const OpCosts& costs) {
  std::vector<MethodComparison> rows;
  for (Method method : all_methods()) {
    MethodComparison row;
    row.method = method;
    try {
      const Schedule s = make_schedule(method, pp, micro_batches);
      row.ranks = s.num_ranks;
      row.sim = simulate(s, costs);
      row.formula = table2_row(method, pp, costs);
    } catch (const Error& e) {
      row.refused = e.what();
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

std::string render_comparison_table(int pp, int micro_batches, const OpCosts& c,
                                    const std::vector<MethodComparison>& rows) {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line,
                "PP=%d, %d micro-batches; F=%g B=%g W=%g F&B=%g comm=%g (bubble per rank, in time units;\n"
                "activations in stage-activations of one micro-batch; parameters in stages per rank)\n",
                pp, micro_batches, c.forward, c.backward, c.weight, c.forward_backward, c.comm_latency);
  os << line;
  std::snprintf(line, sizeof line, "%-10s %5s %9s %9s %9s %11s %9s %10s %9s\n", "method", "ranks",
                "makespan", "bubble", "Table 2", "activations", "Table 2", "parameters", "Table 2");
  os << line;
  for (const auto& r : rows) {
    if (!r.refused.empty()) {
      std::snprintf(line, sizeof line, "%-10s refused: ", std::string(method_name(r.method)).c_str());
      os << line << r.refused << "\n";
      continue;
    }
    std::snprintf(line, sizeof line, "%-10s %5d %9.4g %9.4g %9.4g %11d %9d %9dx %8dx\n",
                  std::string(method_name(r.method)).c_str(), r.ranks, r.sim.makespan, r.sim.bubble,
                  r.formula.bubble, r.sim.peak_activations, r.formula.activations, r.sim.parameter_stages,
                  r.formula.parameter_stages);
    os << line;
  }
  return os.str();
}

}  // namespace fp8moe::pipeline
