// The two-micro-batch decode layer step (two_batch.hpp).
#include "serve/two_batch.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "cuda/attention/mla_decode.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/moe/moe_api.hpp"
#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/swiglu_device.cuh"
#include "cuda/quant/quantize_device.cuh"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_checks.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe::serve {

using cuda::ep::EpConfig;
using cuda::ep::EpGroup;

namespace {

constexpr float kE4m3Max = 448.0f;

// a = SwiGLU(g, u) quantized to e4m3 with 1x128 fp32 scales (quantize_1x128's rounding) for the
// rows of the masked layout below each group's count only: the received layout has room for every
// source's tokens per expert (M = P * N rows) and holds a small share of that, which a dense pass
// over all rows would read and write. One warp per (row, 128-column tile), four columns a lane.
__global__ void masked_swiglu_quantize_kernel(const float* __restrict__ g, const float* __restrict__ u,
                                              const int32_t* __restrict__ counts, int64_t rows_per_group,
                                              int64_t groups, int64_t F, uint8_t* __restrict__ q,
                                              float* __restrict__ s, int64_t ld) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x % 32);
  const int64_t tiles = F / 128, row = warp / tiles, tile = warp % tiles;
  if (row >= groups * rows_per_group || row % rows_per_group >= counts[row / rows_per_group]) return;  // whole warps
  const int64_t c0 = row * F + tile * 128 + lane * 4;
  const float4 gv = *reinterpret_cast<const float4*>(g + c0), uv = *reinterpret_cast<const float4*>(u + c0);
  const float a[4] = {cuda::swiglu_value(gv.x, uv.x), cuda::swiglu_value(gv.y, uv.y), cuda::swiglu_value(gv.z, uv.z),
                      cuda::swiglu_value(gv.w, uv.w)};
  float amax = 0.0f;
  for (float v : a) amax = cuda::amax_nan(amax, v);
  amax = cuda::lanes_amax<32>(amax);
  const float sc = cuda::scale_of(amax, kE4m3Max, false);
  *reinterpret_cast<uint32_t*>(q + c0) = cuda::quantize4<false>(a, cuda::inv_scale(sc));
  if (lane == 0) s[tile * ld + row] = sc;
}

struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t n) : bytes(n) {
    FP8MOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16)));
    FP8MOE_CUDA_CHECK(cudaMemset(p, 0, std::max<size_t>(n, 16)));
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  TensorView view(DType t, int64_t r, int64_t c, int64_t row0 = 0) const {
    return TensorView(static_cast<char*>(p) + row0 * c * int64_t(dtype_size(t)), t, {r, c}, Device::cuda);
  }
};

// An FP8 tensor on the device, e4m3 values with `kind` scales.
struct QBuf {
  int64_t rows, cols;
  ScaleKind kind;
  Buf values, scales;
  QBuf(int64_t r, int64_t c, ScaleKind k)
      : rows(r), cols(c), kind(k), values(size_t(r * c)),
        scales(size_t(scale_shape(k, r, c)[0] * scale_shape(k, r, c)[1]) * 4) {}
  QuantizedView view() const {
    const auto ss = scale_shape(kind, rows, cols);
    return {values.view(DType::e4m3, rows, cols), scales.view(DType::f32, ss[0], ss[1]), kind};
  }
  // Rows [r0, r0 + n) of a 128x128-scaled tensor (r0, n multiples of 128).
  QuantizedView block_rows(int64_t r0, int64_t n) const {
    const int64_t sc = scale_shape(kind, rows, cols)[1];
    return {values.view(DType::e4m3, n, cols, r0), scales.view(DType::f32, n / 128, sc, r0 / 128), kind};
  }
  QuantizedTensor host() const {
    QuantizedTensor h = make_quantized_host(rows, cols, DType::e4m3, kind);
    FP8MOE_CUDA_CHECK(cudaMemcpy(h.values.ptr<uint8_t>(), values.p, size_t(rows * cols), cudaMemcpyDeviceToHost));
    FP8MOE_CUDA_CHECK(
        cudaMemcpy(h.scales.ptr<float>(), scales.p, size_t(h.scales.numel()) * 4, cudaMemcpyDeviceToHost));
    return h;
  }
};

