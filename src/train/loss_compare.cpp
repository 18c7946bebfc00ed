// Loss-curve comparison helpers (include/fp8moe/loss_compare.hpp).
#include "fp8moe/loss_compare.hpp"

#include <algorithm>
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

}  // namespace fp8moe
