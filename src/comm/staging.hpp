// Host bytes for MPI: a host tensor is used in place; a device tensor is copied on its stream to
// a pinned host buffer (cudaMallocHost), which MPI sends from or receives into, and copied back
// on the stream. Pinned buffers are cached and reused: a buffer returns to the pool with an event
// recorded after its last copy, and is handed out again only once that event has been reached.
// Built without CUDA, a device tensor is an error. Tested by tests/comm (the Device* tests).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fp8moe/stream.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::comm_detail {

class PinnedPool;

// The host side of one tensor for one operation.
class HostBytes {
 public:
  HostBytes() = default;
  HostBytes(HostBytes&& o) noexcept;
  HostBytes& operator=(HostBytes&& o) noexcept;
  ~HostBytes();
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Device tensor: queue the copy of the host bytes into `t` on `s`; the buffer goes back to the
  // pool once `s` has passed the copy. Host tensor: nothing (the bytes are already there).
  void write_back(const TensorView& t, const Stream& s);

 private:
  friend class PinnedPool;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  PinnedPool* pool_ = nullptr;  // set for a pinned buffer
  int slot_ = -1;
};

class PinnedPool {
 public:
  PinnedPool() = default;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool();

  // The bytes of `t` readable on the host: waits for the work queued on `s`. `what` names the
  // engine and operation in errors ("mpi all_gather").
  HostBytes read(const TensorView& t, const Stream& s, const std::string& what);
  // Host bytes to be filled for `t` (t itself on the host, a pinned buffer for a device tensor).
  HostBytes output(const TensorView& t, const std::string& what);

 private:
  friend class HostBytes;
  struct Slot {
    void* host = nullptr;
    size_t bytes = 0;
    void* done = nullptr;  // cudaEvent_t recorded after the last copy out of the buffer
    bool in_use = false;
  };
  int acquire(size_t bytes, const std::string& what);
  // Free again once `after` has passed the work queued on it so far; at once when null.
  void release(int slot, const Stream* after);
  std::vector<Slot> slots_;
};

}  // namespace fp8moe::comm_detail
