// The low-latency mode of the expert-parallel exchange (decode; DeepEP's low-latency mode is the
// public form): buffers for at most N tokens per rank, one fixed region of N rows per (local
// expert, source) on every rank, so that no step needs the counts before it starts, nothing is
// read by the host, and dispatch and combine can be captured in a CUDA graph. The step number
// each kernel waits for is kept in the rank's own buffer (ll_step): every block reads it at its
// start, the last block to end advances it, so a replayed graph runs the next step, not the same.
//   dispatch  grid-wide warp w serves the global experts w, w + W, ...: it walks the source's
//             (token, expert) slots in order (ballot), so that the position of each row in its
//             (expert, source) region is fixed by the routing alone; it copies the FP8 row, its
//             1x128 scales and its slot t * k + j into the destination's staging region, then a
//             system-scope fence and the release of the (expert, source) flag, which carries the
//             row count (step << 32 | rows). Then block b packs the local experts b, b + grid, ...
//             once every source's flag for it is up: expert e's rows at e * M + [0, count[e]),
//             source-major, slots ascending, scales group-major: the masked grouped GEMM's A,
//             with the counts in device memory.
//   combine   warp w serves the (local expert, source) pairs w, w + W, ...: each packed row of the
//             pair goes back to its source slot in the source's ll_back, then the fence and the
//             release of the expert's flag in the source's buffer. Then, once every expert's flag
//             is up, one warp per token sums its k rows in slot order j = 0..k-1 with the normal
//             combine's roundings (ep_combine.cu): deterministic whatever order the rows arrive in.
// Receive hook (DeepEP's return_recv_hook): each kernel runs its send part and its receive part in
// one launch, or in two (kPhaseSend, then kPhaseReceive) so that the rows travel while the rank's
// SMs run other work between the launches. Both launches of a step read the same step number; only
// the receive launch advances it.
// Every wait is the normal mode's (ep_device.cuh): timed out, recorded in the rank's error word.
#include <cuda_bf16.h>

#include "cuda/ep/ep_device.cuh"
#include "cuda/ep/ep_launch.hpp"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda::ep {

namespace {

constexpr int kWarps = 16, kThreads = 32 * kWarps;

__device__ __forceinline__ int64_t scale_ld_ll(int64_t rows) { return (rows + 3) / 4 * 4; }

__device__ __forceinline__ uint32_t* ll_error(const LlArgs& a) { return region<uint32_t>(a.peer[a.me], a.layout.error); }

// This kernel's step: one past the rank's last. Every block reads it before it ends, so before the
// last block advances it (ll_end).
__device__ __forceinline__ uint64_t ll_begin(const LlArgs& a, uint64_t* shared_step) {
  if (threadIdx.x == 0)
    *shared_step = *reinterpret_cast<volatile uint64_t*>(region<uint64_t>(a.peer[a.me], a.layout.ll_step)) + 1;
  __syncthreads();
  return *shared_step;
}

// The last block of the grid to get here stores the step as the rank's last; the next kernel on
// the stream sees it (kernel boundary).
__device__ __forceinline__ void ll_end(const LlArgs& a, uint64_t step) {
  __syncthreads();
  if (threadIdx.x == 0) {
    char* b = a.peer[a.me];
    uint32_t* done = region<uint32_t>(b, a.layout.ll_step + 8);
    __threadfence();
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      atomicExch(done, 0u);
      *reinterpret_cast<volatile uint64_t*>(region<uint64_t>(b, a.layout.ll_step)) = step;
    }
  }
}

// "This rank has started the step" into every peer's buffer: what it read there before is read.
__device__ __forceinline__ void ll_post_ready(const LlArgs& a, uint64_t step) {
  if (blockIdx.x == 0 && threadIdx.x < a.ranks)
    store_release(region<uint64_t>(a.peer[threadIdx.x], a.layout.ready) + a.me, step);
}

