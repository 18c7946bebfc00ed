// The two-micro-batch layer steps, decode (src/serve/two_batch.hpp) and prefill
// (src/serve/two_batch_prefill.hpp): P ranks as P buffers on one GPU, 2 and 4 ranks, two layers.
// The overlapped step's residuals and MoE outputs are the sequential step's bit for bit, and the
// last layer's MoE output is the host reference's: each micro-batch's FP8 MoE input routed by the
// Comm path's reference (ep_reference.hpp; the rows each expert gets do not depend on the
// dispatch's mode), each rank's experts by the CPU backend (masked grouped GEMMs, SwiGLU,
// quantize_1x128) and the weighted sum by its moe_combine. Within rounding only: the CUDA SwiGLU's
// expf is not the CPU's std::exp in the last bits, and a flipped FP8 code of the activation moves
// its row by a rounding step. Bad input (an odd token count, micro-batches above the groups'
// max_tokens, micro-batches of partial sequences, compute alone before any dispatch) fails with
// fp8moe::Error; the shape checks run before any CUDA call, so those tests run without a GPU too.
// Run: build/tests/cuda/test_cuda_two_batch
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cuda_test_util.hpp"
#include "ep_masked_testing.hpp"
#include "fp8moe/error.hpp"
#include "parallel/runtime/ep_reference.hpp"
#include "serve/two_batch.hpp"
#include "serve/two_batch_prefill.hpp"

