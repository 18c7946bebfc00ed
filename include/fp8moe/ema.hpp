// Exponential moving average of the parameters (report §3.2.3), updated after each step without
// the training loop waiting. Two placements, the same arithmetic per element and so the same bits:
// - host (the report's): the averages in CPU memory, which costs the device no memory; each
//   update copies the weights asynchronously (Backend::copy_to_host_async) into page-locked
//   staging and a background thread folds them in once they have arrived. The copy overlaps the
//   next step's forward and backward; only its optimizer waits for it (fence()), on the device.
//   The bus and the host's memory bandwidth bound it: 8 bytes per weight each step.
// - device (Backend::folds_ema): the averages beside the weights, folded in by one pass on the
//   device in stream order, which takes 12 bytes per weight of device bandwidth and 4 of memory.
#pragma once
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/optimizer.hpp"

namespace fp8moe {

class ParameterEma {
 public:
  enum class Placement { host, device };
  // The parameters live on `backend`'s device; on the host, `threads` host threads fold each
  // snapshot in. Placement::device needs backend.folds_ema().
  ParameterEma(const std::vector<ParamRef>& params, float decay, Backend& backend, int threads = 1,
               Placement placement = Placement::host);
  ~ParameterEma();
  ParameterEma(const ParameterEma&) = delete;
  ParameterEma& operator=(const ParameterEma&) = delete;

  // Snapshots the parameters now and updates the average in the background. Waits first for the
  // previous update, so at most one is in flight (on the device: queued in stream order).
  void update_async();
  // Blocks until the average includes every snapshot taken.
  void wait();
  // Device work queued after this (the optimizer's update of the weights) waits for the snapshot's
  // copies; no host wait. The device's fold needs none: it is in the stream's order.
  void fence() { backend_.fence_copies(); }
  // The averaged weights, parallel to the parameters given at construction ([same shape] f32, in
  // host memory or on the parameters' device as placed). Call wait() first.
  const std::vector<Tensor>& averages() const { return ema_; }
  std::vector<Tensor>& averages() { return ema_; }
  int64_t updates() const { return updates_; }
  void set_updates(int64_t n) { updates_ = n; }
  float decay() const { return decay_; }
  Placement placement() const { return on_device_ ? Placement::device : Placement::host; }

 private:
  void worker();
  void fold();  // average = decay * average + (1 - decay) * staging, over threads_
  std::vector<ParamRef> params_;
  float decay_;
  Backend& backend_;
  int threads_;
  bool on_device_;  // Placement::device: no staging, no thread
  std::vector<Tensor> ema_;
  // Every snapshot's staging in one allocation: page-locking costs milliseconds per call, and a
  // model's parameters fall into a hundred or more runs.
  Tensor staging_;  // [all parameters] f32, page-locked where the backend has it
  struct Snapshot {  // parameters contiguous in memory, copied at once
    TensorView source, staging;
  };
  std::vector<Snapshot> snapshots_;
  std::vector<const float*> staged_;  // each parameter's values in its snapshot's staging
  struct Piece {  // a chunk of one average and its staged values: the fold's unit of work
    float* e;
    const float* s;
    int64_t n;
  };
  std::vector<Piece> pieces_;
  int64_t updates_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool pending_ = false, stop_ = false;
  std::thread thread_;
};

}  // namespace fp8moe
