// Reductions of the CUDA backend: the sum of squares behind gradient clipping.
// NOTES: deterministic by construction (no atomics): each block reduces a fixed grid-stride slice
// in FP64 and a single block adds the per-block partials in index order, so the clip scale, and
// with it a resumed run, is reproducible bit for bit.
#include <algorithm>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

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

struct Span {
  const float* p;
  int64_t n;
};

// Block (b, i) reduces its grid-stride slice of tensor i: partial[i * kBlocks + b].
// NOTES: a block past a small tensor's end writes its +0 at once instead of summing zeros through
// the tree (the same bits): most of a step's tensors (norms, biases) leave most blocks empty.
__global__ void sum_squares_partial(const Span* __restrict__ xs, double* __restrict__ partial) {
  const Span x = xs[blockIdx.y];
  if (int64_t(blockIdx.x) * kThreads >= x.n) {
    if (threadIdx.x == 0) partial[int64_t(blockIdx.y) * kBlocks + blockIdx.x] = 0.0;
    return;
  }
  double acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < x.n; i += int64_t(kBlocks) * kThreads) {
    const double v = x.p[i];
    acc += v * v;
  }
  const double s = block_sum(acc);
  if (threadIdx.x == 0) partial[int64_t(blockIdx.y) * kBlocks + blockIdx.x] = s;
}

// partial [n] -> out [1], thread-strided then a tree: a fixed order for a given n.
__global__ void sum_partials(const double* __restrict__ partial, int64_t n, double* __restrict__ out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) acc += partial[i];
  const double s = block_sum(acc);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace

double cuda_sum_squares(const std::vector<TensorView>& xs, cudaStream_t stream) {
  std::vector<Span> spans;
  for (const TensorView& x : xs) {
    check_f32(x, "sum_squares", "x", -1);
    if (x.numel() > 0) spans.push_back({x.ptr<const float>(), x.numel()});
  }
  if (spans.empty()) return 0;
  constexpr int64_t kMaxY = 65535;  // grid.y limit: tensors per pass
  const int64_t n = int64_t(spans.size()), npart = n * kBlocks;
  DeviceBuffer table(sizeof(Span) * size_t(n), stream), buf(sizeof(double) * size_t(npart + 1), stream);
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(table.as<Span>(), spans.data(), sizeof(Span) * size_t(n), cudaMemcpyHostToDevice,
                                    stream));
  for (int64_t i0 = 0; i0 < n; i0 += kMaxY) {
    const unsigned ny = unsigned(std::min(kMaxY, n - i0));
    sum_squares_partial<<<dim3(kBlocks, ny), kThreads, 0, stream>>>(table.as<Span>() + i0, buf.as<double>() + i0 * kBlocks);
    FP8MOE_CUDA_CHECK_LAUNCH("sum_squares_partial");
  }
  sum_partials<<<1, kThreads, 0, stream>>>(buf.as<double>(), npart, buf.as<double>() + npart);
  FP8MOE_CUDA_CHECK_LAUNCH("sum_partials");
  double out = 0;
  // A named host read-back: the host waits for this stream only.
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(&out, buf.as<double>() + npart, sizeof(double), cudaMemcpyDeviceToHost, stream));
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace fp8moe::cuda
