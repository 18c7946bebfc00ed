// The two-micro-batch prefill layer step (two_batch_prefill.hpp).
#include "serve/two_batch_prefill.hpp"

#include <cub/block/block_scan.cuh>

#include <cmath>
#include <exception>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "cuda/kernel_api.hpp"
#include "cuda/moe/moe_api.hpp"
#include "cuda/ops/model_ops.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/backend.hpp"
#include "fp8moe/error.hpp"
#include "parallel/runtime/ep_reference.hpp"
#include "serve/two_batch_device.hpp"

namespace fp8moe::serve {

using cuda::ep::EpConfig;
using cuda::ep::EpGroup;
using cuda::ep::EpRank;
using detail::Buf;
using detail::download;
using detail::QBuf;
using detail::random_weight;
using detail::upload;

namespace {

constexpr int64_t kAlign = 128;  // the contiguous layout's segment alignment (the GEMM's block rows)
constexpr int kOrderThreads = 1024;

// ids [n, k] of the received rows -> this rank's expert of each slot (id - base), -1 elsewhere.
__global__ void localize_ids_kernel(const int32_t* __restrict__ ids, int64_t slots, int32_t base, int32_t local,
                                    int32_t* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= slots) return;
  const int32_t e = ids[i] - base;
  out[i] = e >= 0 && e < local ? e : -1;
}

// Row r of the contiguous layout (below offsets[G]) = received row row_slot[r] / k, its FP8 values
// and 1x128 scales as they arrived; padding rows zero with scale 1. One warp per (row, 128-column
// tile), four bytes a lane.
__global__ void gather_fp8_rows_kernel(const uint8_t* __restrict__ x, const float* __restrict__ xs, int64_t x_ld,
                                       const int32_t* __restrict__ row_slot, const int32_t* __restrict__ end,
                                       int64_t k, int64_t D, uint8_t* __restrict__ q, float* __restrict__ qs,
                                       int64_t q_ld, int64_t R) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x % 32);
  const int64_t tiles = D / 128, row = warp / tiles, tile = warp % tiles;
  if (row >= R || row >= *end) return;
  const int32_t slot = row_slot[row];
  const int64_t c = tile * 128 + lane * 4;
  uint32_t v = 0;
  float sc = 1.0f;
  if (slot >= 0) {
    const int64_t src = slot / k;
    v = *reinterpret_cast<const uint32_t*>(x + src * D + c);
    sc = xs[tile * x_ld + src];
  }
  *reinterpret_cast<uint32_t*>(q + row * D + c) = v;
  if (lane == 0) qs[tile * q_ld + row] = sc;
}

// order[i] = the layout row of the i-th local slot in (received row, j) order: the combine's row
// order (source-major, slots ascending). One block; each thread a contiguous run of slots.
__global__ void __launch_bounds__(kOrderThreads) combine_order_kernel(const int32_t* __restrict__ local_ids,
                                                                      const int32_t* __restrict__ slot_row,
                                                                      int64_t slots, int32_t* __restrict__ order) {
  using Scan = cub::BlockScan<int32_t, kOrderThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t per = (slots + kOrderThreads - 1) / kOrderThreads, s0 = threadIdx.x * per;
  const int64_t s1 = s0 + per < slots ? s0 + per : slots;
  int32_t mine = 0;
  for (int64_t s = s0; s < s1; ++s) mine += local_ids[s] >= 0;
  int32_t pos = 0;
  Scan(temp).ExclusiveSum(mine, pos);
  for (int64_t s = s0; s < s1; ++s)
    if (local_ids[s] >= 0) order[pos++] = slot_row[s];
}

// out[i] = rows[order[i]] for i < n, bf16 rows of D columns; 16 bytes a thread.
__global__ void gather_bf16_rows_kernel(const uint16_t* __restrict__ rows, const int32_t* __restrict__ order, int64_t n,
                                        int64_t D, uint16_t* __restrict__ out) {
  const int64_t per_row = D / 8, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * per_row) return;
  const int64_t r = i / per_row, c = (i % per_row) * 8;
  *reinterpret_cast<uint4*>(out + r * D + c) = *reinterpret_cast<const uint4*>(rows + int64_t(order[r]) * D + c);
}