// A [rows, cols] weight of N(0, 1 / cols) draws quantized 128x128, in slices through one bf16
// temporary.
std::unique_ptr<QBuf> random_weight(int64_t rows, int64_t cols, uint64_t seed) {
  auto w = std::make_unique<QBuf>(rows, cols, ScaleKind::block_128x128);
  const int64_t step = std::max<int64_t>(128, ((int64_t(64) << 20) / (cols * 2)) / 128 * 128);
  Buf tmp(size_t(std::min(step, rows) * cols) * 2);
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    const int64_t n = std::min(step, rows - r0);
    cuda::fill_normal_bf16(tmp.p, n * cols, seed * 1000003 + uint64_t(r0), float(1.0 / std::sqrt(double(cols))));
    cuda::quantize_128x128_cuda(tmp.view(DType::bf16, n, cols), w->block_rows(r0, n), ScaleMode::fp32, nullptr, false);
  }
  return w;
}

template <class T>
void upload(const Buf& b, const std::vector<T>& h) {
  FP8MOE_CUDA_CHECK(cudaMemcpy(b.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <class T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> h(n);
  FP8MOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace

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
  std::uniform_int_distribution<int32_t> pick(0, int32_t(s.experts) - 1);
  std::uniform_real_distribution<float> weight(0.01f, 1.0f);
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
      // Each token's k distinct experts drawn uniformly.
      for (int64_t t = 0; t < Tm; ++t)
        for (int64_t j = 0; j < s.topk; ++j) {
          int32_t e;
          do e = pick(rng);
          while (std::find(mb.idx_h.end() - j, mb.idx_h.end(), e) != mb.idx_h.end());
          mb.idx_h.push_back(e);
          mb.w_h.push_back(weight(rng));
        }
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
  const int64_t warps = R * (F / 128);
  masked_swiglu_quantize_kernel<<<unsigned((warps * 32 + 255) / 256), 256, 0, st>>>(
      static_cast<const float*>(r.g.p), static_cast<const float*>(r.u.p), rv.counts.ptr<const int32_t>(),
      rv.rows_per_expert, El, F, static_cast<uint8_t*>(r.aq.values.p), static_cast<float*>(r.aq.scales.p),
      scale_ld(R));
  FP8MOE_CUDA_CHECK_LAUNCH("masked_swiglu_quantize_kernel");
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
  // The gathers' index checks and the norms' NaN/Inf checks recorded on the device (read by
  // check()) instead of one host synchronization each, which would hold every later launch of
  // every rank behind that stream.
  struct Deferred {
    bool was = cuda::checks_deferred();
    Deferred() { cuda::set_checks_deferred(true); }
    ~Deferred() { cuda::set_checks_deferred(was); }
  } deferred;
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
  const int64_t Tm = s_.tokens / 2, D = s_.hidden, G = D / 128, ld = scale_ld(Tm);
  MoeInput in;
  in.x = download<uint8_t>(mb.mq.values.p, size_t(Tm * D));
  const std::vector<float> sc = download<float>(mb.mq.scales.p, size_t(G * ld));
  in.scales.resize(size_t(Tm * G));
  for (int64_t t = 0; t < Tm; ++t)
    for (int64_t g = 0; g < G; ++g) in.scales[size_t(t * G + g)] = sc[size_t(g * ld + t)];
  in.idx = mb.idx_h;
  in.w = mb.w_h;
  return in;
}

TwoBatchLayer::Experts TwoBatchLayer::experts(int rank) const {
  const Rank& r = *ranks_.at(size_t(rank));
  return {r.gate->host(), r.up->host(), r.down->host()};
}

}  // namespace fp8moe::serve
