// Exponential moving average of the parameters kept in CPU memory (report §3.2.3): after each step
// the current weights are copied into a host staging buffer and a background thread folds them
// into the average, so the update costs the training loop one copy and no device memory.
#pragma once
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "fp8moe/optimizer.hpp"

namespace fp8moe {

class ParameterEma {
 public:
  // `copy_to_host(dst, src)` copies a parameter (on any device) into host memory; the default is
  // memcpy for host parameters.
  using CopyFn = std::function<void(const TensorView& dst, const TensorView& src)>;
  ParameterEma(const std::vector<ParamRef>& params, float decay, CopyFn copy_to_host = {});
  ~ParameterEma();
  ParameterEma(const ParameterEma&) = delete;
  ParameterEma& operator=(const ParameterEma&) = delete;

  // Snapshots the parameters now and updates the average in the background. Waits first for the
  // previous update, so at most one is in flight.
  void update_async();
  // Blocks until the average includes every snapshot taken.
  void wait();
  // The averaged weights, parallel to the parameters given at construction ([same shape] f32).
  // Call wait() first.
  const std::vector<Tensor>& averages() const { return ema_; }
  std::vector<Tensor>& averages() { return ema_; }
  int64_t updates() const { return updates_; }
  void set_updates(int64_t n) { updates_ = n; }
  float decay() const { return decay_; }

 private:
  void worker();
  std::vector<ParamRef> params_;
  float decay_;
  CopyFn copy_;
  std::vector<Tensor> ema_, staging_;
  int64_t updates_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool pending_ = false, stop_ = false;
  std::thread thread_;
};

}  // namespace fp8moe