// K [T, H, nope + rope] = (kvb's nope part of head h | the shared rope key), V [T, H, v] = kvb's v
// part of head h; kvb [T, H * (nope + v)], kr [T, kr_ld] (its first rope columns). One thread a column.
__global__ void assemble_kv_kernel(const float* __restrict__ kvb, const float* __restrict__ kr, int64_t kr_ld,
                                   int64_t T, int64_t H, int64_t nope, int64_t rope, int64_t vd, float* __restrict__ k,
                                   float* __restrict__ v) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, w = nope + rope + vd;
  if (i >= T * H * w) return;
  const int64_t c = i % w, th = i / w, t = th / H, h = th % H;
  if (c < nope) k[th * (nope + rope) + c] = kvb[(t * H + h) * (nope + vd) + c];
  else if (c < nope + rope) k[th * (nope + rope) + c] = kr[t * kr_ld + (c - nope)];
  else v[th * vd + (c - nope - rope)] = kvb[(t * H + h) * (nope + vd) + nope + (c - nope - rope)];
}

unsigned blocks_of(int64_t threads, int per_block) { return unsigned((threads + per_block - 1) / per_block); }

}  // namespace

struct TwoBatchPrefill::Weights {
  std::unique_ptr<QBuf> qa, qb, kva, kvr, kvb, o;
  Buf norm;  // f32 [D]: the RMSNorms' weights (ones)
  explicit Weights(size_t hidden) : norm(hidden * 4) {}
};

