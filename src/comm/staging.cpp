// The pinned staging buffers of the MPI engine (see staging.hpp). The CUDA parts are compiled in
// only when the CUDA backend is built (FP8MOE_COMM_CUDA).
#include "staging.hpp"

#include <bit>
#include <cstring>

#include "fp8moe/error.hpp"

#if FP8MOE_COMM_CUDA
#include <cuda_runtime.h>
#endif

namespace fp8moe::comm_detail {

#if FP8MOE_COMM_CUDA
#define COMM_CUDA_CHECK(call, what)                                                                 \
  do {                                                                                             \
    cudaError_t comm_err_ = (call);                                                                \
    FP8MOE_CHECK(comm_err_ == cudaSuccess, what << ": " #call " failed: " << cudaGetErrorString(comm_err_)); \
  } while (0)
#endif

HostBytes::HostBytes(HostBytes&& o) noexcept { *this = std::move(o); }

HostBytes& HostBytes::operator=(HostBytes&& o) noexcept {
  if (this != &o) {
    if (pool_) pool_->release(slot_, nullptr);
    data_ = o.data_;
    size_ = o.size_;
    pool_ = o.pool_;
    slot_ = o.slot_;
    o.pool_ = nullptr;
    o.slot_ = -1;
  }
  return *this;
}

HostBytes::~HostBytes() {
  if (pool_) pool_->release(slot_, nullptr);
}

void HostBytes::write_back(const TensorView& t, const Stream& s) {
  if (!pool_) return;
#if FP8MOE_COMM_CUDA
  auto stream = static_cast<cudaStream_t>(s.native());
  COMM_CUDA_CHECK(cudaMemcpyAsync(t.data, data_, size_, cudaMemcpyHostToDevice, stream), "comm write-back");
  pool_->release(slot_, &s);
#else
  (void)t;
  (void)s;
#endif
  pool_ = nullptr;
  slot_ = -1;
}

PinnedPool::~PinnedPool() {
#if FP8MOE_COMM_CUDA
  for (auto& s : slots_) {
    if (s.done) {
      cudaEventSynchronize(static_cast<cudaEvent_t>(s.done));
      cudaEventDestroy(static_cast<cudaEvent_t>(s.done));
    }
    if (s.host) cudaFreeHost(s.host);
  }
#endif
}

HostBytes PinnedPool::read(const TensorView& t, const Stream& s, const std::string& what) {
  HostBytes h;
  if (t.device == Device::cpu) {
    s.synchronize();  // host bytes written by work queued on s
    h.data_ = static_cast<uint8_t*>(t.data);
    h.size_ = t.nbytes();
    return h;
  }
  h = output(t, what);
#if FP8MOE_COMM_CUDA
  auto stream = static_cast<cudaStream_t>(s.native());
  if (h.size_) COMM_CUDA_CHECK(cudaMemcpyAsync(h.data_, t.data, h.size_, cudaMemcpyDeviceToHost, stream), what);
  COMM_CUDA_CHECK(cudaStreamSynchronize(stream), what);
#endif
  return h;
}

HostBytes PinnedPool::output(const TensorView& t, const std::string& what) {
  HostBytes h;
  h.size_ = t.nbytes();
  if (t.device == Device::cpu) {
    h.data_ = static_cast<uint8_t*>(t.data);
    return h;
  }
#if FP8MOE_COMM_CUDA
  h.slot_ = acquire(h.size_, what);
  h.pool_ = this;
  h.data_ = static_cast<uint8_t*>(slots_[h.slot_].host);
  return h;
#else
  FP8MOE_CHECK(false, what << ": " << t.str() << " is a device tensor but fp8moe was built without CUDA");
#endif
}

int PinnedPool::acquire(size_t bytes, const std::string& what) {
#if FP8MOE_COMM_CUDA
  // Best fit among the free buffers; a free one too small is grown (freed, allocated larger) so
  // that the pool keeps few buffers that fit the sizes in use.
  int best = -1, small = -1;
  for (int i = 0; i < int(slots_.size()); ++i) {
    const Slot& s = slots_[i];
    if (s.in_use) continue;
    if (s.bytes >= bytes && (best < 0 || s.bytes < slots_[best].bytes)) best = i;
    if (s.bytes < bytes) small = i;
  }
  if (best < 0) {
    if (small < 0) {
      slots_.push_back({});
      small = int(slots_.size()) - 1;
      cudaEvent_t ev;
      COMM_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), what);
      slots_[small].done = ev;
    }
    Slot& s = slots_[small];
    COMM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(s.done)), what);
    if (s.host) COMM_CUDA_CHECK(cudaFreeHost(s.host), what);
    s.host = nullptr;
    s.bytes = 0;
    const size_t want = std::bit_ceil(std::max<size_t>(bytes, 64 << 10));
    COMM_CUDA_CHECK(cudaMallocHost(&s.host, want), what << " (pinned staging buffer of " << want << " bytes)");
    s.bytes = want;
    best = small;
  }
  Slot& s = slots_[best];
  COMM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(s.done)), what);  // its last copy back has run
  s.in_use = true;
  return best;
#else
  (void)bytes;
  FP8MOE_CHECK(false, what << ": pinned staging needs the CUDA build");
#endif
}

void PinnedPool::release(int slot, const Stream* after) {
  if (slot < 0) return;
#if FP8MOE_COMM_CUDA
  Slot& s = slots_[slot];
  if (after) {
    // An error here leaves the buffer busy for good rather than reused while a copy reads it.
    if (cudaEventRecord(static_cast<cudaEvent_t>(s.done), static_cast<cudaStream_t>(after->native())) != cudaSuccess) return;
  }
  s.in_use = false;
#else
  (void)after;
#endif
}

}  // namespace fp8moe::comm_detail
