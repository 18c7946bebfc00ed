// The server front of a prefill/decode disaggregated deployment (DeepSeek-V3 §3.4): on the
// prefill rank, DisaggregatedFront is the Batcher the HTTP server drives (server.hpp): each
// submitted request is prefilled by the front's engine and handed over with its cache blocks to
// one of the decode ranks (disaggregation.hpp), the one with the fewest requests in flight, and
// the text that rank makes comes back to the request's callbacks; serve_decode_rank is a decode
// rank's loop.
//   rank 0: DisaggregatedFront front(engine, comm, {1, 2}); Server(engine, front, opt).run(); front.finish();
//   ranks 1, 2: serve_decode_rank(scheduler, engine, comm, 0);
// On the wire, front to decode rank: a header i64 [13] {kind (1 request, 2 cancel, 0 end), id,
// prompt tokens, first token, max_tokens, blocks, eos, top_k, seed, temperature and top_p as
// their bits, bytes of stop strings, bytes of the sampler's state}, then the prompt, the stop
// strings (each a u32 length and its bytes), the sampler's state and the cache blocks; decode rank to front: a header i64 [4] {kind (1 text, 2
// done), id, bytes, tokens}, then the text, or the finish reason and the generated tokens. The
// decode rank only posts non-blocking sends, so neither rank can wait on the other's send.
#pragma once
#include <memory>
#include <vector>

#include "fp8moe/comm.hpp"
#include "serve/disaggregation.hpp"
#include "serve/scheduler.hpp"

namespace fp8moe::serve {

class DisaggregatedFront : public Batcher {
 public:
  // Receives each decode rank's cache size (requests are validated against the smallest and the
  // context).
  DisaggregatedFront(Engine& prefill_engine, Comm& comm, const std::vector<int>& decode_ranks,
                     int64_t max_chunk = 256);
  ~DisaggregatedFront() override;
  uint64_t submit(Request r) override;
  void cancel(uint64_t id) override;
  // Delivers what the decode rank sent, forwards cancellations, and prefills and hands over one
  // waiting request.
  bool step() override;
  SchedulerStats stats() const override;
  bool idle() const;    // nothing waiting and nothing on the decode ranks
  void finish();        // the decode ranks' loops return; requests still there are dropped
  const HandoverStats& handover() const;
  std::vector<int64_t> handovers_per_rank() const;  // requests handed to each decode rank, in their order

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Sends the cache size to the front, then admits its handovers into `scheduler` and sends their
// text back until the front finishes.
void serve_decode_rank(Scheduler& scheduler, Engine& engine, Comm& comm, int front_rank);

}  // namespace fp8moe::serve
