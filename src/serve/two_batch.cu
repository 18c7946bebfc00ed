// The two-micro-batch decode layer step (two_batch.hpp).
#include "serve/two_batch.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "cuda/attention/mla_decode.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/moe/moe_api.hpp"
#include "cuda/ops/model_ops.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/error.hpp"
#include "parallel/runtime/ep_reference.hpp"
#include "serve/two_batch_device.hpp"

namespace fp8moe::serve {

using cuda::ep::EpConfig;
using cuda::ep::EpGroup;

using detail::Buf;
using detail::download;
using detail::QBuf;
using detail::random_weight;
using detail::upload;

const char* mode_name(TwoBatchMode m) {
  switch (m) {
    case TwoBatchMode::overlapped: return "overlapped";
    case TwoBatchMode::sequential: return "sequential";
    case TwoBatchMode::compute_only: return "compute only";
    case TwoBatchMode::comm_only: return "communication only";
  }
  return "?";
}

// The attention weights (data-parallel attention: one copy for every rank) and the head-order
// tables of a micro-batch.
struct TwoBatchLayer::Weights {
  std::unique_ptr<QBuf> qa, qb, uv, o;
  Buf to_head, to_token, uv_counts;  // i32 [H * Tm], [Tm * H], [H]
  Buf norm;                          // f32 [D]: the RMSNorms' weights (ones)
  Weights(size_t n_head, size_t heads, size_t hidden)
      : to_head(n_head * 4), to_token(n_head * 4), uv_counts(heads * 4), norm(hidden * 4) {}
};

struct TwoBatchLayer::Rank {
  struct Micro {
    Buf cache, table, lengths;  // bf16 [Tm * context, rkv + dr], i32 [Tm, context / 64], [Tm]
    QBuf xq, caq, ohq, vtq, mq;  // x, q_a out, head-major o_lat, token-major W_UV out, MoE input
    Buf ca, q, o, oh, v, vt;     // f32
    Buf idx, w;                  // the routing, i32 / f32 [Tm, k]
    Buf rstd;                    // f32 [Tm], the RMSNorms' (not read)
    std::vector<int32_t> idx_h;
    std::vector<float> w_h;
    Micro(const TwoBatchShape& s, int64_t Tm)
        : cache(size_t(Tm * s.context * (s.rkv + s.rope)) * 2), table(size_t(Tm * (s.context / 64)) * 4),
          lengths(size_t(Tm) * 4), xq(Tm, s.hidden, ScaleKind::tile_1x128), caq(Tm, s.q_rank, ScaleKind::tile_1x128),
          ohq(s.heads * Tm, s.rkv, ScaleKind::tile_1x128), vtq(Tm, s.heads * s.v_head, ScaleKind::tile_1x128),
          mq(Tm, s.hidden, ScaleKind::tile_1x128), ca(size_t(Tm * s.q_rank) * 4),
          q(size_t(Tm * s.heads * (s.rkv + s.rope)) * 4), o(size_t(Tm * s.heads * s.rkv) * 4),
          oh(size_t(Tm * s.heads * s.rkv) * 4), v(size_t(Tm * s.heads * s.v_head) * 4),
          vt(size_t(Tm * s.heads * s.v_head) * 4), idx(size_t(Tm * s.topk) * 4), w(size_t(Tm * s.topk) * 4),
          rstd(size_t(Tm) * 4) {}
  };
  Micro mb[2];
  Buf x, y;                     // f32 [T, D]: the residual and the last MoE output
  std::vector<float> x0;        // the seed's input
  std::unique_ptr<QBuf> gate, up, down;
  // The experts' scratch on the received layout, R = E_l * M rows; the two micro-batches' MoE
  // steps are ordered (one communication stream's order), so they share it.
  Buf g, u, ye;
  QBuf aq;
  cudaStream_t compute = nullptr;
  cudaEvent_t attn_done[2] = {}, comm_done[2] = {};
  Rank(const TwoBatchShape& s, int64_t Tm, int64_t R)
      : mb{Micro(s, Tm), Micro(s, Tm)}, x(size_t(2 * Tm * s.hidden) * 4), y(size_t(2 * Tm * s.hidden) * 4),
        g(size_t(R * s.expert_inter) * 4), u(size_t(R * s.expert_inter) * 4), ye(size_t(R * s.hidden) * 2),
        aq(R, s.expert_inter, ScaleKind::tile_1x128) {
    FP8MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    for (auto* e : {&attn_done[0], &attn_done[1], &comm_done[0], &comm_done[1]})
      FP8MOE_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  ~Rank() {
    for (auto e : {attn_done[0], attn_done[1], comm_done[0], comm_done[1]}) cudaEventDestroy(e);
    cudaStreamDestroy(compute);
  }
};

TwoBatchLayer::TwoBatchLayer(const TwoBatchShape& shape) : s_(shape) {
  const TwoBatchShape& s = s_;
  FP8MOE_CHECK(s.ranks >= 1 && s.ranks <= cuda::ep::kMaxRanks,
               "two-batch layer: ranks must be in [1, " << cuda::ep::kMaxRanks << "], got " << s.ranks);
  FP8MOE_CHECK(s.tokens >= 2 && s.tokens % 2 == 0,
               "two-batch layer: " << s.tokens << " tokens per rank do not split into two equal micro-batches");
  const int64_t Tm = s.tokens / 2, N = s.max_tokens > 0 ? s.max_tokens : Tm;
  FP8MOE_CHECK(Tm <= N, "two-batch layer: micro-batches of " << Tm << " tokens exceed the groups' max_tokens " << N);
  FP8MOE_CHECK(s.context > 0 && s.context % 64 == 0,
               "two-batch layer: context must be a positive multiple of 64, got " << s.context);
  FP8MOE_CHECK(s.expert_inter % 128 == 0 && s.q_rank % 128 == 0 && s.rkv % 128 == 0 && s.v_head % 128 == 0,
               "two-batch layer: expert_inter, q_rank, rkv and v_head must be multiples of 128");
  FP8MOE_CHECK(s.experts % s.ranks == 0, "two-batch layer: " << s.experts << " experts do not split over "
                                                             << s.ranks << " ranks");
  EpConfig cfg;
  cfg.ranks = s.ranks;
  cfg.max_tokens = N;
  cfg.hidden = s.hidden;
  cfg.topk = s.topk;
  cfg.experts = s.experts;
  cfg.num_sms = s.num_sms;
  cfg.low_latency = true;
  for (auto& g : group_) g = EpGroup::local(cfg);
  const int64_t H = s.heads, W = s.rkv + s.rope, El = s.experts / s.ranks, M = s.ranks * N, R = El * M;
  w_ = std::make_unique<Weights>(size_t(H * Tm), size_t(H), size_t(s.hidden));
  upload(w_->norm, std::vector<float>(size_t(s.hidden), 1.0f));
  w_->qa = random_weight(s.q_rank, s.hidden, s.seed + 1);
  w_->qb = random_weight(H * W, s.q_rank, s.seed + 2);
  w_->uv = random_weight(H * s.v_head, s.rkv, s.seed + 3);
  w_->o = random_weight(s.hidden, H * s.v_head, s.seed + 4);
  std::vector<int32_t> to_head(size_t(H * Tm)), to_token(size_t(H * Tm));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < Tm; ++t) {
      to_head[size_t(h * Tm + t)] = int32_t(t * H + h);
      to_token[size_t(t * H + h)] = int32_t(h * Tm + t);
    }
  upload(w_->to_head, to_head);
  upload(w_->to_token, to_token);
  upload(w_->uv_counts, std::vector<int32_t>(size_t(H), int32_t(Tm)));
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int p = 0; p < s.ranks; ++p) {
    auto r = std::make_unique<Rank>(s, Tm, R);
    const uint64_t rs = s.seed * 7919 + uint64_t(p) * 101;
    r->gate = random_weight(El * s.expert_inter, s.hidden, rs + 11);
    r->up = random_weight(El * s.expert_inter, s.hidden, rs + 12);
    r->down = random_weight(El * s.hidden, s.expert_inter, rs + 13);
    r->x0.resize(size_t(2 * Tm * s.hidden));
    for (auto& v : r->x0) v = normal(rng);
    for (int m = 0; m < 2; ++m) {
      Rank::Micro& mb = r->mb[m];
      cuda::fill_normal_bf16(mb.cache.p, Tm * s.context * W, rs + 21 + uint64_t(m), 1.0f);
      const int64_t blocks = s.context / 64;
      std::vector<int32_t> table(size_t(Tm * blocks));
      for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
      upload(mb.table, table);
      upload(mb.lengths, std::vector<int32_t>(size_t(Tm), int32_t(s.context)));
      ep::route_uniformly(rng, Tm, s.topk, s.experts, mb.idx_h, mb.w_h);
      upload(mb.idx, mb.idx_h);
      upload(mb.w, mb.w_h);
    }
    ranks_.push_back(std::move(r));
  }
  reset_input();
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

TwoBatchLayer::~TwoBatchLayer() { cudaDeviceSynchronize(); }

void TwoBatchLayer::reset_input() {
  for (auto& r : ranks_) {
    upload(r->x, r->x0);
    FP8MOE_CUDA_CHECK(cudaMemset(r->y.p, 0, r->y.bytes));
  }
  // The copies and memsets run on the legacy stream, which the ranks' non-blocking streams do not
  // wait for; a pageable copy may also return before its data has landed.
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

// x_m += y_m (the previous layer's MoE output; zero before the first), then the attention stand-in
// (two_batch.hpp), then the MoE input: RMSNorm(x_m) quantized with power-of-two scales.
void TwoBatchLayer::attention(int p, int m, cudaStream_t st) {
  const TwoBatchShape& s = s_;
  Rank& r = *ranks_[size_t(p)];
  Rank::Micro& mb = r.mb[m];
  const int64_t Tm = s.tokens / 2, H = s.heads, W = s.rkv + s.rope, D = s.hidden;
  const TensorView x = r.x.view(DType::f32, Tm, D, m * Tm), y = r.y.view(DType::f32, Tm, D, m * Tm);
  cuda::cuda_axpy(1.0, y, 1.0, x, st);
  const TensorView norm(w_->norm.p, DType::f32, {D}, Device::cuda), rstd(mb.rstd.p, DType::f32, {Tm}, Device::cuda);
  cuda::cuda_rmsnorm_forward_fp8(x, norm, mb.xq.view(), rstd, 1e-6, ScaleMode::pow2, st);
  cuda::gemm_fp8_sm90(mb.xq.view(), w_->qa->view(), mb.ca.view(DType::f32, Tm, s.q_rank), false, st);
  cuda::quantize_1x128_cuda(mb.ca.view(DType::f32, Tm, s.q_rank), mb.caq.view(), ScaleMode::pow2, st, false);
  cuda::gemm_fp8_sm90(mb.caq.view(), w_->qb->view(), mb.q.view(DType::f32, Tm, H * W), false, st);
  MlaCacheView cache;
  cache.rows = mb.cache.view(DType::bf16, Tm * s.context, W);
  cuda::mla_decode_attention_cuda(mb.q.view(DType::f32, Tm * H, W), cache,
                                  mb.table.view(DType::i32, Tm, s.context / 64),
                                  TensorView(mb.lengths.p, DType::i32, {Tm}, Device::cuda),
                                  1.0 / std::sqrt(double(s.nope + s.rope)), mb.o.view(DType::f32, Tm * H, s.rkv), st);
  cuda::cuda_gather_rows(mb.o.view(DType::f32, Tm * H, s.rkv),
                         TensorView(w_->to_head.p, DType::i32, {H * Tm}, Device::cuda), TensorView(),
                         mb.oh.view(DType::f32, H * Tm, s.rkv), st);
  cuda::quantize_1x128_cuda(mb.oh.view(DType::f32, H * Tm, s.rkv), mb.ohq.view(), ScaleMode::pow2, st, false);
  cuda::grouped_gemm_fp8_masked_cuda(mb.ohq.view(), w_->uv->view(),
                                     TensorView(w_->uv_counts.p, DType::i32, {H}, Device::cuda), H,
                                     mb.v.view(DType::f32, H * Tm, s.v_head), false, st);
  cuda::cuda_gather_rows(mb.v.view(DType::f32, H * Tm, s.v_head),
                         TensorView(w_->to_token.p, DType::i32, {Tm * H}, Device::cuda), TensorView(),
                         mb.vt.view(DType::f32, Tm * H, s.v_head), st);
  cuda::quantize_1x128_cuda(mb.vt.view(DType::f32, Tm, H * s.v_head), mb.vtq.view(), ScaleMode::pow2, st, false);
  cuda::gemm_fp8_sm90(mb.vtq.view(), w_->o->view(), x, true, st);
  cuda::cuda_rmsnorm_forward_fp8(x, norm, mb.mq.view(), rstd, 1e-6, ScaleMode::pow2, st);
}

// Rank p's experts on micro-batch m's received rows: gate and up, SwiGLU + e4m3 on the rows below
// the counts, down to bf16 (the combine's rows).
void TwoBatchLayer::experts_step(int p, int m, cudaStream_t st) {
  const TwoBatchShape& s = s_;
  Rank& r = *ranks_[size_t(p)];
  const auto rv = group_[m]->rank(p).low_latency_received();
  const int64_t El = s.experts / s.ranks, R = rv.x.rows(), F = s.expert_inter;
  cuda::grouped_gemm_fp8_masked_cuda(rv.x, r.gate->view(), rv.counts, El, r.g.view(DType::f32, R, F), false, st);
  cuda::grouped_gemm_fp8_masked_cuda(rv.x, r.up->view(), rv.counts, El, r.u.view(DType::f32, R, F), false, st);
  detail::swiglu_quantize_rows(static_cast<const float*>(r.g.p), static_cast<const float*>(r.u.p), R, F,
                               rv.counts.ptr<const int32_t>(), rv.rows_per_expert, nullptr,
                               static_cast<uint8_t*>(r.aq.values.p), static_cast<float*>(r.aq.scales.p), st);
  cuda::grouped_gemm_fp8_masked_cuda(r.aq.view(), r.down->view(), rv.counts, El, r.ye.view(DType::bf16, R, s.hidden),
                                     false, st);
}

void TwoBatchLayer::run(TwoBatchMode mode, int layers, cudaStream_t lead) {
  FP8MOE_CHECK(layers >= 1, "two-batch layer: layers must be >= 1, got " << layers);
  const TwoBatchShape& s = s_;
  const int64_t Tm = s.tokens / 2, D = s.hidden, k = s.topk;
  const bool attn = mode != TwoBatchMode::comm_only, comm = mode != TwoBatchMode::compute_only;
  const bool moe = mode != TwoBatchMode::comm_only;
  FP8MOE_CHECK(comm || dispatched_, "two-batch layer: compute only runs the experts on the rows of an earlier "
                                    "dispatch; run a mode with communication first");
  detail::DeferredChecks deferred;
  cudaEvent_t start;
  FP8MOE_CUDA_CHECK(cudaEventCreateWithFlags(&start, cudaEventDisableTiming));
  FP8MOE_CUDA_CHECK(cudaEventRecord(start, lead));
  for (int p = 0; p < s.ranks; ++p) {
    Rank& r = *ranks_[size_t(p)];
    FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(r.compute, start));
    for (auto& g : group_) FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(g->rank(p).stream(), start));
  }
  // Overlapped: attention on the rank's compute stream, the rest on micro-batch m's group stream.
  // Otherwise one chain per rank: each step waits for the one before it, whatever its stream.
  const bool overlap = mode == TwoBatchMode::overlapped;
  for (int l = 0; l < layers; ++l)
    for (int p = 0; p < s.ranks; ++p) {
      Rank& r = *ranks_[size_t(p)];
      for (int m = 0; m < 2; ++m) {
        cudaStream_t cs = group_[m]->rank(p).stream();
        cudaStream_t as = overlap ? r.compute : cs;
        // Attention waits for this micro-batch's previous layer (its y, its MoE input read) and, in
        // a chain, for the other micro-batch's last step.
        const bool after_other = l > 0 || m == 1;
        if (overlap ? l > 0 : after_other) FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(as, r.comm_done[overlap ? m : 1 - m]));
        if (attn) attention(p, m, as);
        FP8MOE_CUDA_CHECK(cudaEventRecord(r.attn_done[m], as));
        // The communication stream's order: after this micro-batch's attention and the other's
        // combine (which also frees the experts' shared scratch).
        FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(cs, r.attn_done[m]));
        if (after_other) FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(cs, r.comm_done[1 - m]));
        Rank::Micro& mb = r.mb[m];
        cuda::ep::EpRank& ep = group_[m]->rank(p);
        if (comm) ep.low_latency_dispatch(mb.mq.view(), mb.idx.view(DType::i32, Tm, k));
        if (moe) experts_step(p, m, cs);
        if (comm)
          ep.low_latency_combine(r.ye.view(DType::bf16, r.aq.rows, D), mb.w.view(DType::f32, Tm, k),
                                 r.y.view(DType::f32, Tm, D, m * Tm), false);
        FP8MOE_CUDA_CHECK(cudaEventRecord(r.comm_done[m], cs));
      }
    }
  if (comm) dispatched_ = true;
  for (int p = 0; p < s.ranks; ++p) FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(lead, ranks_[size_t(p)]->comm_done[1]));
  FP8MOE_CUDA_CHECK(cudaEventDestroy(start));
}

void TwoBatchLayer::check() {
  cuda::raise_deferred_checks();  // synchronizes the device
  for (auto& g : group_)
    for (int p = 0; p < g->size(); ++p) g->rank(p).check();
}

std::vector<float> TwoBatchLayer::residual(int rank) const {
  return download<float>(ranks_.at(size_t(rank))->x.p, size_t(s_.tokens * s_.hidden));
}

std::vector<float> TwoBatchLayer::moe_out(int rank) const {
  return download<float>(ranks_.at(size_t(rank))->y.p, size_t(s_.tokens * s_.hidden));
}

TwoBatchLayer::MoeInput TwoBatchLayer::moe_input(int rank, int micro) const {
  const Rank::Micro& mb = ranks_.at(size_t(rank))->mb[micro];
  return detail::moe_input_of(mb.mq, mb.idx_h, mb.w_h);
}

TwoBatchLayer::Experts TwoBatchLayer::experts(int rank) const {
  const Rank& r = *ranks_.at(size_t(rank));
  return {r.gate->host(), r.up->host(), r.down->host()};
}

}  // namespace fp8moe::serve
