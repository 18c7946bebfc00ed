// The inference path of DeepSeek-V3-mini on the Backend interface: no training state, a paged
// latent cache (latent_cache.hpp), and per step any mix of prefill chunks and decode tokens.
//   prefill  the compute-friendly MLA form: the latents of the sequence so far (cache prefix and
//            this chunk) are expanded by kv_b_proj into per-head keys and values, then causal
//            attention of the chunk's queries (Backend::attention_forward).
//   decode   the absorbed form (DeepSeek-V2 §2.1.2 appendix, vLLM/SGLang/FlashMLA): the key
//            up-projection W_UK is folded into the query (q_lat_h = q_nope_h W_UK_h, [rkv] per
//            head) and the scores are taken against the cached latents directly; the value
//            up-projection W_UV is applied to the attention-weighted latent afterwards. One
//            decode token reads rkv + dr values per cached token and layer, not H (dn + dv + dr).
// Linears run in the weights' precision: FP32, BF16 (BF16 operands, FP32 accumulation) or the
// FP8 recipe (1x128 E4M3 activation tiles x 128x128 weight blocks through Backend::gemm_fp8, M as
// small as 1; the routed experts through Backend::grouped_gemm_fp8_masked with power-of-two
// scales before dispatch); the embedding, router, norms and attention in FP32, the head in BF16
// where the recipe has it. The shared expert may run as one more routed expert that every token
// picks (report §3.4.2: in decode 9 experts per token).
//   serve::Engine eng(serve::load_checkpoint_weights(path), *be, {});
//   std::vector<int32_t> table; alloc.allocate(blocks_for(n), table);
//   Tensor logits = eng.step({{&table, 0, prompt}});   // [1, V] f32, host
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/model_recipe.hpp"
#include "fp8moe/placement.hpp"
#include "serve/latent_cache.hpp"
#include "serve/weights.hpp"

