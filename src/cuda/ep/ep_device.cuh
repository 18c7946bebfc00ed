// Device functions of the expert-parallel kernels: system-scope flags, waits that give up after a
// timeout (recording which wait failed in the rank's error word instead of hanging), warp copies
// with 16-byte accesses, and the offsets every step derives from the gathered counts.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ep/ep_args.hpp"

namespace fp8moe::cuda::ep {

template <class T>
__device__ __forceinline__ T* region(char* base, size_t off) {
  return reinterpret_cast<T*>(base + off);
}

// NOTES: release/acquire at system scope: the rows a peer reads were written by another process's
// kernel (or another GPU) and ordered before the flag by this release.
__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t* error_word(const StepArgs& a) {
  return region<uint32_t>(a.peer[a.me], a.layout.error);
}

// The first failure of this rank's step: the host reads it after the stream (ep_group.cpp).
__device__ __forceinline__ void record_failure(uint32_t* e, Step step, Failure kind, int peer, int channel) {
  if (atomicCAS(e + 1, 0u, uint32_t(step)) == 0) {
    e[2] = uint32_t(kind);
    e[3] = uint32_t(peer);
    e[4] = uint32_t(channel);
    __threadfence();
    atomicExch(e, 1u);
  }
}

// Waits (one thread) until *flag >= step. On timeout, or when another wait of this rank has
// already failed, records the first failure and returns false: the step's results are then
// garbage and the host throws (ep_group.cpp).
// NOTES: scalars, not the StepArgs: a reference to the kernel's parameters would copy them all to
// the stack of every kernel that waits.
static __device__ __noinline__ bool wait_flag_at(const uint64_t* flag, uint64_t step, uint64_t timeout_ns, uint32_t* e,
                                                 Step kind_of_step, Failure kind, int peer, int channel) {
  if (load_acquire(flag) >= step) return true;
  const uint64_t t0 = global_ns();
  for (uint32_t spin = 0;; ++spin) {
    if (load_acquire(flag) >= step) return true;
    if ((spin & 1023) == 0 && (*reinterpret_cast<volatile uint32_t*>(e) != 0 || global_ns() - t0 > timeout_ns)) break;
  }
  record_failure(e, kind_of_step, kind, peer, channel);
  return false;
}

__device__ __forceinline__ bool wait_flag(const StepArgs& a, const uint64_t* flag, Step step, Failure kind, int peer,
                                          int channel) {
  return wait_flag_at(flag, a.step, a.timeout_ns, error_word(a), step, kind, peer, channel);
}

// Posts "rank me has started this step" in every peer's buffer (thread q of one block, q < P).
__device__ __forceinline__ void post_ready(const StepArgs& a, int q) {
  if (q < a.ranks) store_release(region<uint64_t>(a.peer[q], a.layout.ready) + a.me, a.step);
}
// Rank q has started this step: whatever it read from its buffer in earlier steps is read.
__device__ __forceinline__ bool wait_ready(const StepArgs& a, int q, Step step) {
  return wait_flag(a, region<uint64_t>(a.peer[a.me], a.layout.ready) + q, step, Failure::ready, q, 0);
}

// A warp copies n 16-byte words, kUnroll loads in flight per lane before the stores. kStable:
// the source does not change while the kernel runs (the read-only path may cache it); a source a
// peer writes during the kernel (a forwarder's staged rows) is read with plain loads.
// NOTES: the lane's pointers advance by whole rounds, so the unrolled accesses of a round are
// immediate offsets of one address (few registers however large kUnroll is).
template <int kUnroll, bool kStable = true>
__device__ __forceinline__ void warp_copy16(int4* __restrict__ dst, const int4* __restrict__ src, int64_t n, int lane) {
  const int4* s = src + lane;
  int4* d = dst + lane;
  for (int64_t rem = n - lane; rem > 0; rem -= 32 * kUnroll, s += 32 * kUnroll, d += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u * 32 < rem) v[u] = kStable ? __ldg(s + u * 32) : s[u * 32];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u * 32 < rem) d[u * 32] = v[u];
  }
}

// Eight BF16 values of a 16-byte word as floats.
__device__ __forceinline__ void bf16x8(const int4& v, float* f) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// Token range of channel c of T tokens: [T * c / C, T * (c + 1) / C).
__device__ __forceinline__ int64_t channel_begin(int64_t T, int c, int C) { return T * c / C; }

// Sums over channels of the gathered counts (shared memory, computed by the block at its start):
// tok[p][d] rows source p sends to rank d, slot[p][d] its slots there.
struct RankSums {
  int32_t tok[kMaxRanks][kMaxRanks];
  int32_t slot[kMaxRanks][kMaxRanks];
};

