// The dispatch step: FP8 rows with their 1x128 scales, routing weights and expert ids, from each
// rank straight into the final position on every rank that holds one of the token's experts
// (source-major, tokens ascending: the Comm path's order), so that no copy follows on arrival.
//   grid   num_sms blocks; block b serves channel b / 2 (a contiguous range of this rank's tokens)
//          for the ranks d with d % 2 == b % 2.
//   send   14 warps, one team per destination rank. Every warp of a team walks the channel's
//          tokens 32 at a time (ballot: which go to d, and their order), so the team agrees on
//          each row's position without communicating; row i of the channel is copied by warp
//          i % team, all of its loads issued before its stores. The team's first warp also
//          writes the source's slot_row (the combine's map: row of slot (t, j) among the rows
//          that come back, rank-major). Then a system-scope fence, the team's barrier, and one
//          release of the (source, channel) flag in d's buffer.
//   receive 2 warps wait for the flags of the sources p with p % 2 == b % 2 on this channel, so that
//          the step ends on this rank only once its rows are all here; block 0 writes the scale
//          padding rows.
#include "cuda/ep/ep_device.cuh"
#include "cuda/ep/ep_launch.hpp"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda::ep {

namespace {

constexpr int kSendWarps = 14, kRecvWarps = 2, kThreads = 32 * (kSendWarps + kRecvWarps);

// kBlocksPerSm 2 where the ranks of one GPU need two blocks per SM to be resident together (fewer
// registers, fewer loads in flight), else 1.
template <int kBlocksPerSm>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    dispatch_kernel(StepArgs a, const uint8_t* __restrict__ x, const float* __restrict__ x_scales, int64_t x_ld,
                    const float* __restrict__ weights, const int32_t* __restrict__ idx, int32_t* __restrict__ slot_row) {
  __shared__ RankSums sums;
  const int P = a.ranks, C = a.channels, me = a.me;
  const int c = blockIdx.x / 2, half = blockIdx.x % 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = a.tokens, k = a.topk, D = a.hidden, G = D / 128, epr = a.experts_per_rank;
  if (blockIdx.x == 0) post_ready(a, threadIdx.x);
  const int32_t* counts = region<int32_t>(a.peer[me], a.layout.counts);
  load_sums(a, counts, sums);

  if (warp >= kSendWarps) {
    dispatch_receive(a, sums, c, half, warp - kSendWarps, kRecvWarps, lane);
    return;
  }

  // send: teams over the destinations of this block.
  const int dests = (P - half + 1) / 2;
  if (dests == 0) return;
  const int team = warp % dests, d = half + 2 * team;
  const int team_warps = (kSendWarps - team + dests - 1) / dests, wit = warp / dests;
  const int L = a.counts.length();
  // NOTES: 32-bit rows, tokens and slots in the loop below (buffer_layout bounds them), for the
  // registers of the two-blocks-per-SM variant.
  int row = int(row_base(sums, me, d)), slot = int(slot_base(sums, me, d));
  const int Ti = int(T), ki = int(k), Gi = int(G), epri = int(epr);
  for (int cc = 0; cc < c; ++cc) {
    row += counts[me * L + a.counts.tokens(cc, d)];
    slot += counts[me * L + a.counts.slots(cc, d)];
  }
  const int ld = int(scale_ld_dev(rows_at(sums, P, d)));
  char* dst = a.peer[d];
  uint8_t* dx = region<uint8_t>(dst, a.layout.x);
  float* ds = region<float>(dst, a.layout.scales);
  float* dw = region<float>(dst, a.layout.weights);
  int32_t* di = region<int32_t>(dst, a.layout.ids);
  if (lane == 0) wait_ready(a, d, Step::dispatch);
  __syncwarp();
  const int t_end = int(channel_begin(Ti, c + 1, C));
  int ordinal = 0;  // rows of this channel to d so far
  for (int t0 = int(channel_begin(Ti, c, C)); t0 < t_end; t0 += 32) {
    const int t = t0 + lane;
    int here = 0;
    if (t < t_end)
      for (int j = 0; j < ki; ++j) here += on_rank(idx[t * ki + j], d, epri);
    const uint32_t goes = __ballot_sync(~0u, here > 0);
    int incl = here;  // inclusive scan of the slots to d over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(~0u, incl, o);
      if (lane >= o) incl += v;
    }
    if (wit == 0 && here > 0) {
      int32_t s = int32_t(slot + incl - here);
      for (int j = 0; j < ki; ++j)
        if (on_rank(idx[t * ki + j], d, epri)) slot_row[t * ki + j] = s++;
    }
    slot += __shfl_sync(~0u, incl, 31);
    for (uint32_t m = goes; m != 0; m &= m - 1, ++ordinal) {
      if (ordinal % team_warps != wit) continue;
      const int src = t0 + __ffs(m) - 1;
      store_row<kBlocksPerSm == 1 ? 16 : 4, true>(x + int64_t(src) * D, x_scales + src, x_ld, weights + src * ki,
                                                  idx + src * ki, dx, ds, dw, di, row + ordinal, ld, int(D), Gi, ki,
                                                  lane);
    }
  }
  __threadfence_system();
  named_sync(1 + team, 32 * team_warps);
  if (wit == 0 && lane == 0)
    store_release(region<uint64_t>(dst, a.layout.dispatch_flag) + me * kMaxChannels + c, a.step);
}

}  // namespace

int dispatch_threads() { return kThreads; }

const void* dispatch_kernel_ptr(int blocks_per_sm) {
  return blocks_per_sm == 1 ? reinterpret_cast<const void*>(&dispatch_kernel<1>)
                            : reinterpret_cast<const void*>(&dispatch_kernel<2>);
}

void launch_dispatch(const StepArgs& a, const uint8_t* x, const float* x_scales, int64_t x_ld, const float* weights,
                     const int32_t* idx, int32_t* slot_row, cudaStream_t stream) {
  auto* k = a.blocks_per_sm == 1 ? &dispatch_kernel<1> : &dispatch_kernel<2>;
  k<<<2 * a.channels, kThreads, 0, stream>>>(a, x, x_scales, x_ld, weights, idx, slot_row);
  FP8MOE_CUDA_CHECK_LAUNCH("ep dispatch_kernel");
}

}  // namespace fp8moe::cuda::ep
