// Two-micro-batch overlap of a prefill MoE layer step (DeepSeek-V3 §3.4.1): P expert-parallel ranks
// of EpGroup::local on one GPU, each rank's tokens split into two micro-batches A and B of equal
// size, so that one micro-batch's attention and MoE hide the other's dispatch and combine:
//   compute        ATTN(A)  ATTN(B)      MOE(A)       MOE(B)       ATTN(A)' ...
//   communication           DISPATCH(A)  DISPATCH(B)  COMBINE(A)   COMBINE(B) ...
// The all-to-alls are the normal mode (prefill-sized, no per-expert worst case), one EpGroup per
// micro-batch so that A's received rows stay valid while B dispatches. Its notify's counts are read
// on the host (EpRank::counts()), which waits for every rank's notify: each rank's work is
// launched by a host thread of its own, as one process per GPU would, so that the wait holds only
// that rank's launches, and each rank launches in the order above so that the GPU has queued work
// through every wait (ATTN(B) during A's counts, MOE(A) during B's).
//
// The layer, on real work of DeepSeek-V3's shapes (weights, routing drawn from a seed):
//   attention  x [T, D] f32 -> RMSNorm, e4m3 (1x128) -> q_a [T, q_rank] -> e4m3 -> q_b
//              [T, H * (nope + rope)]; x -> kv_a [T, rkv] (the latent) and [T, rope] (the shared
//              key part, a 128-column projection of which 64 are used) -> latent e4m3 -> kv_b
//              [T, H * (nope + v_head)] -> K [T, H, nope + rope], V [T, H, v_head] -> causal attention
//              (BF16 operands, FP32 accumulation) within sequences of seq_len tokens -> [T, H * v]
//              -> e4m3 -> x += o_proj. (No rotary rotation: it does not change the work.)
//   MoE        x -> RMSNorm, e4m3 -> notify, counts, dispatch with the fixed routing -> on each
//              rank, its local experts on the received rows in the contiguous layout (moe_layout
//              of the received ids; the rows gathered as they arrived, FP8): gate and up, SwiGLU,
//              e4m3, down (bf16) -> the rows in the combine's order (source-major, slots ascending)
//              -> combine -> y [T, D] f32 -> x += y before the next layer's attention.
// Every kernel's result depends only on its inputs, so the overlapped and sequential steps give
// the same bits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "serve/two_batch.hpp"

namespace fp8moe::serve {

struct PrefillShape {
  int ranks = 2;
  int64_t tokens = 4096;    // per rank and step, split into two micro-batches of tokens / 2
  int64_t seq_len = 1024;   // tokens of each sequence; a micro-batch holds whole sequences
  int64_t hidden = 7168;    // D
  int64_t q_rank = 1536;    // q_lora_rank
  int64_t heads = 128;      // H
  int64_t rkv = 512, rope = 64, v_head = 128, nope = 128;
  int64_t experts = 256, topk = 8, expert_inter = 2048;
  int num_sms = 24;         // blocks of each communication kernel per rank (EpConfig::num_sms)
  uint64_t seed = 1;
};

class TwoBatchPrefill {
 public:
  // Checks the shape (fp8moe::Error: micro-batches that do not hold whole sequences, sizes the
  // kernels refuse), allocates and fills weights, inputs and routing on the current device.
  explicit TwoBatchPrefill(const PrefillShape& shape);
  ~TwoBatchPrefill();
  TwoBatchPrefill(const TwoBatchPrefill&) = delete;
  TwoBatchPrefill& operator=(const TwoBatchPrefill&) = delete;

  const PrefillShape& shape() const { return s_; }
  void reset_input();
  // Runs `layers` layer steps in `mode` (two_batch.hpp's modes) for every rank, one host thread
  // per rank, and returns when the device has finished them; throws fp8moe::Error if a step failed
  // on a rank (a timed-out wait, a bad index), naming it.
  void run(TwoBatchMode mode, int layers);

  // Host copies (as TwoBatchLayer's). Rank p's tokens are A's [0, T / 2) then B's.
  std::vector<float> residual(int rank) const;
  std::vector<float> moe_out(int rank) const;
  TwoBatchLayer::MoeInput moe_input(int rank, int micro) const;
  TwoBatchLayer::Experts experts(int rank) const;

 private:
  struct Rank;
  struct Weights;
  void attention(int p, int m, cudaStream_t st);
  void experts_step(int p, int m, int64_t received, cudaStream_t st);
  void rank_steps(int p, TwoBatchMode mode, int layers);
  PrefillShape s_;
  std::unique_ptr<cuda::ep::EpGroup> group_[2];
  std::unique_ptr<Weights> w_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  bool dispatched_ = false;
};

}  // namespace fp8moe::serve
