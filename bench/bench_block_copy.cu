// A plain device copy on a fixed number of blocks (bench_util.hpp): the bound of a copy kernel given
// the same SM budget as the expert-parallel kernels, so that `bench ep` can tell their own overhead
// from what their SMs allow. Each thread keeps kUnroll 16-byte loads in flight before its stores.
#include <cuda_runtime.h>

#include "bench/bench_util.hpp"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda::bench {

namespace {

constexpr int kUnroll = 8;

__global__ void block_copy_kernel(const int4* __restrict__ src, int4* __restrict__ dst, int64_t words) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * stride < words) v[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * stride < words) dst[i + u * stride] = v[u];
  }
}

}  // namespace

void block_copy(const void* src, void* dst, size_t bytes, int blocks, int threads, cudaStream_t stream) {
  block_copy_kernel<<<unsigned(blocks), unsigned(threads), 0, stream>>>(static_cast<const int4*>(src),
                                                                        static_cast<int4*>(dst), int64_t(bytes / 16));
  FP8MOE_CUDA_CHECK_LAUNCH("block_copy_kernel");
}

}  // namespace fp8moe::cuda::bench
