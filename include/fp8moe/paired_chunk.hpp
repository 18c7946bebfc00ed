// DualPipe's paired F&B chunk (report Figure 4) on two streams of one backend: the forward half of
// one micro-batch and the backward half of another, their components issued by the host in turn
// (forward attention, backward MLP/MoE, forward MLP/MoE, backward attention, ...), the forward's on
// the backend's current stream and the backward's on a second stream, so that the device runs one
// half's kernels while the host waits in the other's (a routing count read back, the MPI engine's
// staged exchange) and while the other's kernels run. The two halves share no activations; what
// they do share (a parameter or its gradient: the embedding that the head's MTP module and the
// stage-0 backward both touch) is named per step, and a step naming a resource waits for the other
// stream's work issued so far, which keeps the sequential order's arithmetic. Bitwise equal to the
// serial mode, which issues the same steps in the same order on one stream.
//   PairedChunk pair(be);
//   pair.run({{fwd_attn, {}}, {fwd_mlp, {}}}, {{bwd_mlp, {}}, {bwd_attn, {}}}, FbMode::overlap);
#pragma once
#include <functional>
#include <string_view>
#include <vector>

#include "fp8moe/backend.hpp"

namespace fp8moe::pipeline {

// One component of a half: the work it enqueues, and the state it shares with the other half
// (resource ids of the caller's choosing, e.g. a trunk sublayer's index).
struct ChunkStep {
  std::function<void()> run;
  std::vector<int> shared;
};

// overlap: two streams as above; serial: every step on the current stream, in the same order.
enum class FbMode { overlap, serial };
std::string_view fb_mode_name(FbMode mode);
FbMode parse_fb_mode(std::string_view name);  // "overlap" | "serial"; Error otherwise

class PairedChunk {
 public:
  explicit PairedChunk(Backend& be);  // the second stream and the events, made once

  // Runs forward[0], backward[0], forward[1], backward[1], ... (the longer half's rest after). In
  // overlap mode the second stream first waits for the current stream's work so far, the current
  // stream waits for the second at the end, and the memory freed in between is reused only after
  // that (free_hold.hpp). Returns once the work is issued (the host waits only where a step does).
  void run(const std::vector<ChunkStep>& forward, const std::vector<ChunkStep>& backward, FbMode mode);

  // The cross-stream waits of the last run for shared resources (0 when none was named by both
  // halves, and in serial mode).
  int shared_waits() const { return shared_waits_; }

 private:
  Backend& be_;
  Stream second_;
  Event to_second_, to_first_;
  int shared_waits_ = 0;
};

}  // namespace fp8moe::pipeline
