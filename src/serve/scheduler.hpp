// Continuous batching over the engine: every step admits waiting requests into the running batch,
// feeds each running request its next chunk (the rest of its prompt, cut to the step's token
// budget: chunked prefill; or its last sampled token: decode), samples where a chunk reaches the
// end of the request's text, and retires requests at their stop condition (max_tokens, a stop
// string, EOS, or cancellation). Cache blocks come from a BlockAllocator as the text grows; when
// none is left for a decode token, the most recently admitted running request is preempted (its
// blocks freed, its text kept) and later resumed by recomputing its prompt and the tokens it had
// made (vLLM's recompute preemption); its sampler state is kept, so a resumed request goes on with
// the text it would have made.
//   serve::Scheduler s(engine, {});
//   s.submit({.prompt = serve::encode_text("Hi"), .max_tokens = 32, .on_text = ..., .on_done = ...});
//   while (s.step()) {}
// submit and cancel may be called from any thread; step from one thread (the engine's).
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "serve/engine.hpp"
#include "serve/sampler.hpp"

namespace fp8moe::serve {

struct Request {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;
  SamplingParams sampling;
  std::vector<std::string> stop;
  int32_t eos = -1;
  // Called from step(): text as it is made (stop strings withheld), then once at the end with
  // "length", "stop" or "cancelled".
  std::function<void(std::string_view)> on_text;
  std::function<void(const std::string& finish_reason, const std::vector<int32_t>& tokens)> on_done;
};

struct SchedulerOptions {
  int64_t max_step_tokens = 256;  // tokens per engine step (prefill chunks + decode tokens)
  int64_t max_running = 64;       // requests in the running batch
};

struct SchedulerStats {
  int64_t waiting = 0, running = 0, blocks_used = 0, blocks_total = 0;
  int64_t finished = 0, cancelled = 0, preemptions = 0, steps = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  // Seconds, per finished request (time to first token) and per generated token after the first
  // (inter-token latency); the scheduler keeps the latest 10000 of each.
  std::vector<double> ttft, itl;
};

// Raises fp8moe::Error naming the field: empty prompt, a token outside the vocabulary, prompt +
// max_tokens beyond the context or a cache of `cache_blocks` blocks, bad sampling.
void validate_request(const Request& r, const ModelConfig& cfg, int64_t cache_blocks);

// What the HTTP server drives: a Scheduler, or the front of a disaggregated deployment
// (disaggregated_front.hpp). submit and cancel from any thread, step from one.
class Batcher {
 public:
  virtual ~Batcher() = default;
  virtual uint64_t submit(Request r) = 0;  // validated and queued; returns its id
  virtual void cancel(uint64_t id) = 0;    // a no-op for finished or unknown ids
  virtual bool step() = 0;                 // false when there was nothing to do
  virtual SchedulerStats stats() const = 0;
};

class Scheduler : public Batcher {
 public:
  Scheduler(Engine& engine, const SchedulerOptions& opt = {});
  ~Scheduler() override;
  // Validates the request (validate_request against this engine's cache) and queues it.
  uint64_t submit(Request r) override;
  // A request whose prompt another engine prefilled (prefill/decode disaggregation, report §3.4):
  // `first` is the token sampled there, and `fill` stores the prompt's latents into the blocks
  // allocated for them here (LatentCache::import_blocks on the table's first blocks), called from
  // step() when the request is admitted; `sampler_state` (Sampler::state after the first draw;
  // empty: a fresh sampler) goes on with the prefill rank's draws. A request preempted later
  // recomputes its text as any other.
  uint64_t submit_prefilled(Request r, int32_t first, std::function<void(const std::vector<int32_t>& table)> fill,
                            const std::string& sampler_state = "");
  void cancel(uint64_t id) override;
  // One engine step; false when there was nothing to do.
  bool step() override;
  bool idle() const;
  SchedulerStats stats() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp8moe::serve
