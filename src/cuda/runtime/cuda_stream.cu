// Stream and Event handles of the CUDA backend (cuda_stream.hpp).
#include "cuda/runtime/cuda_stream.hpp"

#include <memory>

#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda {

namespace {

// A stream or event query's answer: not ready is no error.
bool reached(cudaError_t e) {
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  FP8MOE_CUDA_CHECK(e);
  return true;
}

class CudaStream final : public Stream::Impl {
 public:
  explicit CudaStream(cudaStream_t s) : s_(s) {}
  ~CudaStream() override {
    // NOTES: cudaStreamDestroy returns before the stream's work ends; waiting first keeps a later
    // stream that reuses the handle from inheriting the caching allocator's blocks too early.
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
  }
  Device device() const override { return Device::cuda; }
  void* native() const override { return s_; }
  void synchronize() const override { FP8MOE_CUDA_CHECK(cudaStreamSynchronize(s_)); }
  bool query() const override { return reached(cudaStreamQuery(s_)); }

 private:
  cudaStream_t s_;
};

class CudaEvent final : public Event::Impl {
 public:
  CudaEvent() { FP8MOE_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
  ~CudaEvent() override { (void)cudaEventDestroy(e_); }
  void record(const Stream& s) override { FP8MOE_CUDA_CHECK(cudaEventRecord(e_, native(s))); }
  void wait(const Stream& s) const override { FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(native(s), e_, 0)); }
  void synchronize() const override { FP8MOE_CUDA_CHECK(cudaEventSynchronize(e_)); }
  bool query() const override { return reached(cudaEventQuery(e_)); }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace

Stream make_stream() {
  cudaStream_t s = nullptr;
  FP8MOE_CUDA_CHECK(cudaStreamCreate(&s));
  return Stream(std::make_shared<CudaStream>(s));
}
Event make_event() { return Event(std::make_shared<CudaEvent>()); }

}  // namespace fp8moe::cuda