struct TwoBatchPrefill::Rank {
  struct Micro {
    QBuf xq, caq, latq, oq, mq;     // e4m3: x, q_a out, the latent, the attention out, the MoE input
    Buf ca, q, lat, kr, kvb, k, v, o, lse, rstd;  // f32
    Buf idx, w, slot_row;           // the routing i32 / f32 [Tm, k]; the dispatch's slot_row
    Buf rows;                       // bf16 [P * Tm * k, D]: the combine's rows
    std::vector<int32_t> idx_h;
    std::vector<float> w_h;
    Micro(const PrefillShape& s, int64_t Tm)
        : xq(Tm, s.hidden, ScaleKind::tile_1x128), caq(Tm, s.q_rank, ScaleKind::tile_1x128),
          latq(Tm, s.rkv, ScaleKind::tile_1x128), oq(Tm, s.heads * s.v_head, ScaleKind::tile_1x128),
          mq(Tm, s.hidden, ScaleKind::tile_1x128), ca(size_t(Tm * s.q_rank) * 4),
          q(size_t(Tm * s.heads * (s.nope + s.rope)) * 4), lat(size_t(Tm * s.rkv) * 4), kr(size_t(Tm * 128) * 4),
          kvb(size_t(Tm * s.heads * (s.nope + s.v_head)) * 4), k(size_t(Tm * s.heads * (s.nope + s.rope)) * 4),
          v(size_t(Tm * s.heads * s.v_head) * 4), o(size_t(Tm * s.heads * s.v_head) * 4),
          lse(size_t(s.heads * Tm) * 4), rstd(size_t(Tm) * 4), idx(size_t(Tm * s.topk) * 4),
          w(size_t(Tm * s.topk) * 4), slot_row(size_t(Tm * s.topk) * 4),
          rows(size_t(s.ranks * Tm * s.topk * s.hidden) * 2) {}
  };
  Micro mb[2];
  Buf x, y;  // f32 [T, D]: the residual and the last MoE output
  std::vector<float> x0;
  std::unique_ptr<QBuf> gate, up, down;
  // The experts' scratch for n <= P * Tm received rows (MOE(A) and MOE(B) are ordered on the
  // compute stream, so they share it): local ids, the contiguous layout of R rows, its FP8 rows,
  // gate and up, the activations, the down rows, the combine order.
  Buf local_ids, row_slot, row_group, slot_local, offsets, g, u, ye, order;
  QBuf xr, aq;
  int64_t received[2] = {0, 0};  // rows the last dispatch of each micro-batch brought (host)
  int64_t returned[2] = {0, 0};  // rows its combine sends back
  cudaStream_t compute = nullptr;
  cudaEvent_t attn[2] = {}, disp[2] = {}, moe[2] = {}, comb[2] = {}, comm_last = nullptr;
  Rank(const PrefillShape& s, int64_t Tm, int64_t N, int64_t R)
      : mb{Micro(s, Tm), Micro(s, Tm)}, x(size_t(2 * Tm * s.hidden) * 4), y(size_t(2 * Tm * s.hidden) * 4),
        local_ids(size_t(N * s.topk) * 4), row_slot(size_t(R) * 4), row_group(size_t(R) * 4),
        slot_local(size_t(N * s.topk) * 4), offsets(size_t(s.experts / s.ranks + 1) * 4),
        g(size_t(R * s.expert_inter) * 4), u(size_t(R * s.expert_inter) * 4), ye(size_t(R * s.hidden) * 2),
        order(size_t(N * s.topk) * 4), xr(R, s.hidden, ScaleKind::tile_1x128),
        aq(R, s.expert_inter, ScaleKind::tile_1x128) {
    FP8MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    for (auto* e : {&attn[0], &attn[1], &disp[0], &disp[1], &moe[0], &moe[1], &comb[0], &comb[1], &comm_last})
      FP8MOE_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  ~Rank() {
    for (auto e : {attn[0], attn[1], disp[0], disp[1], moe[0], moe[1], comb[0], comb[1], comm_last})
      cudaEventDestroy(e);
    cudaStreamDestroy(compute);
  }
};

TwoBatchPrefill::TwoBatchPrefill(const PrefillShape& shape) : s_(shape) {
  const PrefillShape& s = s_;
  FP8MOE_CHECK(s.ranks >= 1 && s.ranks <= cuda::ep::kMaxRanks,
               "two-batch prefill: ranks must be in [1, " << cuda::ep::kMaxRanks << "], got " << s.ranks);
  FP8MOE_CHECK(s.seq_len > 0 && s.tokens > 0 && s.tokens % (2 * s.seq_len) == 0,
               "two-batch prefill: " << s.tokens << " tokens per rank do not split into two micro-batches of whole "
                                     << s.seq_len << "-token sequences");
  FP8MOE_CHECK(s.expert_inter % 128 == 0 && s.q_rank % 128 == 0 && s.rkv % 128 == 0 &&
                   (s.heads * s.v_head) % 128 == 0 && s.hidden % 128 == 0,
               "two-batch prefill: hidden, expert_inter, q_rank, rkv and heads * v_head must be multiples of 128");
  FP8MOE_CHECK(s.rope >= 1 && s.rope <= 128, "two-batch prefill: rope must be in [1, 128], got " << s.rope);
  FP8MOE_CHECK(s.experts % s.ranks == 0, "two-batch prefill: " << s.experts << " experts do not split over "
                                                               << s.ranks << " ranks");
  const int64_t Tm = s.tokens / 2, N = s.ranks * Tm, El = s.experts / s.ranks, H = s.heads;
  const int64_t R = moe_layout_rows(N * s.topk, El, kAlign);
  EpConfig cfg;
  cfg.ranks = s.ranks;
  cfg.max_tokens = Tm;
  cfg.hidden = s.hidden;
  cfg.topk = s.topk;
  cfg.experts = s.experts;
  cfg.num_sms = s.num_sms;
  for (auto& g : group_) g = EpGroup::local(cfg);
  w_ = std::make_unique<Weights>(size_t(s.hidden));
  upload(w_->norm, std::vector<float>(size_t(s.hidden), 1.0f));
  w_->qa = random_weight(s.q_rank, s.hidden, s.seed + 1);
  w_->qb = random_weight(H * (s.nope + s.rope), s.q_rank, s.seed + 2);
  w_->kva = random_weight(s.rkv, s.hidden, s.seed + 3);
  w_->kvr = random_weight(128, s.hidden, s.seed + 4);
  w_->kvb = random_weight(H * (s.nope + s.v_head), s.rkv, s.seed + 5);
  w_->o = random_weight(s.hidden, H * s.v_head, s.seed + 6);
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int p = 0; p < s.ranks; ++p) {
    auto r = std::make_unique<Rank>(s, Tm, N, R);
    const uint64_t rs = s.seed * 7919 + uint64_t(p) * 101;
    r->gate = random_weight(El * s.expert_inter, s.hidden, rs + 11);
    r->up = random_weight(El * s.expert_inter, s.hidden, rs + 12);
    r->down = random_weight(El * s.hidden, s.expert_inter, rs + 13);
    r->x0.resize(size_t(2 * Tm * s.hidden));
    for (auto& v : r->x0) v = normal(rng);
    for (auto& mb : r->mb) {
      ep::route_uniformly(rng, Tm, s.topk, s.experts, mb.idx_h, mb.w_h);
      upload(mb.idx, mb.idx_h);
      upload(mb.w, mb.w_h);
    }
    ranks_.push_back(std::move(r));
  }
  reset_input();
}

