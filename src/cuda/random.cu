// Device-side random inputs for tests and benchmarks: N(0, stddev) from a counter hash, so large
// tensors are filled without host-side generation or transfers.
#include <cuda_bf16.h>

#include "cuda/runtime/cuda_check.hpp"
#include "kernel_api.hpp"

namespace fp8moe::cuda {

namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// N(0, stddev) via Box-Muller on a counter hash; bf16-rounded.
__global__ void fill_normal_bf16_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float stddev) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ splitmix64(uint64_t(i)));
    const float u1 = (float((h >> 40) & 0xFFFFFF) + 1.0f) * (1.0f / 16777216.0f);
    const float u2 = float(h & 0xFFFFFF) * (1.0f / 16777216.0f);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    p[i] = __float2bfloat16_rn(z * stddev);
  }
}

}  // namespace

void fill_normal_bf16(void* p, int64_t n, uint64_t seed, float stddev, cudaStream_t stream) {
  fill_normal_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed, stddev);
  FP8MOE_CUDA_CHECK_LAUNCH("fill_normal_bf16_kernel");
}

}  // namespace fp8moe::cuda
