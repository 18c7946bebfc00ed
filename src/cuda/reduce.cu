// Reductions of the CUDA backend: the sum of squares behind gradient clipping.
// NOTES: deterministic by construction (no atomics): each block reduces a fixed grid-stride slice
// in FP64 and a single block adds the per-block partials in index order, so the clip scale, and
// with it a resumed run, is reproducible bit for bit.
#include "model_ops.hpp"
#include "model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kThreads = 256, kBlocks = 264;  // 2 blocks per H200 SM; fixed, so the order is too

__device__ double block_sum(double v) {
  __shared__ double part[kThreads];
  part[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  return part[0];
}

// x [n] f32 -> partial [kBlocks] f64
__global__ void sum_squares_partial(const float* __restrict__ x, int64_t n, double* __restrict__ partial) {
  double acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(kBlocks) * kThreads) {
    const double v = x[i];
    acc += v * v;
  }
  const double s = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// partial [kBlocks] -> out [1]
__global__ void sum_partials(const double* __restrict__ partial, double* __restrict__ out) {
  double acc = 0;
  for (int i = threadIdx.x; i < kBlocks; i += kThreads) acc += partial[i];
  const double s = block_sum(acc);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace

double cuda_sum_squares(const TensorView& x) {
  check_f32(x, "sum_squares", "x", -1);
  const int64_t n = x.numel();
  if (n == 0) return 0;
  double* buf = nullptr;  // [kBlocks partials, 1 result]
  FP8MOE_CUDA_CHECK(cudaMalloc(&buf, sizeof(double) * (kBlocks + 1)));
  sum_squares_partial<<<kBlocks, kThreads>>>(x.ptr<const float>(), n, buf);
  sum_partials<<<1, kThreads>>>(buf, buf + kBlocks);
  double out = 0;
  cudaError_t launch = cudaGetLastError();
  cudaError_t copy = cudaMemcpy(&out, buf + kBlocks, sizeof(double), cudaMemcpyDeviceToHost);
  cudaFree(buf);
  FP8MOE_CUDA_CHECK(launch);
  FP8MOE_CUDA_CHECK(copy);
  return out;
}

}  // namespace fp8moe::cuda
