// The dispatch step over several nodes (DeepSeek-V3 §3.2.2: node-limited routing, the IB hop to
// the GPU of the same in-node index, then NVLink inside the node). Ranks are grouped in nodes of
// R = ranks_per_node consecutive ranks; on one machine the "nodes" are groups of its GPUs (or of
// the buffers of one GPU). Each row crosses to another node once per destination node, however
// many of that node's ranks hold its experts, and lands where the single-hop dispatch puts it
// (ep_dispatch.cu), so that both give the same bytes on every rank.
//   grid   num_sms blocks; block b serves channel b / 2 (a contiguous range of this rank's tokens).
//   send   10 warps, one team per target of this block's half (targets: the R ranks of this node,
//          then one forwarder per other node, the rank of this rank's in-node index there; target
//          j goes to the half j % 2). An in-node target takes its rows straight into their final
//          position, as the single-hop dispatch does. A forwarder's team stages every row that
//          has an expert on its node once, at the token's index in the region for this node
//          (values, scales token-major, weights, ids), with the row each rank of that node must
//          put it at (or -1), computed here as for a direct send; it writes the source's slot_row
//          for those ranks, the channel's token range, then one release of the (source, channel)
//          staging flag.
//   forward 4 warps: for each other node m, the rows staged here by the rank of this in-node
//          index there (source p): once p's staging flag for this channel is up, each staged row
//          goes to the ranks of this node with l % 2 == this half that it lists; then the fence,
//          the forwarders' barrier and one release of p's dispatch flag on each of those ranks,
//          which is what their receive warps wait for, as from a direct send.
//   receive 2 warps: as the single-hop dispatch's.
// The first hop's traffic is the staged rows: values, scales, weights, ids and R destination rows
// each.
#include "cuda/ep/ep_device.cuh"
#include "cuda/ep/ep_launch.hpp"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda::ep {

