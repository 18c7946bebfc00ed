// The combine step: each expert rank's BF16 rows (one per (token, expert) slot it computed,
// source-major, slots in order) back into the source's buffer at their rank-major slot position,
// and on the source the weighted sum of each token's k rows in slot order j = 0..k-1 in FP32,
// each product and each sum rounded as moe_combine does (src/cuda/moe/moe_dispatch.cu), so that
// the result is the Comm path's bit for bit whatever order the rows arrive in.
//   grid   num_sms blocks; block b serves channel b / 2 (a range of the source's tokens).
//   send   8 warps, one team per source rank p with p % 2 == b % 2: the channel's rows for p are
//          contiguous on both sides, copied in 16-byte words; then the fence, the team's barrier
//          and the (rank, channel) flag in p's buffer.
//   pull   (EpConfig::pull_combine) no send: each expert rank's rows stay in its buffer, and the
//          sums below read them there once that rank has started the step.
//   receive-and-accumulate   8 warps, joined by the send warps once their rows are out: once every
//          rank's flag for this channel is up, one warp per token of this block's half of the
//          channel, all k rows of a token loaded before the first addition.
#include "cuda/ep/ep_device.cuh"
#include "cuda/ep/ep_launch.hpp"
#include "cuda/runtime/cuda_check.hpp"

#include <cuda_bf16.h>

