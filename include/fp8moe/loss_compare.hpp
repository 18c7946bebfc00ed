// Comparing training runs the way the report's Figure 10 does: losses smoothed by an exponential
// moving average (0.9), the relative error of a run against a baseline per step, and a final loss
// averaged over the last steps so one noisy batch does not decide the verdict.
#pragma once
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
// y_t = a * y_{t-1} + (1 - a) * x_t, y_0 = x_0 (bias-free start).
std::vector<double> ema_smooth(const std::vector<double>& x, double a = 0.9);
// (run - base) / base elementwise over the common prefix of the two series.
std::vector<double> relative_error(const std::vector<double>& run, const std::vector<double>& base);
// Mean of the last `frac` of the values (at least one).
double tail_mean(const std::vector<double>& x, double frac = 0.1);

}  // namespace fp8moe
