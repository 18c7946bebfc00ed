// Prefill/decode disaggregation (DeepSeek-V3 §3.4: prefill and decode on separate deployments):
// a prefill rank runs each prompt through its engine, samples the first token, and hands the
// prompt, that token and the prompt's latent-cache blocks (as stored: LatentCache::export_blocks)
// to a decode rank through Comm; the decode rank receives them into buffers and submits the
// request to its scheduler (Scheduler::submit_prefilled), which stores the blocks into its own
// cache when it admits the request and decodes from there.
//   rank 0: PrefillSender tx(engine, comm, 1); tx.send(prompt, 32); ...; tx.finish();
//   rank 1: DecodeReceiver rx(sched, engine, comm, 0); while (rx.receive(base)) {}  while (sched.step()) {}
// Both engines load the same weights and keep caches of the same dtype. A sampled request's
// generator state goes with it, so the decode rank goes on with the prefill rank's draws.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/comm.hpp"
#include "serve/engine.hpp"
#include "serve/sampler.hpp"
#include "serve/scheduler.hpp"

namespace fp8moe::serve {

// The cache blocks moved so far and the time the transfers took (the decode rank's count starts
// when a request's header has arrived, so the prefill compute is not in it).
struct HandoverStats {
  int64_t requests = 0, bytes = 0;
  double seconds = 0;
  double gb_per_s() const { return seconds > 0 ? double(bytes) / seconds / 1e9 : 0.0; }
};

// The bytes of s as a host u8 tensor, for Comm.
Tensor host_bytes(std::string_view s);

// The transfer itself: the parts of LatentCache::export_blocks to `peer`, and into buffers of
// LatentCache::empty_export shapes from it; both return the bytes moved.
int64_t send_cache_blocks(Comm& comm, const std::vector<Tensor>& parts, int peer, const Stream& s);
int64_t recv_cache_blocks(Comm& comm, const std::vector<Tensor>& parts, int peer, const Stream& s);

// The prefill rank's work on one prompt: through the engine in chunks of max_chunk tokens into
// blocks of `alloc`, the first token drawn from `sampler`, the blocks exported and given back.
struct Prefilled {
  int32_t first = 0;
  std::string sampler_state;  // after the first draw (Sampler::state)
  int64_t blocks = 0;
  std::vector<Tensor> parts;  // LatentCache::export_blocks
};
Prefilled prefill_for_handover(Engine& engine, BlockAllocator& alloc, const std::vector<int32_t>& prompt,
                               int64_t max_chunk, Sampler& sampler);

class PrefillSender {
 public:
  PrefillSender(Engine& engine, Comm& comm, int decode_rank, int64_t max_chunk = 256);
  // Prefills `prompt` (chunks of max_chunk tokens), samples its first token, hands it over; the
  // decode rank generates up to max_tokens in all. Returns the first token.
  int32_t send(const std::vector<int32_t>& prompt, int64_t max_tokens, const SamplingParams& sampling = {});
  void finish();  // no more requests: the decode rank's receive returns false
  const HandoverStats& stats() const { return stats_; }

 private:
  Engine& engine_;
  Comm& comm_;
  int peer_;
  int64_t max_chunk_;
  BlockAllocator alloc_;
  HandoverStats stats_;
};

class DecodeReceiver {
 public:
  DecodeReceiver(Scheduler& scheduler, Engine& engine, Comm& comm, int prefill_rank);
  // Receives the next request and submits it to the scheduler as `base` (its callbacks, stop
  // strings, sampling) with the prompt and max_tokens sent; false once the prefill rank finished.
  bool receive(Request base);
  const HandoverStats& stats() const { return stats_; }

 private:
  Scheduler& scheduler_;
  Engine& engine_;
  Comm& comm_;
  int peer_;
  HandoverStats stats_;
};

}  // namespace fp8moe::serve