namespace fp8moe::testing {
namespace {

using serve::PrefillShape;
using serve::TwoBatchLayer;
using serve::TwoBatchPrefill;
using serve::TwoBatchMode;
using serve::TwoBatchShape;

// Several ranks in this process: set before the first CUDA call (ep_api.hpp).
const bool kLocalRanks = (cuda::ep::prepare_local_ranks(), true);

TwoBatchShape tiny(int ranks) {
  TwoBatchShape s;
  s.ranks = ranks;
  s.tokens = 16;
  s.hidden = 256;
  s.q_rank = 128;
  s.heads = 8;
  s.rkv = 128;
  s.rope = 32;
  s.v_head = 128;
  s.nope = 32;
  s.experts = 32;
  s.topk = 4;
  s.expert_inter = 256;
  s.context = 128;
  s.num_sms = 8;
  s.seed = 7;
  return s;
}

PrefillShape tiny_prefill(int ranks) {
  PrefillShape s;
  s.ranks = ranks;
  s.tokens = 32;
  s.seq_len = 8;  // two sequences per micro-batch
  s.hidden = 256;
  s.q_rank = 128;
  s.heads = 2;
  s.rkv = 128;
  s.rope = 32;
  s.v_head = 64;
  s.nope = 32;
  s.experts = 32;
  s.topk = 4;
  s.expert_inter = 256;
  s.num_sms = 8;
  s.seed = 7;
  return s;
}

// The host reference of micro-batch m's MoE output on every rank, [T / 2, D] each.
template <class Layer>
std::vector<std::vector<float>> reference_moe(const Layer& L, int m) {
  const auto& s = L.shape();
  const int P = s.ranks;
  const int64_t Tm = s.tokens / 2, D = s.hidden, G = D / 128, k = s.topk, El = s.experts / P, M = P * Tm, R = El * M,
                F = s.expert_inter;
  auto cpu = make_cpu_backend();
  std::vector<ep::RankTokens> src;
  for (int p = 0; p < P; ++p) {
    const TwoBatchLayer::MoeInput in = L.moe_input(p, m);
    ep::RankTokens t;
    t.tokens = Tm;
    t.idx = in.idx;
    t.w = in.w;
    t.x = in.x;
    t.scales = in.scales;
    src.push_back(std::move(t));
  }
  const auto want = ep::reference_low_latency_dispatch(src, k, El, D, G);
  std::vector<std::vector<uint16_t>> expert_rows;
  for (int d = 0; d < P; ++d) {
    const MaskedRows mr = masked_rows(want[size_t(d)], M, D);
    const QuantizedTensor& a = mr.a;
    const Tensor& cnt = mr.counts;
    const TwoBatchLayer::Experts w = L.experts(d);
    Tensor g = Tensor::host(DType::f32, {R, F}), u = Tensor::host(DType::f32, {R, F});
    Tensor act = Tensor::host(DType::f32, {R, F});
    cpu->grouped_gemm_fp8_masked(a, w.gate, cnt.view(), El, g.view(), {});
    cpu->grouped_gemm_fp8_masked(a, w.up, cnt.view(), El, u.view(), {});
    cpu->swiglu_forward(g.view(), u.view(), act.view());
    QuantizedTensor aq = make_quantized_host(R, F, DType::e4m3, ScaleKind::tile_1x128);
    cpu->quantize_1x128(act.view(), aq, ScaleMode::fp32);
    Tensor ye = Tensor::host(DType::bf16, {R, D});
    cpu->grouped_gemm_fp8_masked(aq, w.down, cnt.view(), El, ye.view(), {});
    expert_rows.emplace_back(ye.ptr<uint16_t>(), ye.ptr<uint16_t>() + R * D);
  }
  std::vector<std::vector<float>> out;
  for (int p = 0; p < P; ++p) {
    std::vector<uint16_t> back = ep::reference_low_latency_combine_rows(src, expert_rows, p, k, El, M, D);
    std::vector<int32_t> slot_row(size_t(Tm * k));
    for (size_t i = 0; i < slot_row.size(); ++i) slot_row[i] = int32_t(i);
    std::vector<float> ref(size_t(Tm * D));
    cpu->moe_combine(TensorView(back.data(), DType::bf16, {Tm * k, D}),
                     TensorView(slot_row.data(), DType::i32, {Tm, k}),
                     TensorView(src[size_t(p)].w.data(), DType::f32, {Tm, k}),
                     TensorView(ref.data(), DType::f32, {Tm, D}), false);
    out.push_back(std::move(ref));
  }
  return out;
}

// ||got - want|| / ||want|| over n values from got.
double rel_rms(const float* got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// run(mode, layers) runs the layer steps and waits for them.
template <class Layer, class Run>
void overlapped_matches_sequential_and_reference(Layer& L, Run run) {
  const auto& s = L.shape();
  const int ranks = s.ranks;
  EXPECT_THROW(run(TwoBatchMode::compute_only, 1), Error);  // no dispatched rows yet
  const int layers = 2;
  std::vector<std::vector<float>> xs, ys;
  run(TwoBatchMode::sequential, layers);
  for (int p = 0; p < ranks; ++p) xs.push_back(L.residual(p)), ys.push_back(L.moe_out(p));
  L.reset_input();
  run(TwoBatchMode::overlapped, layers);
  const int64_t Tm = s.tokens / 2, D = s.hidden;
  bool any_nonzero = false;
  for (int p = 0; p < ranks; ++p) {
    SCOPED_TRACE("rank " + std::to_string(p));
    const std::vector<float> x = L.residual(p), y = L.moe_out(p);
    EXPECT_EQ(std::memcmp(x.data(), xs[size_t(p)].data(), x.size() * 4), 0) << "residual differs from sequential";
    EXPECT_EQ(std::memcmp(y.data(), ys[size_t(p)].data(), y.size() * 4), 0) << "MoE output differs from sequential";
    for (float v : y) {
      ASSERT_TRUE(std::isfinite(v));
      any_nonzero |= v != 0.0f;
    }
  }
  EXPECT_TRUE(any_nonzero);
  for (int m = 0; m < 2; ++m) {
    const auto want = reference_moe(L, m);
    for (int p = 0; p < ranks; ++p) {
      const std::vector<float> y = L.moe_out(p);
      EXPECT_LT(rel_rms(y.data() + m * Tm * D, want[size_t(p)]), 1e-2) << "rank " << p << ", micro-batch " << m;
    }
  }
}

void decode_matches(int ranks) {
  FP8MOE_REQUIRE_SM90();
  TwoBatchLayer L(tiny(ranks));
  cudaStream_t lead;
  ASSERT_EQ(cudaStreamCreateWithFlags(&lead, cudaStreamNonBlocking), cudaSuccess);
  overlapped_matches_sequential_and_reference(L, [&](TwoBatchMode mode, int layers) {
    L.run(mode, layers, lead);
    L.check();
  });
  cudaStreamDestroy(lead);
}

void prefill_matches(int ranks) {
  FP8MOE_REQUIRE_SM90();
  TwoBatchPrefill L(tiny_prefill(ranks));
  overlapped_matches_sequential_and_reference(L, [&](TwoBatchMode mode, int layers) { L.run(mode, layers); });
}

TEST(CudaTwoBatch, TwoRanksOverlappedIsSequentialAndTheReference) { decode_matches(2); }
TEST(CudaTwoBatch, FourRanksOverlappedIsSequentialAndTheReference) { decode_matches(4); }
TEST(CudaTwoBatchPrefill, TwoRanksOverlappedIsSequentialAndTheReference) { prefill_matches(2); }
TEST(CudaTwoBatchPrefill, FourRanksOverlappedIsSequentialAndTheReference) { prefill_matches(4); }

// Checked before anything reaches the device.
TEST(CudaTwoBatch, BadShapeIsRefused) {
  auto refused = [](TwoBatchShape s, const char* what) {
    try {
      TwoBatchLayer L(s);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  TwoBatchShape odd = tiny(2);
  odd.tokens = 15;
  refused(odd, "do not split into two equal micro-batches");
  TwoBatchShape over = tiny(2);
  over.max_tokens = 4;  // micro-batches of 8
  refused(over, "exceed the groups' max_tokens 4");
  TwoBatchShape ctx = tiny(2);
  ctx.context = 100;
  refused(ctx, "context must be a positive multiple of 64");
  TwoBatchShape ex = tiny(4);
  ex.experts = 30;
  refused(ex, "experts do not split over 4 ranks");
}

TEST(CudaTwoBatchPrefill, BadShapeIsRefused) {
  auto refused = [](PrefillShape s, const char* what) {
    try {
      TwoBatchPrefill L(s);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  PrefillShape partial = tiny_prefill(2);
  partial.seq_len = 12;  // micro-batches of 16 tokens
  refused(partial, "do not split into two micro-batches of whole 12-token sequences");
  PrefillShape heads = tiny_prefill(2);
  heads.v_head = 48;
  refused(heads, "heads * v_head must be multiples of 128");
  PrefillShape rope = tiny_prefill(2);
  rope.rope = 0;
  refused(rope, "rope must be in [1, 128]");
  PrefillShape ex = tiny_prefill(4);
  ex.experts = 30;
  refused(ex, "experts do not split over 4 ranks");
}

}  // namespace
}  // namespace fp8moe::testing
