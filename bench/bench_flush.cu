// The benchmarks' clean L2 flush (bench_util.hpp, Timer with Flush::clean): a read-only sweep of a
// buffer larger than L2, which leaves L2 holding clean lines only.
#include <cuda_runtime.h>

#include "bench/bench_util.hpp"

namespace fp8moe::cuda::bench {

namespace {

__global__ void read_sweep_kernel(const uint4* __restrict__ p, size_t n, unsigned* __restrict__ sink) {
  unsigned acc = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads; practically never taken
}

}  // namespace

void l2_read_sweep(const DeviceBuffer& b, cudaStream_t stream) {
  const int blocks = device_props().multiProcessorCount * 8;
  read_sweep_kernel<<<blocks, 256, 0, stream>>>(static_cast<const uint4*>(b.p), b.bytes / 16 - 1,
                                                reinterpret_cast<unsigned*>(static_cast<char*>(b.p) + b.bytes - 16));
  FP8MOE_CUDA_CHECK_LAUNCH("read_sweep_kernel");
}

}  // namespace fp8moe::cuda::bench