__device__ __forceinline__ bool ll_wait_ready(const LlArgs& a, int q, uint64_t step, Step kind) {
  return wait_flag_at(region<uint64_t>(a.peer[a.me], a.layout.ready) + q, step, a.timeout_ns, ll_error(a), kind,
                      Failure::ready, q, 0);
}

// A warp copies n 16-byte words of rows its peers wrote during this kernel: plain loads (not the
// read-only path of warp_copy16), issued after the acquire of the flag that covers them.
template <int kUnroll>
__device__ __forceinline__ void warp_copy16_peer_written(int4* dst, const int4* src, int64_t n, int lane) {
  const int4* s = src + lane;
  int4* d = dst + lane;
  for (int64_t rem = n - lane; rem > 0; rem -= 32 * kUnroll, s += 32 * kUnroll, d += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u * 32 < rem) v[u] = s[u * 32];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u * 32 < rem) d[u * 32] = v[u];
  }
}

__global__ void __launch_bounds__(kThreads, 2)
    ll_dispatch_kernel(LlArgs a, const uint8_t* __restrict__ x, const float* __restrict__ x_scales, int64_t x_ld,
                       const int32_t* __restrict__ idx, int phases) {
  __shared__ uint64_t step_s;
  __shared__ int32_t cnt[kMaxRanks], base[kMaxRanks + 1];
  const uint64_t step = ll_begin(a, &step_s);
  const int P = a.ranks, me = a.me, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = a.tokens, k = a.topk, D = a.hidden, G = D / 128, E = a.experts, epr = a.experts_per_rank;
  const int64_t N = a.max_tokens, M = P * N, slots = T * k;
  char* mine = a.peer[me];
  uint32_t* err = ll_error(a);
  if (phases & kPhaseSend) {
    ll_post_ready(a, step);
    if (blockIdx.x == 0)
      for (int64_t s = threadIdx.x; s < slots; s += blockDim.x)
        if (idx[s] < 0 || idx[s] >= E)  // sent nowhere; the host throws
          record_failure(err, Step::ll_dispatch, Failure::expert_id, int(s / k), int(s % k));

    // send
    const int64_t W = int64_t(gridDim.x) * kWarps;
    for (int64_t xe = int64_t(blockIdx.x) * kWarps + warp; xe < E; xe += W) {
      const int d = int(xe / epr);
      const int64_t e = xe % epr;
      // d has started this step: its packing of the last step's staging rows is over.
      if (lane == 0) ll_wait_ready(a, d, step, Step::ll_dispatch);
      __syncwarp();
      char* dst = a.peer[d];
      const int64_t row0 = (e * P + me) * N;  // this source's region for expert e on d
      uint8_t* sx = region<uint8_t>(dst, a.layout.ll_stage_x) + row0 * D;
      float* ss = region<float>(dst, a.layout.ll_stage_scales) + row0 * G;
      int32_t* sl = region<int32_t>(dst, a.layout.ll_stage_slot) + row0;
      int64_t n = 0;  // rows for xe so far (the whole warp agrees)
      for (int64_t s0 = 0; s0 < slots; s0 += 32) {
        const int64_t s = s0 + lane;
        const uint32_t hit = __ballot_sync(~0u, s < slots && idx[s] == xe);
        for (uint32_t m = hit; m != 0; m &= m - 1, ++n) {
          if (n >= N) continue;  // a token lists xe twice: reported below, the rest dropped
          const int64_t sj = s0 + __ffs(int(m)) - 1, t = sj / k;
          warp_copy16<4>(reinterpret_cast<int4*>(sx + n * D), reinterpret_cast<const int4*>(x + t * D), D / 16, lane);
          for (int64_t g = lane; g < G; g += 32) ss[n * G + g] = x_scales[g * x_ld + t];
          if (lane == 0) sl[n] = int32_t(sj);
        }
      }
      if (n > N) {
        if (lane == 0) record_failure(err, Step::ll_dispatch, Failure::overflow, int(xe), int(n));
        n = N;
      }
      __threadfence_system();
      __syncwarp();
      if (lane == 0) store_release(region<uint64_t>(dst, a.layout.ll_count_flag) + e * P + me, step << 32 | uint64_t(n));
    }
  }
  if (!(phases & kPhaseReceive)) return;

  // receive: pack the local experts of this block.
  const int64_t R = epr * M, ld = scale_ld_ll(R);
  uint8_t* px = region<uint8_t>(mine, a.layout.ll_x);
  float* ps = region<float>(mine, a.layout.ll_scales);
  int32_t* count = region<int32_t>(mine, a.layout.ll_count);
  int32_t* src_count = region<int32_t>(mine, a.layout.ll_src_count);
  int32_t* src_slot = region<int32_t>(mine, a.layout.ll_src_slot);
  const uint8_t* stage_x = region<uint8_t>(mine, a.layout.ll_stage_x);
  const float* stage_s = region<float>(mine, a.layout.ll_stage_scales);
  const int32_t* stage_slot = region<int32_t>(mine, a.layout.ll_stage_slot);
  if (blockIdx.x == 0 && ld > R)  // scale padding columns: 1, as the quantized layout has
    for (int64_t i = threadIdx.x; i < G * (ld - R); i += blockDim.x) ps[(i / (ld - R)) * ld + R + i % (ld - R)] = 1.0f;
  for (int64_t e = blockIdx.x; e < epr; e += gridDim.x) {
    if (threadIdx.x < P) {
      const uint64_t* f = region<uint64_t>(mine, a.layout.ll_count_flag) + e * P + threadIdx.x;
      int32_t c = 0;
      if (wait_flag_at(f, step << 32, a.timeout_ns, err, Step::ll_dispatch, Failure::rows, int(threadIdx.x),
                       int(me * epr + e)))
        c = int32_t(load_acquire(f) & 0xffffffffu);
      cnt[threadIdx.x] = c < N ? c : int32_t(N);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      base[0] = 0;
      for (int q = 0; q < P; ++q) {
        base[q + 1] = base[q] + cnt[q];
        src_count[e * P + q] = cnt[q];
      }
      count[e] = base[P];
    }
    __syncthreads();
    const int64_t total = base[P];
    for (int64_t r = warp; r < total; r += kWarps) {
      int q = 0;
      while (q + 1 < P && base[q + 1] <= r) ++q;
      const int64_t from = (e * P + q) * N + (r - base[q]), to = e * M + r;
      warp_copy16_peer_written<4>(reinterpret_cast<int4*>(px + to * D), reinterpret_cast<const int4*>(stage_x + from * D),
                                  D / 16, lane);
      for (int64_t g = lane; g < G; g += 32) ps[g * ld + to] = stage_s[from * G + g];
      if (lane == 0) src_slot[to] = stage_slot[from];
    }
    __syncthreads();  // cnt and base are the next expert's
  }
  ll_end(a, step);
}

