// Internal helpers shared by the schedule generators: an empty Schedule with its stage-to-rank map,
// and appending compute and communication ops with the peer filled in from that map.
#pragma once
#include "fp8moe/schedule.hpp"

namespace fp8moe::pipeline::detail {

// Which of a rank's two stage copies a pass uses (DualPipe: its direction; DualPipeV: the way
// down or the way back up), 0 for single-stage methods; and the micro-batch number to display.
int pass_lane(const Schedule& schedule, const Pass& pass);
int pass_display_id(const Schedule& schedule, const Pass& pass);

// One direction, stage s on rank s (1F1B, ZB1P).
Schedule linear_pipeline(Method method, int pp, int micro_batches);

// Appends to one rank's op list; peers of sends/receives come from the schedule's stage map.
class RankOps {
 public:
  RankOps(Schedule& schedule, int rank) : schedule_(schedule), rank_(rank) {}
  int rank() const { return rank_; }
  const Schedule& schedule() const { return schedule_; }

  void forward(Pass p) { push({OpKind::Forward, p, {}, false, -1}); }
  void backward(Pass p, bool defers_weights) { push({OpKind::Backward, p, {}, defers_weights, -1}); }
  void weight(Pass p) { push({OpKind::Weight, p, {}, false, -1}); }
  void forward_backward(Pass f, Pass b) { push({OpKind::ForwardBackward, f, b, false, -1}); }
  // Messages are named by the pass that produces them.
  void send_activation(Pass producer) { push_comm(OpKind::SendActivation, producer, next_stage(producer)); }
  void recv_activation(Pass producer) { push_comm(OpKind::RecvActivation, producer, producer); }
  void send_gradient(Pass producer) { push_comm(OpKind::SendGradient, producer, prev_stage(producer)); }
  void recv_gradient(Pass producer) { push_comm(OpKind::RecvGradient, producer, producer); }

  static Pass next_stage(Pass p) { return {p.micro_batch, p.stage + 1}; }
  static Pass prev_stage(Pass p) { return {p.micro_batch, p.stage - 1}; }

 private:
  void push(const Op& op) { schedule_.rank_ops[rank_].push_back(op); }
  void push_comm(OpKind kind, Pass producer, Pass peer_pass) {
    push({kind, producer, {}, false, schedule_.rank_of(peer_pass)});
  }
  Schedule& schedule_;
  int rank_;
};

}  // namespace fp8moe::pipeline::detail