namespace fp8moe::serve {

// The largest step EngineOptions::batch_invariant holds its promise for: the FP8 GEMM's few-row
// kernel serves 1..8 rows with one K split.
constexpr int64_t kBatchInvariantRows = 8;

struct EngineOptions {
  std::string linear = "auto";     // "f32" | "bf16" | "fp8" | "auto": the weights' recipe or format
  CacheDType cache = CacheDType::bf16;
  int64_t cache_blocks = 256;      // blocks of 64 tokens in the pool
  bool absorbed_decode = true;     // false: decode tokens through the prefill (expanded) form
  bool shared_as_routed = false;   // the shared expert as routed expert E that every token picks
  bool mtp = false;                // load the MTP module (mtp_step: speculative decoding's drafts)
  // Batch invariance: in a step of at most kBatchInvariantRows rows, every decode row's logits are
  // the bits it would get alone, whatever shares the step (other sequences, prefill chunks, the
  // other rows of a verified draft). The decode attention splits each sequence's context by its
  // own length (MlaDecodeSplits::by_length, those it gets alone), and the f32 and bf16 GEMMs (the
  // Linears, the router, the head, the absorption) run through Backend::gemm_batch_invariant; the
  // FP8 GEMMs are so up to kBatchInvariantRows (one kernel, one K split, for 1..8 rows), the
  // masked expert GEMM up to 64 tokens per expert (one layout). Speculative decoding needs it.
  // Off by default: at large batches by_length runs more splits than a wave needs.
  bool batch_invariant = false;
  // Decode steps as CUDA graphs where the backend can capture them: a step of single-token decode
  // rows with the FP8 experts' layouts on the device (no redundant experts, the shared expert not
  // routed) is recorded the second time its batch and table width come in a row and replayed
  // while they stay, bit for bit the eager step; other steps run as they come.
  bool graphs = true;
  // Redundant experts (report §3.4, fp8moe/placement.hpp) on virtual GPUs: expert_slots > 0 holds
  // that many copies of the routed experts over expert_gpus GPUs of expert_nodes nodes, each
  // token's choice going to one copy of its expert; every rebalance_every steps (0: never) the
  // placement is recomputed from the loads routed so far, which are then scaled by load_decay (0:
  // the next placement sees only the tokens after this one; a few steps' tokens are too few to
  // place by, so by default the history counts half at each rebalance). The virtual GPUs' token
  // counts are kept either way (without redundancy: expert e on GPU e * gpus / experts).
  int64_t expert_slots = 0;
  int64_t expert_nodes = 1, expert_gpus = 1;
  int64_t rebalance_every = 0;
  double load_decay = 0.5;
};

// Tokens of one sequence to run in a step: positions [start, start + tokens.size()), whose
// latents the step writes into the blocks of `table` (which must cover start + tokens.size()).
struct SeqChunk {
  const std::vector<int32_t>* table = nullptr;
  int64_t start = 0;
  std::vector<int32_t> tokens;
  int64_t logits_rows = 1;  // logits of the last logits_rows tokens (verification of drafts: > 1)
  // Every token a decode row (the absorbed form): token i attends to positions [0, start + i]
  // of the cache as this step writes it, exactly as if the tokens were decoded one per step
  // (the verification of drafts; bit for bit with EngineOptions::batch_invariant). Without it a
  // chunk of several tokens runs the prefill form; a single token is a decode row either way.
  bool decode = false;
};

class Engine {
 public:
  Engine(const WeightSet& weights, Backend& be, const EngineOptions& opt = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelConfig& config() const;
  const EngineOptions& options() const;
  LinearPrecision linear_precision() const;
  Backend& backend() const;
  LatentCache& cache();
  // Runs the chunks (any mix of prefill chunks and decode tokens, distinct sequences) and
  // returns the logits of every chunk's last logits_rows tokens: [sum of logits_rows, V] f32 on
  // the host, chunk by chunk. With `hidden`, also the trunk output of every token (the MTP
  // module's input): [tokens, D] f32 on the backend.
  Tensor step(const std::vector<SeqChunk>& chunks, Tensor* hidden = nullptr);
  // The MTP module (DeepSeek-V3 §2.2; EngineOptions::mtp) at the positions of `chunks`: position
  // t combines the trunk output h_t (rows of `hidden`, from step) with the embedding of token t+1
  // (the chunk's tokens) and returns, from the last row of each chunk, the logits of token t+2:
  // [chunks, V] f32 on the host. Its latents go to the cache's extra layer.
  Tensor mtp_step(const std::vector<SeqChunk>& chunks, const TensorView& hidden);
  // Bytes a decode step of `batch` sequences `context` tokens deep must read at the least: the
  // Linear weights in their format (of the routed experts, those the batch is expected to touch
  // with uniform routing), the head, the router, the absorption's FP32 kv_b_proj, the cache.
  double decode_step_bytes(int64_t batch, int64_t context) const;
  // Decode steps run as replays of a recorded graph so far (EngineOptions::graphs), and why
  // graphs are off where a capture failed (empty otherwise).
  int64_t graph_replays() const;
  const std::string& graph_note() const;

  // Redundant experts, over the trunk's MoE layers in order (the MTP block keeps one copy each).
  // The placement in use (EngineOptions::expert_slots > 0), the tokens routed to each logical
  // expert (decayed at each rebalance: EngineOptions::load_decay), and to each virtual GPU since
  // the engine was made (or reset_gpu_tokens). The counts of steps whose expert layout the device
  // built are read back here (a host synchronization), not in the steps.
  const ExpertPlacement& placement() const;
  const ExpertLoads& expert_loads() const;
  const std::vector<std::vector<int64_t>>& gpu_tokens() const;
  void reset_gpu_tokens();
  // Between steps (the cache and the sequences in flight are untouched): a new placement of the
  // engine's shape, its copies' weights rearranged; rebalance() places from expert_loads() and
  // decays them (nothing to do before any token was routed).
  void set_placement(const ExpertPlacement& p);
  void rebalance();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp8moe::serve
