// CPU-memory parameter EMA updated on a background thread (include/fp8moe/ema.hpp).
#include "fp8moe/ema.hpp"

#include <cstring>

namespace fp8moe {

ParameterEma::ParameterEma(const std::vector<ParamRef>& params, float decay, CopyFn copy_to_host)
    : params_(params), decay_(decay), copy_(std::move(copy_to_host)) {
  FP8MOE_CHECK(decay > 0 && decay < 1, "ema: decay must be in (0, 1), got " << decay);
  if (!copy_) copy_ = [](const TensorView& dst, const TensorView& src) { std::memcpy(dst.data, src.data, src.nbytes()); };
  for (auto& p : params_) {
    ema_.push_back(Tensor::host_like(p.value));
    staging_.push_back(Tensor::host_like(p.value));
    copy_(ema_.back().view(), p.value);  // the average starts at the initial weights
  }
  thread_ = std::thread([this] { worker(); });
}

ParameterEma::~ParameterEma() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ParameterEma::update_async() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !pending_; });
  for (size_t i = 0; i < params_.size(); ++i) copy_(staging_[i].view(), params_[i].value);
  pending_ = true;
  cv_.notify_all();
}

void ParameterEma::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !pending_; });
}

void ParameterEma::worker() {
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return pending_ || stop_; });
    if (!pending_ && stop_) return;
    lock.unlock();
    // NOTES: staging_ is only written by update_async while pending_ is false, so reading it here
    // without the lock is safe.
    for (size_t i = 0; i < ema_.size(); ++i) {
      float* e = ema_[i].ptr<float>();
      const float* s = staging_[i].ptr<const float>();
      const int64_t n = ema_[i].numel();
      for (int64_t j = 0; j < n; ++j) e[j] = decay_ * e[j] + (1 - decay_) * s[j];
    }
    lock.lock();
    ++updates_;
    pending_ = false;
    cv_.notify_all();
  }
}

}  // namespace fp8moe