__device__ __forceinline__ void load_sums(const StepArgs& a, const int32_t* counts, RankSums& s) {
  const int P = a.ranks, L = a.counts.length();
  for (int i = threadIdx.x; i < P * P; i += blockDim.x) {
    const int p = i / P, d = i % P;
    int32_t t = 0, sl = 0;
    for (int c = 0; c < a.channels; ++c) {
      t += counts[p * L + a.counts.tokens(c, d)];
      sl += counts[p * L + a.counts.slots(c, d)];
    }
    s.tok[p][d] = t;
    s.slot[p][d] = sl;
  }
  __syncthreads();
}

// Rows that reach rank d, and where source p's rows start there (source-major).
__device__ __forceinline__ int64_t rows_at(const RankSums& s, int P, int d) {
  int64_t n = 0;
  for (int q = 0; q < P; ++q) n += s.tok[q][d];
  return n;
}
__device__ __forceinline__ int64_t row_base(const RankSums& s, int p, int d) {
  int64_t n = 0;
  for (int q = 0; q < p; ++q) n += s.tok[q][d];
  return n;
}
// Where rank d's slots start among those that come back to source p (rank-major).
__device__ __forceinline__ int64_t slot_base(const RankSums& s, int p, int d) {
  int64_t n = 0;
  for (int q = 0; q < d; ++q) n += s.slot[p][q];
  return n;
}
// Where the rows rank d returns to source p start among d's combine input (source-major).
__device__ __forceinline__ int64_t return_base(const RankSums& s, int d, int p) {
  int64_t n = 0;
  for (int q = 0; q < p; ++q) n += s.slot[q][d];
  return n;
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- the dispatch's parts (ep_dispatch.cu, ep_dispatch_two_hop.cu) ----

// Expert e on rank d (ids out of range, which notify reports, on none).
__device__ __forceinline__ bool on_rank(int32_t e, int d, int epr) { return e >= 0 && e / epr == d; }

__device__ __forceinline__ int64_t scale_ld_dev(int64_t rows) { return (rows + 3) / 4 * 4; }

// One row into row r of a rank's receive regions (x, scales group-major at ld, weights, ids): the
// values' D / 16 words, G scales (scale g at s[g * s_stride]), k weights and ids.
// NOTES: every load of the row (its values' first round, two scales, its weight and id per lane)
// is issued before the first store: one DRAM round trip per row instead of three.
template <int kUnroll, bool kStable>
__device__ __forceinline__ void store_row(const uint8_t* x, const float* s, int64_t s_stride, const float* w,
                                          const int32_t* id, uint8_t* dx, float* ds, float* dw, int32_t* di, int r,
                                          int ld, int D, int G, int k, int lane) {
  float s0 = 0.0f, s1 = 0.0f, wv = 0.0f;
  int32_t iv = 0;
  if (lane < G) s0 = s[int64_t(lane) * s_stride];
  if (lane + 32 < G) s1 = s[int64_t(lane + 32) * s_stride];
  if (lane < k) {
    wv = w[lane];
    iv = id[lane];
  }
  warp_copy16<kUnroll, kStable>(reinterpret_cast<int4*>(dx + int64_t(r) * D),
                                reinterpret_cast<const int4*>(x), D / 16, lane);
  if (lane < G) ds[int64_t(lane) * ld + r] = s0;
  if (lane + 32 < G) ds[int64_t(lane + 32) * ld + r] = s1;
  for (int g = lane + 64; g < G; g += 32) ds[int64_t(g) * ld + r] = s[int64_t(g) * s_stride];
  if (lane < k) {
    dw[int64_t(r) * k + lane] = wv;
    di[int64_t(r) * k + lane] = iv;
  }
}

// The dispatch's receive warps (w of `warps`) of block (channel c, half): wait for the flags of the
// sources p with p % 2 == half on this channel, so that the step ends on this rank only once its
// rows are all here; block 0's first warp writes the scale padding rows.
__device__ __forceinline__ void dispatch_receive(const StepArgs& a, const RankSums& sums, int c, int half, int w,
                                                 int warps, int lane) {
  const int P = a.ranks, me = a.me, G = int(a.hidden / 128);
  if (blockIdx.x == 0 && w == 0 && scale_ld_dev(rows_at(sums, P, me)) > rows_at(sums, P, me)) {
    // Scale padding rows [rows, scale_ld(rows)) of each group: 1, as the quantized layout has.
    const int64_t n = rows_at(sums, P, me), ld = scale_ld_dev(n);
    float* s = region<float>(a.peer[me], a.layout.scales);
    for (int64_t i = lane; i < G * (ld - n); i += 32) s[(i / (ld - n)) * ld + n + i % (ld - n)] = 1.0f;
  }
  if (lane == 0)
    for (int p = half + 2 * w; p < P; p += 2 * warps)
      wait_flag(a, region<uint64_t>(a.peer[me], a.layout.dispatch_flag) + p * kMaxChannels + c, Step::dispatch,
                Failure::rows, p, c);
}

}  // namespace fp8moe::cuda::ep
