// The notify step of the expert-parallel exchange: each rank counts, from its routing alone, the
// rows and (token, expert) slots each channel sends to each rank and the slots of each expert,
// writes them into every peer's buffer and waits for every peer's. One block per rank: the counts
// are a few thousand integers, and shared-memory atomics on integers give the same totals in any
// order.
#include "cuda/ep/ep_device.cuh"
#include "cuda/ep/ep_launch.hpp"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda::ep {

namespace {

constexpr int kNotifyThreads = 512;

__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(StepArgs a, const int32_t* __restrict__ idx) {
  extern __shared__ int32_t counts[];  // [L]
  const int P = a.ranks, C = a.channels, L = a.counts.length();
  const int64_t T = a.tokens, k = a.topk, epr = a.experts_per_rank;
  post_ready(a, threadIdx.x);
  for (int i = threadIdx.x; i < L; i += blockDim.x) counts[i] = 0;
  __syncthreads();
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    // Channel of t: the c with begin(c) <= t < begin(c + 1).
    int c = int(t * C / (T > 0 ? T : 1));
    while (c + 1 < C && channel_begin(T, c + 1, C) <= t) ++c;
    while (c > 0 && channel_begin(T, c, C) > t) --c;
    uint32_t ranks_of_t = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[t * k + j];
      if (e < 0 || e >= P * epr) {  // refused by the host (counts()); the slot goes nowhere
        record_failure(error_word(a), Step::notify, Failure::expert_id, int(t), int(j));
        continue;
      }
      const int d = int(e / epr);
      ranks_of_t |= 1u << d;
      atomicAdd(&counts[a.counts.slots(c, d)], 1);
      atomicAdd(&counts[a.counts.expert(e)], 1);
    }
    for (int d = 0; d < P; ++d)
      if (ranks_of_t >> d & 1) atomicAdd(&counts[a.counts.tokens(c, d)], 1);
  }
  __syncthreads();
  // Into every peer's buffer once it has started this step (its earlier counts are read).
  for (int q = 0; q < P; ++q) {
    if (threadIdx.x == 0) wait_ready(a, q, Step::notify);
    __syncthreads();
    int32_t* dst = region<int32_t>(a.peer[q], a.layout.notify) + a.me * L;
    for (int i = threadIdx.x; i < L; i += blockDim.x) dst[i] = counts[i];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < P)
    store_release(region<uint64_t>(a.peer[threadIdx.x], a.layout.notify_flag) + a.me, a.step);
  if (threadIdx.x < P)
    wait_flag(a, region<uint64_t>(a.peer[a.me], a.layout.notify_flag) + threadIdx.x, Step::notify, Failure::counts,
              threadIdx.x, 0);
  __syncthreads();
  // This rank's copy: the peers may overwrite `notify` as soon as they start their next step.
  const int32_t* got = region<int32_t>(a.peer[a.me], a.layout.notify);
  int32_t* mine = region<int32_t>(a.peer[a.me], a.layout.counts);
  for (int i = threadIdx.x; i < P * L; i += blockDim.x) mine[i] = got[i];
}

}  // namespace

void launch_notify(const StepArgs& a, const int32_t* idx, cudaStream_t stream) {
  const size_t smem = size_t(a.counts.length()) * sizeof(int32_t);
  notify_kernel<<<1, kNotifyThreads, smem, stream>>>(a, idx);
  FP8MOE_CUDA_CHECK_LAUNCH("ep notify_kernel");
}

}  // namespace fp8moe::cuda::ep
