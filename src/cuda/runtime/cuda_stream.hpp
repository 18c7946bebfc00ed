// The CUDA side of stream.hpp: Stream and Event handles over cudaStream_t and cudaEvent_t.
#pragma once
#include <cuda_runtime.h>

#include "fp8moe/stream.hpp"

namespace fp8moe::cuda {

// A new stream on the current device. NOTES: a blocking stream (not cudaStreamNonBlocking): work
// that a library queues on the legacy stream still orders against it, while two of our streams
// overlap freely.
Stream make_stream();
Event make_event();
// The cudaStream_t of a handle (nullptr for the host's).
inline cudaStream_t native(const Stream& s) { return static_cast<cudaStream_t>(s.native()); }

}  // namespace fp8moe::cuda