TwoBatchPrefill::~TwoBatchPrefill() { cudaDeviceSynchronize(); }

void TwoBatchPrefill::reset_input() {
  for (auto& r : ranks_) {
    upload(r->x, r->x0);
    FP8MOE_CUDA_CHECK(cudaMemset(r->y.p, 0, r->y.bytes));
  }
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());  // two_batch.cu's reset_input says why
}

// x_m += y_m, the attention (two_batch_prefill.hpp), then the MoE input: RMSNorm(x_m) in e4m3.
void TwoBatchPrefill::attention(int p, int m, cudaStream_t st) {
  const PrefillShape& s = s_;
  Rank& r = *ranks_[size_t(p)];
  Rank::Micro& mb = r.mb[m];
  const int64_t Tm = s.tokens / 2, H = s.heads, D = s.hidden, Dq = s.nope + s.rope;
  const TensorView x = r.x.view(DType::f32, Tm, D, m * Tm), y = r.y.view(DType::f32, Tm, D, m * Tm);
  cuda::cuda_axpy(1.0, y, 1.0, x, st);
  const TensorView norm = w_->norm.vec(DType::f32, D), rstd = mb.rstd.vec(DType::f32, Tm);
  cuda::cuda_rmsnorm_forward_fp8(x, norm, mb.xq.view(), rstd, 1e-6, ScaleMode::pow2, st);
  cuda::gemm_fp8_sm90(mb.xq.view(), w_->qa->view(), mb.ca.view(DType::f32, Tm, s.q_rank), false, st);
  cuda::quantize_1x128_cuda(mb.ca.view(DType::f32, Tm, s.q_rank), mb.caq.view(), ScaleMode::pow2, st, false);
  cuda::gemm_fp8_sm90(mb.caq.view(), w_->qb->view(), mb.q.view(DType::f32, Tm, H * Dq), false, st);
  cuda::gemm_fp8_sm90(mb.xq.view(), w_->kva->view(), mb.lat.view(DType::f32, Tm, s.rkv), false, st);
  cuda::gemm_fp8_sm90(mb.xq.view(), w_->kvr->view(), mb.kr.view(DType::f32, Tm, 128), false, st);
  cuda::quantize_1x128_cuda(mb.lat.view(DType::f32, Tm, s.rkv), mb.latq.view(), ScaleMode::pow2, st, false);
  cuda::gemm_fp8_sm90(mb.latq.view(), w_->kvb->view(), mb.kvb.view(DType::f32, Tm, H * (s.nope + s.v_head)), false,
                      st);
  const int64_t cols = Tm * H * (Dq + s.v_head);
  assemble_kv_kernel<<<blocks_of(cols, 256), 256, 0, st>>>(
      static_cast<const float*>(mb.kvb.p), static_cast<const float*>(mb.kr.p), 128, Tm, H, s.nope, s.rope, s.v_head,
      static_cast<float*>(mb.k.p), static_cast<float*>(mb.v.p));
  FP8MOE_CUDA_CHECK_LAUNCH("assemble_kv_kernel");
  auto heads = [&](const Buf& b, int64_t c) { return TensorView(b.p, DType::f32, {Tm, H, c}, Device::cuda); };
  cuda::cuda_attention_forward(heads(mb.q, Dq), heads(mb.k, Dq), heads(mb.v, s.v_head), heads(mb.o, s.v_head),
                               mb.lse.view(DType::f32, H, Tm), s.seq_len, 1.0 / std::sqrt(double(Dq)), DType::bf16,
                               st);
  cuda::quantize_1x128_cuda(mb.o.view(DType::f32, Tm, H * s.v_head), mb.oq.view(), ScaleMode::pow2, st, false);
  cuda::gemm_fp8_sm90(mb.oq.view(), w_->o->view(), x, true, st);
  cuda::cuda_rmsnorm_forward_fp8(x, norm, mb.mq.view(), rstd, 1e-6, ScaleMode::pow2, st);
}

