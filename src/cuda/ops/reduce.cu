// Reductions of the CUDA backend: the sum of squares behind gradient clipping.
// NOTES: deterministic by construction (no atomics): each slice of a tensor is reduced in FP64 in
// a fixed order and a single block adds the slices' partials in index order, so the clip scale,
// and with it a resumed run, is reproducible bit for bit.
#include <algorithm>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda {

using namespace ops;

namespace {

// The order of the sum, fixed whatever the device: the tensors one after another, each cut into
// kBlocks grid-stride slices of kThreads lanes (lane t of slice b: elements b * kThreads + t +
// k * kBlocks * kThreads, k ascending, in FP64 as fma(v, v, acc)), the lanes of a slice added as a
// halving tree (lane t += lane t + s, s = 128 .. 1), and the kBlocks partials of every tensor,
// in index order, added kThreads-strided and by the same tree.
constexpr int kThreads = 256, kBlocks = 264;
constexpr int kLanesPerThread = kThreads / 32;  // the slice's lanes a warp thread holds
constexpr int kWarpsPerBlock = 8;

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
  int64_t first;  // its first slice among the non-empty slices of all tensors
};
static_assert(sizeof(Span) == 24, "no padding: DeviceTable compares entries as bytes");

// The tensor's slices that hold an element: the others' partials are +0.
__host__ __device__ int64_t used_slices(int64_t n) { return min(int64_t(kBlocks), (n + kThreads - 1) / kThreads); }

// A warp per non-empty slice (the kBlocks x tensors grid of mostly empty blocks was the op's
// cost: a step's hundreds of small tensors): its 32 threads hold the slice's 256 lanes, 8 each,
// with every load of a round in flight, and add them by the block tree's pairs (the first three
// levels in registers, the last five by shuffles): the same bits as a block per slice.
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    sum_squares_slices(const Span* __restrict__ xs, int spans, int64_t slices, double* __restrict__ partial) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t w = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); w < slices; w += warps) {
    int lo = 0, hi = spans - 1;  // the last span whose first slice is at or before w
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (xs[mid].first <= w) lo = mid;
      else hi = mid - 1;
    }
    const float* __restrict__ p = xs[lo].p;
    const int64_t n = xs[lo].n, b = w - xs[lo].first, stride = int64_t(kBlocks) * kThreads;
    double acc[kLanesPerThread];
#pragma unroll
    for (int j = 0; j < kLanesPerThread; ++j) acc[j] = 0.0;
    for (int64_t base = b * kThreads + lane; base < n; base += stride) {
      float v[kLanesPerThread];
#pragma unroll
      for (int j = 0; j < kLanesPerThread; ++j) {
        const int64_t i = base + 32 * j;
        v[j] = i < n ? p[i] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kLanesPerThread; ++j)
        if (base + 32 * j < n) acc[j] = fma(double(v[j]), double(v[j]), acc[j]);
    }
#pragma unroll
    for (int s = kLanesPerThread / 2; s > 0; s >>= 1)  // lanes t += t + 32 s: 128, 64, 32
#pragma unroll
      for (int j = 0; j < s; ++j) acc[j] += acc[j + s];
    double t = acc[0];
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) t += __shfl_down_sync(0xffffffffu, t, s);
    if (lane == 0) partial[int64_t(lo) * kBlocks + b] = t;
  }
}

// partial [n] -> out [1], thread-strided then a tree: a fixed order for a given n; eight loads in
// flight per thread ahead of its in-order adds.
__global__ void sum_partials(const double* __restrict__ partial, int64_t n, double* __restrict__ out) {
  constexpr int kAhead = 8;
  double acc = 0;
  int64_t i = threadIdx.x;
  for (; i + (kAhead - 1) * kThreads < n; i += kAhead * kThreads) {
    double v[kAhead];
#pragma unroll
    for (int j = 0; j < kAhead; ++j) v[j] = partial[i + j * kThreads];
#pragma unroll
    for (int j = 0; j < kAhead; ++j) acc += v[j];
  }
  for (; i < n; i += kThreads) acc += partial[i];
  const double s = block_sum(acc);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace

double cuda_sum_squares(const std::vector<TensorView>& xs, DeviceTable* table, cudaStream_t stream) {
  std::vector<Span> spans;
  int64_t slices = 0;
  for (const TensorView& x : xs) {
    check_f32(x, "sum_squares", "x", -1);
    if (x.numel() == 0) continue;
    spans.push_back({x.ptr<const float>(), x.numel(), slices});
    slices += used_slices(x.numel());
  }
  if (spans.empty()) return 0;
  FP8MOE_CHECK(spans.size() <= size_t(INT32_MAX), "sum_squares: " << spans.size() << " tensors");
  const int64_t npart = int64_t(spans.size()) * kBlocks;
  DeviceBuffer buf(sizeof(double) * size_t(npart + 1), stream), once(table ? 0 : sizeof(Span) * spans.size(), stream);
  const Span* dev = table ? table->get(spans) : once.as<Span>();
  if (!table)
    FP8MOE_CUDA_CHECK(cudaMemcpyAsync(once.as<Span>(), spans.data(), sizeof(Span) * spans.size(), cudaMemcpyHostToDevice,
                                      stream));
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(buf.as<double>(), 0, sizeof(double) * size_t(npart), stream));
  const int64_t blocks =
      std::min<int64_t>(ceil_div(slices, kWarpsPerBlock), int64_t(device_props().multiProcessorCount) * 8);
  sum_squares_slices<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(dev, int(spans.size()), slices,
                                                                            buf.as<double>());
  FP8MOE_CUDA_CHECK_LAUNCH("sum_squares_slices");
  sum_partials<<<1, kThreads, 0, stream>>>(buf.as<double>(), npart, buf.as<double>() + npart);
  FP8MOE_CUDA_CHECK_LAUNCH("sum_partials");
  double out = 0;
  // A named host read-back: the host waits for this stream only.
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(&out, buf.as<double>() + npart, sizeof(double), cudaMemcpyDeviceToHost, stream));
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace fp8moe::cuda