__global__ void __launch_bounds__(kThreads, 2)
    ll_combine_kernel(LlArgs a, const __nv_bfloat16* __restrict__ rows, const float* __restrict__ weights,
                      float* __restrict__ out, bool accumulate, int phases) {
  __shared__ uint64_t step_s;
  const uint64_t step = ll_begin(a, &step_s);
  const int P = a.ranks, me = a.me, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = a.tokens, k = a.topk, D = a.hidden, E = a.experts, epr = a.experts_per_rank;
  const int64_t N = a.max_tokens, M = P * N;
  char* mine = a.peer[me];
  uint32_t* err = ll_error(a);
  const int64_t W = int64_t(gridDim.x) * kWarps;
  if (phases & kPhaseSend) {
    ll_post_ready(a, step);

    // send: the packed rows of this rank's last dispatch, (local expert, source) pair by pair.
    const int32_t* src_count = region<int32_t>(mine, a.layout.ll_src_count);
    const int32_t* src_slot = region<int32_t>(mine, a.layout.ll_src_slot);
    for (int64_t pair = int64_t(blockIdx.x) * kWarps + warp; pair < epr * P; pair += W) {
      const int64_t e = pair / P;
      const int p = int(pair % P);
      int64_t first = 0;
      for (int q = 0; q < p; ++q) first += src_count[e * P + q];
      const int64_t n = src_count[e * P + p];
      // p has started this step: its sums of the last combine's rows are over.
      if (lane == 0) ll_wait_ready(a, p, step, Step::ll_combine);
      __syncwarp();
      __nv_bfloat16* back = region<__nv_bfloat16>(a.peer[p], a.layout.ll_back);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = e * M + first + i;
        const int64_t slot = src_slot[r];
        if (slot < 0 || slot >= N * k) continue;  // only after a failed dispatch (the host throws)
        warp_copy16<4>(reinterpret_cast<int4*>(back + slot * D), reinterpret_cast<const int4*>(rows + r * D), D / 8, lane);
      }
      __threadfence_system();
      __syncwarp();
      if (lane == 0) store_release(region<uint64_t>(a.peer[p], a.layout.ll_combine_flag) + me * epr + e, step);
    }
  }
  if (!(phases & kPhaseReceive)) return;

  // receive: every expert's rows for this source are in, then one warp per token.
  for (int64_t i = threadIdx.x; i < E; i += blockDim.x)
    wait_flag_at(region<uint64_t>(mine, a.layout.ll_combine_flag) + i, step, a.timeout_ns, err, Step::ll_combine,
                 Failure::rows, int(i / epr), int(i));
  __syncthreads();
  const __nv_bfloat16* back = region<__nv_bfloat16>(mine, a.layout.ll_back);
  const int64_t groups = D / 8;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + warp; t < T; t += W) {
    for (int64_t g = lane; g < groups; g += 32) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      if (accumulate) {
        const float4 o0 = reinterpret_cast<const float4*>(out + t * D)[2 * g];
        const float4 o1 = reinterpret_cast<const float4*>(out + t * D)[2 * g + 1];
        acc[0] = o0.x, acc[1] = o0.y, acc[2] = o0.z, acc[3] = o0.w;
        acc[4] = o1.x, acc[5] = o1.y, acc[6] = o1.z, acc[7] = o1.w;
      }
      // NOTES: a batch's rows are all loaded before any is added (loads in flight); the additions
      // still run in slot order.
      constexpr int kBatch = 8;
      for (int64_t j0 = 0; j0 < k; j0 += kBatch) {
        int4 v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          if (j0 + b < k) v[b] = reinterpret_cast<const int4*>(back + (t * k + j0 + b) * D)[g];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (j0 + b >= k) continue;
          float f[8];
          bf16x8(v[b], f);
          const float w = weights ? weights[t * k + j0 + b] : 1.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], weights ? __fmul_rn(w, f[i]) : f[i]);
        }
      }
      float4* o = reinterpret_cast<float4*>(out + t * D) + 2 * g;
      o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  }
  ll_end(a, step);
}

}  // namespace

int ll_threads() { return kThreads; }
const void* ll_dispatch_kernel_ptr() { return reinterpret_cast<const void*>(&ll_dispatch_kernel); }
const void* ll_combine_kernel_ptr() { return reinterpret_cast<const void*>(&ll_combine_kernel); }

void launch_ll_dispatch(const LlArgs& a, const uint8_t* x, const float* x_scales, int64_t x_ld, const int32_t* idx,
                        int phases, cudaStream_t stream) {
  ll_dispatch_kernel<<<a.blocks, kThreads, 0, stream>>>(a, x, x_scales, x_ld, idx, phases);
  FP8MOE_CUDA_CHECK_LAUNCH("ep ll_dispatch_kernel");
}

void launch_ll_combine(const LlArgs& a, const void* rows, const float* weights, float* out, bool accumulate,
                       int phases, cudaStream_t stream) {
  ll_combine_kernel<<<a.blocks, kThreads, 0, stream>>>(a, static_cast<const __nv_bfloat16*>(rows), weights, out,
                                                       accumulate, phases);
  FP8MOE_CUDA_CHECK_LAUNCH("ep ll_combine_kernel");
}

}  // namespace fp8moe::cuda::ep