// Rank p's experts on micro-batch m's n received rows, to the combine's rows (mb.rows).
void TwoBatchPrefill::experts_step(int p, int m, int64_t n, cudaStream_t st) {
  const PrefillShape& s = s_;
  Rank& r = *ranks_[size_t(p)];
  const int64_t k = s.topk, El = s.experts / s.ranks, D = s.hidden, F = s.expert_inter, N = s.ranks * s.tokens / 2;
  const int64_t R = moe_layout_rows(n * k, El, kAlign);
  if (n == 0) return;
  const EpRank::Received got = group_[m]->rank(p).received();
  int32_t* local = static_cast<int32_t*>(r.local_ids.p);
  localize_ids_kernel<<<blocks_of(n * k, 256), 256, 0, st>>>(got.ids.ptr<const int32_t>(), n * k,
                                                             int32_t(p * El), int32_t(El), local);
  FP8MOE_CUDA_CHECK_LAUNCH("localize_ids_kernel");
  const TensorView ids(local, DType::i32, {n, k}, Device::cuda);
  const TensorView slot_local(r.slot_local.p, DType::i32, {n, k}, Device::cuda);
  const TensorView row_group = r.row_group.vec(DType::i32, R), offsets = r.offsets.vec(DType::i32, El + 1);
  cuda::moe_layout_cuda(ids, kAlign, r.row_slot.vec(DType::i32, R), row_group, slot_local, offsets, st);
  gather_fp8_rows_kernel<<<blocks_of(R * (D / 128) * 32, 256), 256, 0, st>>>(
      got.x.values.ptr<const uint8_t>(), got.x.scales.ptr<const float>(), got.x.scales.size(1),
      static_cast<const int32_t*>(r.row_slot.p), offsets.ptr<const int32_t>() + El, k, D,
      static_cast<uint8_t*>(r.xr.values.p), static_cast<float*>(r.xr.scales.p), scale_ld(R), R);
  FP8MOE_CUDA_CHECK_LAUNCH("gather_fp8_rows_kernel");
  // The first R rows of the worst-case buffers, scales [G, scale_ld(R)] from the start of theirs.
  auto rows_of = [&](const QBuf& b) {
    return QuantizedView{b.values.view(DType::e4m3, R, b.cols), b.scales.view(DType::f32, b.cols / 128, scale_ld(R)),
                         ScaleKind::tile_1x128};
  };
  const QuantizedView xr = rows_of(r.xr), aq = rows_of(r.aq);
  cuda::grouped_gemm_fp8_contiguous_cuda(xr, r.gate->view(), row_group, El, r.g.view(DType::f32, R, F), false, st);
  cuda::grouped_gemm_fp8_contiguous_cuda(xr, r.up->view(), row_group, El, r.u.view(DType::f32, R, F), false, st);
  detail::swiglu_quantize_rows(static_cast<const float*>(r.g.p), static_cast<const float*>(r.u.p), R, F, nullptr, 0,
                               row_group.ptr<const int32_t>(), static_cast<uint8_t*>(r.aq.values.p),
                               static_cast<float*>(r.aq.scales.p), st);
  cuda::grouped_gemm_fp8_contiguous_cuda(aq, r.down->view(), row_group, El, r.ye.view(DType::bf16, R, D), false, st);
  combine_order_kernel<<<1, kOrderThreads, 0, st>>>(local, slot_local.ptr<const int32_t>(), n * k,
                                                    static_cast<int32_t*>(r.order.p));
  FP8MOE_CUDA_CHECK_LAUNCH("combine_order_kernel");
  const int64_t back = r.returned[m];
  FP8MOE_CHECK(back <= N * k, "two-batch prefill: " << back << " combine rows above the bound " << N * k);
  if (back > 0) {
    gather_bf16_rows_kernel<<<blocks_of(back * (D / 8), 256), 256, 0, st>>>(
        static_cast<const uint16_t*>(r.ye.p), static_cast<const int32_t*>(r.order.p), back, D,
        static_cast<uint16_t*>(r.mb[m].rows.p));
    FP8MOE_CUDA_CHECK_LAUNCH("gather_bf16_rows_kernel");
  }
}

