// Streams and events: the order of work on a device, as in ggml's backends, llm.c and DeepEP's
// EventHandle. A Stream is a queue of a backend's ops; an Event marks a point in one stream that
// other streams (device-side, no host wait) or the host can wait for. This is what lets a
// communication stream run beside the compute stream (DualPipe's overlap, two micro-batches in
// serving) with only the dependencies that are real.
//
// The CPU backend runs every op at once in the calling thread: its streams are always done, its
// events always reached, and waits return at once. On CUDA a Stream wraps a cudaStream_t and an
// Event a cudaEvent_t (native() hands them to code that launches kernels or calls NCCL).
// Handles are cheap to copy (shared ownership); a default-constructed Stream is the host's.
// A Graph is a stream's work recorded once (Backend::begin_capture/end_capture) and launched
// again as one unit: the same kernels with the same arguments and the same memory, without the
// host's cost of issuing each op (CUDA graphs).
#pragma once
#include <memory>

#include "fp8moe/dtype.hpp"

namespace fp8moe {

class Stream {
 public:
  // What a device implements behind the handle.
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual Device device() const = 0;
    virtual void* native() const = 0;  // cudaStream_t on CUDA, nullptr on the CPU
    virtual void synchronize() const = 0;
    virtual bool query() const = 0;
  };

  Stream() = default;  // the host: work runs at once
  explicit Stream(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

  Device device() const { return impl_ ? impl_->device() : Device::cpu; }
  void* native() const { return impl_ ? impl_->native() : nullptr; }
  // Host waits for the work queued on this stream so far.
  void synchronize() const {
    if (impl_) impl_->synchronize();
  }
  // True when the work queued so far has finished.
  bool query() const { return impl_ ? impl_->query() : true; }
  bool operator==(const Stream& o) const { return native() == o.native() && device() == o.device(); }

 private:
  std::shared_ptr<const Impl> impl_;
};

class Event {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual void record(const Stream& s) = 0;
    virtual void wait(const Stream& s) const = 0;
    virtual void synchronize() const = 0;
    virtual bool query() const = 0;
  };

  Event() = default;  // a host event: always reached
  explicit Event(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  // Marks the end of the work queued on `s` so far (the event is re-armed by each record).
  void record(const Stream& s) {
    if (impl_) impl_->record(s);
  }
  // Work queued on `s` after this call starts only once the recorded point is reached; the host
  // does not wait.
  void wait(const Stream& s) const {
    if (impl_) impl_->wait(s);
  }
  // Host waits for the recorded point.
  void synchronize() const {
    if (impl_) impl_->synchronize();
  }
  // True when the recorded point has been reached (or nothing was recorded).
  bool query() const { return impl_ ? impl_->query() : true; }

 private:
  std::shared_ptr<Impl> impl_;
};

class Graph {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual void replay(const Stream& s) = 0;
  };

  Graph() = default;  // none
  explicit Graph(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  // Queues the recorded work on `s` (the host does not wait).
  void replay(const Stream& s) {
    if (impl_) impl_->replay(s);
  }

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace fp8moe