namespace fp8moe::cuda::ep {

namespace {

constexpr int kSendWarps = 8, kSumWarps = 8, kThreads = 32 * (kSendWarps + kSumWarps);

// kBlocksPerSm: as the dispatch's (ep_dispatch.cu).
template <int kBlocksPerSm>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    combine_kernel(StepArgs a, const __nv_bfloat16* __restrict__ rows, const int32_t* __restrict__ slot_row,
                   const float* __restrict__ weights, float* __restrict__ out, bool accumulate) {
  __shared__ RankSums sums;
  const int P = a.ranks, C = a.channels, me = a.me;
  const int c = blockIdx.x / 2, half = blockIdx.x % 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t D = a.hidden, k = a.topk;
  const int L = a.counts.length();
  if (blockIdx.x == 0) post_ready(a, threadIdx.x);
  const int32_t* counts = region<int32_t>(a.peer[me], a.layout.counts);
  load_sums(a, counts, sums);

  const int dests = (P - half + 1) / 2;
  if (warp < kSendWarps && dests > 0 && !a.pull) {
    const int team = warp % dests, p = half + 2 * team;
    const int team_warps = (kSendWarps - team + dests - 1) / dests, wit = warp / dests;
    // Channel c of source p: its slots on this rank, the same range on both sides.
    int64_t before = 0;
    for (int cc = 0; cc < c; ++cc) before += counts[p * L + a.counts.slots(cc, me)];
    const int64_t n = counts[p * L + a.counts.slots(c, me)];
    const int64_t src_row = return_base(sums, me, p) + before, dst_row = slot_base(sums, p, me) + before;
    const int4* src = reinterpret_cast<const int4*>(rows + src_row * D);
    int4* dst = reinterpret_cast<int4*>(region<__nv_bfloat16>(a.peer[p], a.layout.combine) + dst_row * D);
    const int64_t words = n * D / 8;
    constexpr int kUnroll = kBlocksPerSm == 1 ? 16 : 4, kChunk = 32 * kUnroll;
    if (lane == 0) wait_ready(a, p, Step::combine);
    __syncwarp();
    for (int64_t w0 = int64_t(wit) * kChunk; w0 < words; w0 += int64_t(team_warps) * kChunk)
      warp_copy16<kUnroll>(dst + w0, src + w0, words - w0 < kChunk ? words - w0 : kChunk, lane);
    __threadfence_system();
    named_sync(1 + team, 32 * team_warps);
    if (wit == 0 && lane == 0)
      store_release(region<uint64_t>(a.peer[p], a.layout.combine_flag) + me * kMaxChannels + c, a.step);
  }

  // receive-and-accumulate (every warp, the send warps after their rows): this block's half of the
  // channel's tokens.
  constexpr int kWarps = kSendWarps + kSumWarps;
  const int w = (warp + kSumWarps) % kWarps;  // the sum warps take the first tokens
  // Push: the rows of every rank for this channel are here. Pull: every rank has started this
  // step, so its rows are in its buffer (written by the work before the step on its stream).
  if (lane < P) {
    if (a.pull)
      wait_ready(a, lane, Step::combine);
    else
      wait_flag(a, region<uint64_t>(a.peer[me], a.layout.combine_flag) + lane * kMaxChannels + c, Step::combine,
                Failure::rows, lane, c);
  }
  __syncwarp();
  const int64_t c0 = channel_begin(a.tokens, c, C), c1 = channel_begin(a.tokens, c + 1, C);
  const int64_t t0 = c0 + (c1 - c0) * half / 2, t1 = c0 + (c1 - c0) * (half + 1) / 2;
  const __nv_bfloat16* back = region<__nv_bfloat16>(a.peer[me], a.layout.combine);
  const int64_t groups = D / 8;
  for (int64_t t = t0 + w; t < t1; t += kWarps) {
    int32_t my_row = -1;
    float my_w = 0.0f;
    const __nv_bfloat16* my_src = back;  // the rows of slot `lane`: here (push) or on its rank (pull)
    if (lane < k) {
      my_row = slot_row[t * k + lane];
      my_w = weights ? weights[t * k + lane] : 1.0f;
      if (a.pull) {
        // Slot rows are rank-major: rank d's start at slot_base(me, d); on d they are the rows
        // for this source, from return_base(d, me).
        int d = 0;
        while (d + 1 < P && slot_base(sums, me, d + 1) <= my_row) ++d;
        my_src = region<__nv_bfloat16>(a.peer[d], a.layout.combine_in) +
                 (return_base(sums, d, me) - slot_base(sums, me, d)) * D;
      }
    }
    // Row of slot j, from the lane that read it (the whole warp calls this).
    auto row_of = [&](int64_t j) {
      const int32_t r = __shfl_sync(~0u, my_row, int(j & 31));
      const auto* src =
          reinterpret_cast<const __nv_bfloat16*>(__shfl_sync(~0u, reinterpret_cast<uintptr_t>(my_src), int(j & 31)));
      return reinterpret_cast<const int4*>(src + int64_t(r) * D);
    };
    // Rows of a token loaded at once: all of top-8 where the registers allow; the first batch's
    // row pointers and weights are read once per token, not once per column group.
    constexpr int kBatch = kBlocksPerSm == 1 ? 8 : 4;
    const int4* first[kBatch];
    float first_w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      first[b] = row_of(b);
      first_w[b] = __shfl_sync(~0u, my_w, b);
    }
    // NOTES: every lane runs every iteration (the shuffles need the whole warp); lanes past the
    // row's end load and store nothing.
    for (int64_t g0 = 0; g0 < groups; g0 += 32) {
      const int64_t g = g0 + lane;
      const bool live = g < groups;
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      if (accumulate && live) {
        const float4 o0 = reinterpret_cast<const float4*>(out + t * D)[2 * g];
        const float4 o1 = reinterpret_cast<const float4*>(out + t * D)[2 * g + 1];
        acc[0] = o0.x, acc[1] = o0.y, acc[2] = o0.z, acc[3] = o0.w;
        acc[4] = o1.x, acc[5] = o1.y, acc[6] = o1.z, acc[7] = o1.w;
      }
      // NOTES: the rows of a batch are all loaded before any is added (loads in flight); the
      // additions still run in slot order.
      for (int64_t j0 = 0; j0 < k; j0 += kBatch) {
        int4 v[kBatch];
        float wv[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int4* p = j0 == 0 ? first[b] : row_of(j0 + b);
          wv[b] = j0 == 0 ? first_w[b] : __shfl_sync(~0u, my_w, int((j0 + b) & 31));
          if (live && j0 + b < k) v[b] = p[g];
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (!live || j0 + b >= k) continue;
          float f[8];
          bf16x8(v[b], f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], weights ? __fmul_rn(wv[b], f[i]) : f[i]);
        }
      }
      if (!live) continue;
      float4* o = reinterpret_cast<float4*>(out + t * D) + 2 * g;
      o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  }
}

}  // namespace

int combine_threads() { return kThreads; }

const void* combine_kernel_ptr(int blocks_per_sm) {
  return blocks_per_sm == 1 ? reinterpret_cast<const void*>(&combine_kernel<1>)
                            : reinterpret_cast<const void*>(&combine_kernel<2>);
}

void launch_combine(const StepArgs& a, const void* rows, const int32_t* slot_row, const float* weights, float* out,
                    bool accumulate, cudaStream_t stream) {
  auto* k = a.blocks_per_sm == 1 ? &combine_kernel<1> : &combine_kernel<2>;
  k<<<2 * a.channels, kThreads, 0, stream>>>(a, static_cast<const __nv_bfloat16*>(rows), slot_row,
                                                          weights, out, accumulate);
  FP8MOE_CUDA_CHECK_LAUNCH("ep combine_kernel");
}

}  // namespace fp8moe::cuda::ep