// Rank p's layers, launched from its own thread (two_batch_prefill.hpp): each step waits by events
// for the steps it reads; comm_last keeps one communication kernel of the rank at a time, in the
// order the ranks share (every rank's k-th communication step is the same step).
void TwoBatchPrefill::rank_steps(int p, TwoBatchMode mode, int layers) {
  const PrefillShape& s = s_;
  Rank& r = *ranks_[size_t(p)];
  const int64_t Tm = s.tokens / 2, D = s.hidden, k = s.topk;
  const bool overlap = mode == TwoBatchMode::overlapped, attn = mode != TwoBatchMode::comm_only;
  const bool comm = mode != TwoBatchMode::compute_only, moe = attn;
  bool chained = false;  // an earlier step of this rank exists (the chain's order)
  auto wait = [](cudaStream_t st, cudaEvent_t e) { FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(st, e)); };
  auto record = [](cudaEvent_t e, cudaStream_t st) { FP8MOE_CUDA_CHECK(cudaEventRecord(e, st)); };
  // Not overlapped: every step on the micro-batch's communication stream after the one before.
  auto comp = [&](int m) { return overlap ? r.compute : group_[m]->rank(p).stream(); };
  auto comm_step = [&](int m, auto&& launch) {
    cudaStream_t cs = group_[m]->rank(p).stream();
    if (chained) wait(cs, r.comm_last);
    launch(group_[m]->rank(p));
    record(r.comm_last, cs);
    chained = true;
  };
  auto attention_of = [&](int l, int m) {
    cudaStream_t st = comp(m);
    if (l > 0) wait(st, r.comb[m]);
    if (!overlap && chained) wait(st, r.comm_last);
    if (attn) attention(p, m, st);
    record(r.attn[m], st);
    if (!overlap) record(r.comm_last, st), chained = true;
  };
  auto notify_of = [&](int m) {
    comm_step(m, [&](EpRank& ep) {
      wait(ep.stream(), r.attn[m]);
      if (comm) ep.notify(r.mb[m].idx.view(DType::i32, Tm, k));
    });
  };
  auto dispatch_of = [&](int m) {
    Rank::Micro& mb = r.mb[m];
    comm_step(m, [&](EpRank& ep) {
      if (comm) {
        const cuda::ep::EpCounts& c = ep.counts();
        r.received[m] = c.received(p);
        r.returned[m] = c.returned(p);
        ep.dispatch(mb.mq.view(), mb.w.view(DType::f32, Tm, k), mb.idx.view(DType::i32, Tm, k),
                    mb.slot_row.view(DType::i32, Tm, k));
      }
      record(r.disp[m], ep.stream());
    });
  };
  auto moe_of = [&](int m) {
    cudaStream_t st = comp(m);
    wait(st, r.disp[m]);
    if (!overlap) wait(st, r.comm_last);
    if (moe) experts_step(p, m, r.received[m], st);
    record(r.moe[m], st);
    if (!overlap) record(r.comm_last, st);
  };
  auto combine_of = [&](int m) {
    Rank::Micro& mb = r.mb[m];
    comm_step(m, [&](EpRank& ep) {
      wait(ep.stream(), r.moe[m]);
      if (comm)
        ep.combine(mb.rows.view(DType::bf16, r.returned[m], D), mb.slot_row.view(DType::i32, Tm, k),
                   mb.w.view(DType::f32, Tm, k), r.y.view(DType::f32, Tm, D, m * Tm), false);
      record(r.comb[m], ep.stream());
    });
  };
  for (int l = 0; l < layers; ++l) {
    if (overlap) {  // the launch order of two_batch_prefill.hpp
      attention_of(l, 0);
      notify_of(0);
      attention_of(l, 1);
      dispatch_of(0);  // its counts wait for every rank's ATTN(A), while ATTN(B) runs
      notify_of(1);
      moe_of(0);
      dispatch_of(1);  // its counts wait for every rank's ATTN(B), while MOE(A) runs
      combine_of(0);
      moe_of(1);
      combine_of(1);
    } else {
      for (int m = 0; m < 2; ++m) {
        attention_of(l, m);
        notify_of(m);
        dispatch_of(m);
        moe_of(m);
        combine_of(m);
      }
    }
  }
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(r.compute));
  for (auto& g : group_) g->rank(p).check();
}

