// Two-micro-batch overlap of a decode MoE layer step (DeepSeek-V3 §3.4.2; SGLang's "two-batch
// overlap" is the public form): P expert-parallel ranks of EpGroup::local on one GPU, each rank's
// batch split into two micro-batches A and B of equal size, each rank with a compute stream and a
// communication stream ordered by events, so that one micro-batch's all-to-all and experts run
// while the other's attention does:
//   compute        ATTN(A)  ATTN(B)                  ATTN(A)' ...   (' : the next layer)
//   communication           DISPATCH(A) MOE(A) COMBINE(A)  DISPATCH(B) MOE(B) COMBINE(B) ...
// ATTN(m) of a layer waits for m's COMBINE of the layer before; DISPATCH(m) for ATTN(m) and for
// the other micro-batch's COMBINE (one communication stream's order). The all-to-alls are the
// low-latency mode (no host read of counts), one EpGroup per micro-batch: each micro-batch's
// received rows stay valid until its own next dispatch, not the other's, whatever runs between.
// Only the decode form is here: the normal mode's host read of counts (EpRank::counts()) blocks
// the one host thread that launches every rank's work on this GPU until the micro-batch's notify
// has run on all ranks, i.e. until its attention has; every launch behind it, the other
// micro-batch's included, waits with it.
//
// The layer, on real work of DeepSeek-V3's shapes (weights, cache and routing drawn from a seed):
//   attention  x [T, D] f32 -> RMSNorm, e4m3 (1x128) -> q_a [T, q_rank] -> e4m3 -> q_b
//              [T, H * (rkv + dr)] (W_UK absorbed) -> mla_decode_attention over a bf16 latent
//              cache (T sequences of `context` tokens) -> o_lat [T * H, rkv] -> head-major -> e4m3
//              -> W_UV as a masked grouped GEMM over the H heads -> [H * T, dv] -> token-major ->
//              e4m3 -> x += o_proj.
//   MoE        x -> RMSNorm, e4m3 -> low_latency_dispatch with the fixed routing -> on each rank,
//              its local experts on the received masked layout: gate and up (masked grouped
//              GEMMs, f32), SwiGLU, e4m3, down (bf16) -> low_latency_combine -> y [T, D] f32 (the
//              weighted sum) -> x += y before the next layer's attention.
// Every kernel's result depends only on its inputs, never on what runs beside it, so the overlapped
// and sequential steps give the same bits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/ep/ep_api.hpp"
#include "fp8moe/quantize.hpp"

namespace fp8moe::serve {

struct TwoBatchShape {
  int ranks = 2;
  int64_t tokens = 128;      // per rank and step, split into two micro-batches of tokens / 2
  int64_t max_tokens = 0;    // the groups' EpConfig::max_tokens per micro-batch; 0: tokens / 2
  int64_t hidden = 7168;     // D
  int64_t q_rank = 1536;     // q_lora_rank
  int64_t heads = 128;       // H
  int64_t rkv = 512, rope = 64, v_head = 128;  // kv_lora_rank, qk_rope_head_dim, v_head_dim
  int64_t nope = 128;        // qk_nope_head_dim (the softmax scale's 1 / sqrt(nope + rope))
  int64_t experts = 256, topk = 8, expert_inter = 2048;
  int64_t context = 1024;    // cached tokens of each sequence, a multiple of 64
  int num_sms = 24;          // blocks of each communication kernel per rank (EpConfig::num_sms)
  uint64_t seed = 1;
};

enum class TwoBatchMode {
  overlapped,    // the two streams per rank as above
  sequential,    // one chain per rank: ATTN(A) DISPATCH(A) MOE(A) COMBINE(A) ATTN(B) ... (no overlap)
  compute_only,  // sequential without the dispatches and combines (experts on the last received rows)
  comm_only,     // sequential dispatches and combines alone
};
const char* mode_name(TwoBatchMode m);

class TwoBatchLayer {
 public:
  // Checks the shape (fp8moe::Error: an odd token count, micro-batches above max_tokens, sizes the
  // kernels refuse), allocates and fills weights, caches, inputs and routing on the current device.
  explicit TwoBatchLayer(const TwoBatchShape& shape);
  ~TwoBatchLayer();
  TwoBatchLayer(const TwoBatchLayer&) = delete;
  TwoBatchLayer& operator=(const TwoBatchLayer&) = delete;

  const TwoBatchShape& shape() const { return s_; }
  // Resets every rank's x to the seed's input.
  void reset_input();
  // Queues `layers` layer steps in `mode` for every rank after the work queued on `lead` so far,
  // and makes `lead` wait for all of it, with no host synchronization; check() after.
  void run(TwoBatchMode mode, int layers, cudaStream_t lead);
  // Waits for every stream; throws fp8moe::Error if a communication step failed on the device.
  void check();

  // Host copies, after check(). Rank p's tokens are A's [0, T / 2) then B's.
  std::vector<float> residual(int rank) const;  // x [T, D] f32
  std::vector<float> moe_out(int rank) const;   // y [T, D] f32 of the last layer
  // The last layer's MoE input of (rank, micro-batch): the dispatch's FP8 rows [T / 2, D] and their
  // scales token-major [T / 2, D / 128], and the routing (ids, weights [T / 2, k]).
  struct MoeInput {
    std::vector<uint8_t> x;
    std::vector<float> scales;
    std::vector<int32_t> idx;
    std::vector<float> w;
  };
  MoeInput moe_input(int rank, int micro) const;
  // Rank p's expert weights on the host: gate, up [E_l * F, D], down [E_l * D, F] (128x128 scales).
  struct Experts {
    QuantizedTensor gate, up, down;
  };
  Experts experts(int rank) const;

 private:
  struct Rank;
  struct Weights;
  void attention(int p, int m, cudaStream_t st);
  void experts_step(int p, int m, cudaStream_t st);
  TwoBatchShape s_;
  std::unique_ptr<cuda::ep::EpGroup> group_[2];
  std::unique_ptr<Weights> w_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  bool dispatched_ = false;  // a step with communication has run (compute_only needs its rows)
};

}  // namespace fp8moe::serve