namespace {

constexpr int kSendWarps = 10, kForwardWarps = 4, kRecvWarps = 2;
constexpr int kThreads = 32 * (kSendWarps + kForwardWarps + kRecvWarps);
constexpr int kForwardBarrier = 8;  // send teams take the barriers 1 .. 4

// The staging regions of node m in a forwarder's buffer: [T_max] rows of each part.
struct Stage {
  uint8_t* x;
  float *scales, *weights;
  int32_t *ids, *dest;
};
__device__ __forceinline__ Stage stage_of(const StepArgs& a, char* buf, int m) {
  const int64_t N = a.max_tokens, D = a.hidden, G = D / 128, k = a.topk, R = a.ranks_per_node;
  return {region<uint8_t>(buf, a.layout.stage_x) + m * N * D, region<float>(buf, a.layout.stage_scales) + m * N * G,
          region<float>(buf, a.layout.stage_weights) + m * N * k, region<int32_t>(buf, a.layout.stage_ids) + m * N * k,
          region<int32_t>(buf, a.layout.stage_dest) + m * N * R};
}

template <int kBlocksPerSm>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    two_hop_dispatch_kernel(StepArgs a, const uint8_t* __restrict__ x, const float* __restrict__ x_scales,
                            int64_t x_ld, const float* __restrict__ weights, const int32_t* __restrict__ idx,
                            int32_t* __restrict__ slot_row) {
  __shared__ RankSums sums;
  const int P = a.ranks, C = a.channels, me = a.me, R = a.ranks_per_node, nodes = P / R;
  const int node = me / R, li = me % R;
  const int c = blockIdx.x / 2, half = blockIdx.x % 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int Ti = int(a.tokens), ki = int(a.topk), D = int(a.hidden), G = D / 128, epr = int(a.experts_per_rank);
  const int L = a.counts.length();
  constexpr int kUnroll = kBlocksPerSm == 1 ? 16 : 4;
  if (blockIdx.x == 0) post_ready(a, threadIdx.x);
  const int32_t* counts = region<int32_t>(a.peer[me], a.layout.counts);
  load_sums(a, counts, sums);

  if (warp >= kSendWarps + kForwardWarps) {
    dispatch_receive(a, sums, c, half, warp - kSendWarps - kForwardWarps, kRecvWarps, lane);
    return;
  }

  if (warp >= kSendWarps) {  // forward
    const int fw = warp - kSendWarps;
    if (lane == 0)
      for (int l = half; l < R; l += 2) wait_ready(a, node * R + l, Step::dispatch);
    __syncwarp();
    for (int m = 0; m < nodes; ++m) {
      if (m == node) continue;
      const int p = m * R + li;
      const uint64_t* flag = region<uint64_t>(a.peer[me], a.layout.stage_flag) + p * kMaxChannels + c;
      if (lane == 0) wait_flag(a, flag, Step::dispatch, Failure::rows, p, c);
      __syncwarp();
      (void)load_acquire(flag);  // every lane's own acquire before it reads the staged rows
      const int2 range = region<int2>(a.peer[me], a.layout.stage_range)[p * kMaxChannels + c];
      const Stage st = stage_of(a, a.peer[me], m);
      for (int t = range.x + fw; t < range.y; t += kForwardWarps) {
        const int my_dest = lane < R ? st.dest[int64_t(t) * R + lane] : -1;
        for (int l = half; l < R; l += 2) {
          const int r = __shfl_sync(~0u, my_dest, l);
          if (r < 0) continue;
          const int d = node * R + l;
          char* dst = a.peer[d];
          store_row<kUnroll, false>(st.x + int64_t(t) * D, st.scales + int64_t(t) * G, 1, st.weights + int64_t(t) * ki,
                                    st.ids + int64_t(t) * ki, region<uint8_t>(dst, a.layout.x),
                                    region<float>(dst, a.layout.scales), region<float>(dst, a.layout.weights),
                                    region<int32_t>(dst, a.layout.ids), r, int(scale_ld_dev(rows_at(sums, P, d))), D,
                                    G, ki, lane);
        }
      }
      __threadfence_system();
      named_sync(kForwardBarrier, 32 * kForwardWarps);
      if (fw == 0 && lane == 0)
        for (int l = half; l < R; l += 2)
          store_release(region<uint64_t>(a.peer[node * R + l], a.layout.dispatch_flag) + p * kMaxChannels + c, a.step);
    }
    return;
  }

  // send: teams over this half's targets. Target j < R: rank node * R + j; j >= R: the forwarder
  // of the (j - R)-th other node.
  const int targets = R + nodes - 1, mine = (targets - half + 1) / 2;
  if (mine == 0) return;
  const int team = warp % mine, j = half + 2 * team;
  const int team_warps = (kSendWarps - team + mine - 1) / mine, wit = warp / mine;
  const int t_begin = int(channel_begin(Ti, c, C)), t_end = int(channel_begin(Ti, c + 1, C));
  // Where channel c's rows and slots for rank d begin: as in the single-hop dispatch.
  auto row_of = [&](int d) {
    int r = int(row_base(sums, me, d));
    for (int cc = 0; cc < c; ++cc) r += counts[me * L + a.counts.tokens(cc, d)];
    return r;
  };
  auto slot_of = [&](int d) {
    int s = int(slot_base(sums, me, d));
    for (int cc = 0; cc < c; ++cc) s += counts[me * L + a.counts.slots(cc, d)];
    return s;
  };
  // The ranks a token's row goes to through this target: one (in-node) or the R of a node.
  const int n = j < R ? node : (j - R < node ? j - R : j - R + 1);
  const int d0 = j < R ? node * R + j : n * R, nd = j < R ? 1 : R;
  const int f = j < R ? d0 : n * R + li;  // the written buffer's rank: the target itself, or the forwarder
  int row[kMaxRanks], slot[kMaxRanks];
  for (int l = 0; l < nd; ++l) {
    row[l] = row_of(d0 + l);
    slot[l] = slot_of(d0 + l);
  }
  char* dst = a.peer[f];
  const Stage st = stage_of(a, dst, node);
  if (lane == 0) wait_ready(a, f, Step::dispatch);
  __syncwarp();
  int ordinal = 0;  // rows of this channel written to f so far
  for (int t0 = t_begin; t0 < t_end; t0 += 32) {
    const int t = t0 + lane;
    bool any = false;
    int dest[kMaxRanks];
    for (int l = 0; l < nd; ++l) {
      int here = 0;
      if (t < t_end)
        for (int e = 0; e < ki; ++e) here += on_rank(idx[t * ki + e], d0 + l, epr);
      const uint32_t goes = __ballot_sync(~0u, here > 0);
      int incl = here;  // inclusive scan of the slots to d0 + l over the lanes
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(~0u, incl, o);
        if (lane >= o) incl += v;
      }
      dest[l] = here > 0 ? row[l] + __popc(goes & ((1u << lane) - 1u)) : -1;
      if (wit == 0 && here > 0) {
        int32_t s = int32_t(slot[l] + incl - here);
        for (int e = 0; e < ki; ++e)
          if (on_rank(idx[t * ki + e], d0 + l, epr)) slot_row[t * ki + e] = s++;
      }
      row[l] += __popc(goes);
      slot[l] += __shfl_sync(~0u, incl, 31);
      any = any || here > 0;
    }
    if (j >= R && wit == 0 && t < t_end)
      for (int l = 0; l < R; ++l) st.dest[int64_t(t) * R + l] = dest[l];
    const uint32_t sends = __ballot_sync(~0u, any);
    for (uint32_t mask = sends; mask != 0; mask &= mask - 1, ++ordinal) {
      if (ordinal % team_warps != wit) continue;
      const int src = t0 + __ffs(mask) - 1;
      const int r_direct = __shfl_sync(~0u, dest[0], __ffs(mask) - 1);
      if (j < R)
        store_row<kUnroll, true>(x + int64_t(src) * D, x_scales + src, x_ld, weights + src * ki, idx + src * ki,
                                 region<uint8_t>(dst, a.layout.x), region<float>(dst, a.layout.scales),
                                 region<float>(dst, a.layout.weights), region<int32_t>(dst, a.layout.ids), r_direct,
                                 int(scale_ld_dev(rows_at(sums, P, f))), D, G, ki, lane);
      else  // staged at the token's index, scales token-major
        store_row<kUnroll, true>(x + int64_t(src) * D, x_scales + src, x_ld, weights + src * ki, idx + src * ki, st.x,
                                 st.scales + int64_t(src) * G - src, st.weights, st.ids, src, 1, D, G, ki, lane);
    }
  }
  if (j >= R && wit == 0 && lane == 0)
    region<int2>(dst, a.layout.stage_range)[me * kMaxChannels + c] = make_int2(t_begin, t_end);
  __threadfence_system();
  named_sync(1 + team, 32 * team_warps);
  if (wit == 0 && lane == 0)
    store_release(region<uint64_t>(dst, j < R ? a.layout.dispatch_flag : a.layout.stage_flag) + me * kMaxChannels + c,
                  a.step);
}

}  // namespace

const void* two_hop_dispatch_kernel_ptr(int blocks_per_sm) {
  return blocks_per_sm == 1 ? reinterpret_cast<const void*>(&two_hop_dispatch_kernel<1>)
                            : reinterpret_cast<const void*>(&two_hop_dispatch_kernel<2>);
}

void launch_two_hop_dispatch(const StepArgs& a, const uint8_t* x, const float* x_scales, int64_t x_ld,
                             const float* weights, const int32_t* idx, int32_t* slot_row, cudaStream_t stream) {
  auto* k = a.blocks_per_sm == 1 ? &two_hop_dispatch_kernel<1> : &two_hop_dispatch_kernel<2>;
  k<<<2 * a.channels, kThreads, 0, stream>>>(a, x, x_scales, x_ld, weights, idx, slot_row);
  FP8MOE_CUDA_CHECK_LAUNCH("ep two_hop_dispatch_kernel");
}

}  // namespace fp8moe::cuda::ep