void TwoBatchPrefill::run(TwoBatchMode mode, int layers) {
  FP8MOE_CHECK(layers >= 1, "two-batch prefill: layers must be >= 1, got " << layers);
  FP8MOE_CHECK(mode != TwoBatchMode::compute_only || dispatched_,
               "two-batch prefill: compute only runs the experts on the rows of an earlier dispatch; run a mode with "
               "communication first");
  detail::DeferredChecks deferred;  // raised below, after every rank has finished
  std::mutex mu;
  std::string failure;
  std::vector<std::thread> threads;
  for (int p = 0; p < s_.ranks; ++p)
    threads.emplace_back([&, p] {
      try {
        rank_steps(p, mode, layers);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        if (failure.empty()) failure = "rank " + std::to_string(p) + ": " + e.what();
      }
    });
  for (auto& t : threads) t.join();
  FP8MOE_CHECK(failure.empty(), "two-batch prefill: " << failure);
  cuda::raise_deferred_checks();
  if (mode != TwoBatchMode::compute_only) dispatched_ = true;
}

std::vector<float> TwoBatchPrefill::residual(int rank) const {
  return download<float>(ranks_.at(size_t(rank))->x.p, size_t(s_.tokens * s_.hidden));
}

std::vector<float> TwoBatchPrefill::moe_out(int rank) const {
  return download<float>(ranks_.at(size_t(rank))->y.p, size_t(s_.tokens * s_.hidden));
}

TwoBatchLayer::MoeInput TwoBatchPrefill::moe_input(int rank, int micro) const {
  const Rank::Micro& mb = ranks_.at(size_t(rank))->mb[micro];
  return detail::moe_input_of(mb.mq, mb.idx_h, mb.w_h);
}

TwoBatchLayer::Experts TwoBatchPrefill::experts(int rank) const {
  const Rank& r = *ranks_.at(size_t(rank));
  return {r.gate->host(), r.up->host(), r.down->host()};
}

}  // namespace fp8moe::serve
