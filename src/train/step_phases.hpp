// FP8MOE_PROFILE_STEP=1: where the host's wall time of a training step goes, phase by phase
// (mark(i) ends phase i), as the mean over the steps after the first three (warm-up: recordings,
// plans, pool growth), printed to stderr when the run ends. Host clocks only: it adds no wait and
// keeps graphs on. A phase that waits for the device (the forward and backward end with one)
// holds the device's time too.
#pragma once
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace fp8moe {

class StepPhases {
 public:
  static constexpr int kPhases = 6;
  StepPhases() : enabled_(std::getenv("FP8MOE_PROFILE_STEP") != nullptr) {}
  bool enabled() const { return enabled_; }
  void begin_step(int64_t step) {
    if (!enabled_) return;
    counted_ = step >= first_step_ + 3;
    last_ = std::chrono::steady_clock::now();
  }
  void set_first_step(int64_t step) { first_step_ = step; }
  void mark(int phase) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (counted_) sum_[size_t(phase)] += std::chrono::duration<double>(now - last_).count();
    if (counted_ && phase == kPhases - 1) ++steps_;
    last_ = now;
  }
  void print() const {
    if (!enabled_ || steps_ == 0) return;
    static constexpr std::array<const char*, kPhases> kNames = {
        "batch", "forward+backward (device wait)", "gradient norm", "optimizer + routing bias", "EMA update",
        "metrics, log, eval"};
    double total = 0;
    for (double s : sum_) total += s;
    std::fprintf(stderr, "# step phases (FP8MOE_PROFILE_STEP, host wall, mean of %lld steps): %.3f ms per step\n",
                 (long long)steps_, 1e3 * total / double(steps_));
    for (int i = 0; i < kPhases; ++i)
      std::fprintf(stderr, "%-34s %9.3f ms %6.1f%%\n", kNames[size_t(i)], 1e3 * sum_[size_t(i)] / double(steps_),
                   total > 0 ? 100.0 * sum_[size_t(i)] / total : 0.0);
  }

 private:
  bool enabled_;
  bool counted_ = false;
  int64_t first_step_ = 0, steps_ = 0;
  std::array<double, kPhases> sum_{};
  std::chrono::steady_clock::time_point last_;
};

}  // namespace fp8moe
