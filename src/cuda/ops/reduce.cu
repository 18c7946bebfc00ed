// Reductions of the CUDA backend: the sum of squares behind gradient clipping.
// NOTES: deterministic by construction (no atomics): each block reduces a fixed grid-stride slice
// of one tensor in FP64 and a single block adds the per-block partials in index order, so the clip
// scale, and with it a resumed run, is reproducible bit for bit. The slices depend on each
// tensor's size only: one block per kPerThread * kThreads elements, at most kMaxBlocks per tensor.
// A fixed 264 slices of every tensor (a step's gradients are some 900 tensors, most of a few
// hundred thousand elements) left each thread two or three loads before its block's tree, and the
// blocks' fixed costs, not the bytes, set the time.
#include <algorithm>
#include <cstring>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kThreads = 256, kMaxBlocks = 264, kPerThread = 32, kAhead = 8;

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
  int64_t blocks;  // its slices
  int64_t first;   // the launch's block of its first slice
};

int64_t blocks_of(int64_t n) {
  return std::clamp<int64_t>((n + int64_t(kThreads) * kPerThread - 1) / (int64_t(kThreads) * kPerThread), 1,
                             kMaxBlocks);
}

// Block q reduces slice q - first of tensor span_of[q] into partial[q]: the thread's elements in
// stride order, kAhead loads issued before their adds.
__global__ void sum_squares_partial(const Span* __restrict__ xs, const int32_t* __restrict__ span_of,
                                    double* __restrict__ partial) {
  const Span x = xs[span_of[blockIdx.x]];
  const int64_t stride = x.blocks * kThreads;
  double acc = 0;
  int64_t i = (int64_t(blockIdx.x) - x.first) * kThreads + threadIdx.x;
  for (; i + (kAhead - 1) * stride < x.n; i += kAhead * stride) {
    float v[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) v[u] = x.p[i + u * stride];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const double d = v[u];
      acc += d * d;
    }
  }
  for (; i < x.n; i += stride) {
    const double v = x.p[i];
    acc += v * v;
  }
  const double s = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// partial [n] -> out [1], thread-strided then a tree: a fixed order for a given n; each thread's
// next kAhead partials loaded before their adds.
__global__ void sum_partials(const double* __restrict__ partial, int64_t n, double* __restrict__ out) {
  double acc = 0;
  int64_t i = threadIdx.x;
  for (; i + (kAhead - 1) * kThreads < n; i += kAhead * kThreads) {
    double v[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) v[u] = partial[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) acc += v[u];
  }
  for (; i < n; i += kThreads) acc += partial[i];
  const double s = block_sum(acc);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace

double cuda_sum_squares(const std::vector<TensorView>& xs, cudaStream_t stream) {
  std::vector<Span> spans;
  int64_t blocks = 0;
  for (const TensorView& x : xs) {
    check_f32(x, "sum_squares", "x", -1);
    if (x.numel() == 0) continue;
    spans.push_back({x.ptr<const float>(), x.numel(), blocks_of(x.numel()), blocks});
    blocks += spans.back().blocks;
  }
  if (spans.empty()) return 0;
  FP8MOE_CHECK(blocks < (int64_t(1) << 31), "sum_squares: " << blocks << " blocks, above one launch's");
  // One upload: the spans, then each block's span.
  const size_t span_bytes = sizeof(Span) * spans.size();
  std::vector<unsigned char> table(span_bytes + sizeof(int32_t) * size_t(blocks));
  std::memcpy(table.data(), spans.data(), span_bytes);
  int32_t* span_of = reinterpret_cast<int32_t*>(table.data() + span_bytes);
  for (size_t k = 0; k < spans.size(); ++k) std::fill_n(span_of + spans[k].first, spans[k].blocks, int32_t(k));
  DeviceBuffer dtable(table.size(), stream), buf(sizeof(double) * size_t(blocks + 1), stream);
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(dtable.as<unsigned char>(), table.data(), table.size(), cudaMemcpyHostToDevice,
                                    stream));
  sum_squares_partial<<<unsigned(blocks), kThreads, 0, stream>>>(
      dtable.as<Span>(), reinterpret_cast<const int32_t*>(dtable.as<unsigned char>() + span_bytes), buf.as<double>());
  FP8MOE_CUDA_CHECK_LAUNCH("sum_squares_partial");
  sum_partials<<<1, kThreads, 0, stream>>>(buf.as<double>(), blocks, buf.as<double>() + blocks);
  FP8MOE_CUDA_CHECK_LAUNCH("sum_partials");
  double out = 0;
  // A named host read-back: the host waits for this stream only.
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(&out, buf.as<double>() + blocks, sizeof(double), cudaMemcpyDeviceToHost, stream));
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace fp8moe::cuda
