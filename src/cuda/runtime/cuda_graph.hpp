// Graph capture of a CUDA stream (Backend::begin_capture / end_capture): the work queued on the
// stream is recorded into a CUDA graph, whose replay launches it all at once. While capturing,
// the caching allocator serves the stream from blocks kept for graphs (caching_allocator.hpp),
// and the deferred checks recorded go with the graph, to be raised after each replay.
#pragma once
#include <cuda_runtime.h>

#include "fp8moe/stream.hpp"

namespace fp8moe::cuda {

// Raises the deferred checks recorded so far (they belong to work queued before), then starts
// recording `stream` (cudaStreamCaptureModeRelaxed: the allocator may call cudaMalloc).
void begin_capture(cudaStream_t stream);
// Stops recording and instantiates the graph. Throws Error naming the cause when the capture
// failed (an op waited on the host or used the legacy stream meanwhile); either way the stream and
// the allocator are back to normal.
Graph end_capture(cudaStream_t stream);

}  // namespace fp8moe::cuda
