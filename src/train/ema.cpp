// Parameter EMA in host memory, folded on a background thread, or on the device (include/fp8moe/ema.hpp).
#include "fp8moe/ema.hpp"

#include <algorithm>

namespace fp8moe {

ParameterEma::ParameterEma(const std::vector<ParamRef>& params, float decay, Backend& backend, int threads,
                           Placement placement)
    : params_(params), decay_(decay), backend_(backend), threads_(threads), on_device_(placement == Placement::device) {
  FP8MOE_CHECK(decay > 0 && decay < 1, "ema: decay must be in (0, 1), got " << decay);
  FP8MOE_CHECK(threads >= 1, "ema: threads must be >= 1, got " << threads);
  FP8MOE_CHECK(!on_device_ || backend.folds_ema(),
               "ema: averages on the device need a backend that folds them there; '" << backend.name() << "' does not");
  int64_t total = 0;
  for (auto& p : params_) {
    FP8MOE_CHECK(p.value.dtype == DType::f32 && p.value.is_contiguous(),
                 "ema: " << p.name << " must be a contiguous f32 tensor, got " << p.value.str());
    total += p.value.numel();
  }
  if (on_device_) {  // the averages in one device allocation, each starting at the initial weights
    auto all = std::make_shared<Tensor>(backend_.empty(DType::f32, {total}));
    float* next = all->ptr<float>();
    for (auto& p : params_) {
      TensorView v = p.value;
      v.data = next;
      ema_.emplace_back(std::shared_ptr<void>(all, next), v);
      backend_.copy(ema_.back().view(), p.value);
      next += p.value.numel();
    }
    return;
  }
  for (auto& p : params_) {
    ema_.push_back(Tensor::host_like(p.value));
    backend_.copy(ema_.back().view(), p.value);
  }
  // One snapshot copy per run of parameters that follow each other in memory (the routed
  // experts' stacked matrices), each into its range of one staging tensor.
  staged_.resize(params_.size());
  const std::vector<ParamRun> runs = contiguous_runs(params_, false);
  staging_ = backend_.empty_host(DType::f32, {total});
  float* next = staging_.ptr<float>();
  for (const ParamRun& r : runs) {
    const Snapshot snap{r.value(params_), TensorView(next, DType::f32, {r.numel})};
    for (size_t j = 0; j < r.index.size(); ++j) staged_[r.index[j]] = next + r.offset[j];
    snapshots_.push_back(snap);
    next += r.numel;
  }
  // The fold is memory-bound (read 8 bytes, write 4 per element): one thread reaches a fraction of
  // the host's bandwidth, so the elements are split into equal chunks for a few threads. Every
  // element's arithmetic is the same whatever the split, so the average does not depend on it.
  constexpr int64_t kChunk = int64_t(1) << 16;
  for (size_t i = 0; i < ema_.size(); ++i)
    for (int64_t j = 0; j < ema_[i].numel(); j += kChunk)
      pieces_.push_back({ema_[i].ptr<float>() + j, staged_[i] + j, std::min(kChunk, ema_[i].numel() - j)});
  thread_ = std::thread([this] { worker(); });
}

ParameterEma::~ParameterEma() {
  if (on_device_) return;  // the averages' memory is stream-ordered like the folds
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ParameterEma::update_async() {
  if (on_device_) {
    std::vector<TensorView> averages, values;
    for (size_t i = 0; i < params_.size(); ++i) {
      averages.push_back(ema_[i].view());
      values.push_back(params_[i].value);
    }
    backend_.ema_fold(averages, values, decay_);
    ++updates_;
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !pending_; });
  for (const Snapshot& s : snapshots_) backend_.copy_to_host_async(s.staging, s.source);
  pending_ = true;
  cv_.notify_all();
}

void ParameterEma::wait() {
  if (on_device_) return;  // every later op on the device, read-backs included, follows the folds
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !pending_; });
}

void ParameterEma::worker() {
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return pending_ || stop_; });
    if (!pending_ && stop_) return;
    lock.unlock();
    // NOTES: the staging is only written by update_async while pending_ is false, so reading it here
    // without the lock is safe once the copies have landed.
    backend_.wait_copies();
    fold();
    lock.lock();
    ++updates_;
    pending_ = false;
    cv_.notify_all();
  }
}

void ParameterEma::fold() {
  const float d = decay_, w = 1 - decay_;
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 4)
  for (int64_t k = 0; k < int64_t(pieces_.size()); ++k) {
    const Piece p = pieces_[size_t(k)];
    for (int64_t j = 0; j < p.n; ++j) p.e[j] = d * p.e[j] + w * p.s[j];
  }
}

}  // namespace fp8moe
