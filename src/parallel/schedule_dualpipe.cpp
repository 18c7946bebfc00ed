// DualPipe and DualPipeV (report §3.2.1, Figure 5; deepseek-ai/DualPipe), issued op for op in the
// order of the reference implementation's eight steps, so that the executor built on these lists
// behaves like the reference.
//
// DualPipe: PP ranks, micro-batches fed from both ends. Rank r holds stage r of the pipeline fed at
// rank 0 (direction 0) and stage PP-1-r of the one fed at rank PP-1 (direction 1): two parameter
// copies. Each rank thinks in "phases": phase 0 is the direction whose input end is nearer (direction
// 0 on the first half of the ranks, direction 1 on the second half), phase 1 the other one, so the
// step structure is the same on every rank with r replaced by its distance to the nearer end.
// DualPipeV: the "cut in half" variant. PP stages on PP/2 ranks, all micro-batches enter at rank 0;
// rank r holds stage r (phase 0, on the way down) and PP-1-r (phase 1, on the way back), and the
// last rank hands phase 0's output to its own phase 1 without communication.
//
// Per-phase counters pick the micro-batch of every compute op, send and receive, exactly as the
// reference advances its chunk counters; deferred weight gradients are run first in, first out.
#include <deque>

#include "schedule_build.hpp"

namespace fp8moe::pipeline {

namespace {

using detail::RankOps;

class DualPipeRankBuilder {
 public:
  DualPipeRankBuilder(Schedule& schedule, int rank, bool v_shape)
      : ops_(schedule, rank), v_shape_(v_shape), rank_(rank), num_ranks_(schedule.num_ranks) {
    const int num_stages = schedule.num_stages;
    chunks_per_lane_ = v_shape ? schedule.num_micro_batches : schedule.num_micro_batches / 2;
    half_ranks_ = v_shape ? num_ranks_ : num_ranks_ / 2;
    half_rank_ = v_shape ? rank : std::min(rank, num_ranks_ - 1 - rank);
    in_second_half_ = !v_shape && rank >= num_ranks_ / 2;
    // The rank where the two phases meet: DualPipe's two middle ranks, DualPipeV's last rank.
    turning_rank_ = v_shape ? rank == num_ranks_ - 1
                            : (rank == num_ranks_ / 2 - 1 || rank == num_ranks_ / 2);
    lane_stage_[0] = rank;
    lane_stage_[1] = num_stages - 1 - rank;
  }

  void build();

 private:
  // Phase (relative to this rank's nearer end) -> lane (direction for DualPipe, way down/up for V).
  int lane(int phase) const { return phase ^ int(in_second_half_); }
  Pass pass(int lane, int chunk) const {
    const int micro_batch = v_shape_ ? chunk : lane * chunks_per_lane_ + chunk;
    return {micro_batch, lane_stage_[lane]};
  }
  bool is_first_rank() const { return rank_ == 0; }
  bool is_last_rank() const { return rank_ == num_ranks_ - 1; }
  bool is_first_stage(int lane) const {
    return v_shape_ ? is_first_rank() && lane == 0
                    : (is_first_rank() && lane == 0) || (is_last_rank() && lane == 1);
  }
  bool is_last_stage(int lane) const {
    return v_shape_ ? is_first_rank() && lane == 1
                    : (is_first_rank() && lane == 1) || (is_last_rank() && lane == 0);
  }
  // DualPipeV's fold: the last rank's way down feeds its own way back up.
  bool output_stays_local(int lane) const { return v_shape_ && is_last_rank() && lane == 0; }
  bool input_is_local(int lane) const { return v_shape_ && is_last_rank() && lane == 1; }

  void recv_forward(int phase) {
    const int l = lane(phase);
    if (is_first_stage(l) || input_is_local(l)) return;
    ops_.recv_activation(RankOps::prev_stage(pass(l, recv_f_[l]++)));
  }
  void send_forward(int phase) {
    const int l = lane(phase);
    if (is_last_stage(l) || output_stays_local(l)) return;
    ops_.send_activation(pass(l, send_f_[l]++));
  }
  void recv_backward(int phase) {
    const int l = lane(phase);
    if (is_last_stage(l) || output_stays_local(l)) return;
    ops_.recv_gradient(RankOps::next_stage(pass(l, recv_b_[l]++)));
  }
  void send_backward(int phase) {
    const int l = lane(phase);
    if (is_first_stage(l) || input_is_local(l)) return;
    ops_.send_gradient(pass(l, send_b_[l]++));
  }
  Pass next_forward(int phase) {
    const int l = lane(phase);
    return pass(l, f_[l]++);
  }
  Pass next_backward(int phase) {
    const int l = lane(phase);
    return pass(l, b_[l]++);
  }

  void forward_chunk(int phase, bool recv = true, bool send = true) {
    if (recv) recv_forward(phase);
    ops_.forward(next_forward(phase));
    if (send) send_forward(phase);
  }
  void backward_chunk(int phase, bool defer_weights = false, bool recv = true, bool send = true) {
    if (recv) recv_backward(phase);
    const Pass p = next_backward(phase);
    ops_.backward(p, defer_weights);
    if (defer_weights) deferred_weights_.push_back(p);
    if (send) send_backward(phase);
  }
  // F of phase_f overlapped with a full B of phase_b.
  void forward_backward_chunk(int phase_f, int phase_b, bool recv_f = true) {
    if (recv_f) recv_forward(phase_f);
    recv_backward(phase_b);
    const Pass f = next_forward(phase_f);
    const Pass b = next_backward(phase_b);
    ops_.forward_backward(f, b);
    send_forward(phase_f);
    send_backward(phase_b);
  }
  void weight_chunk() {
    ops_.weight(deferred_weights_.front());
    deferred_weights_.pop_front();
  }

  RankOps ops_;
  bool v_shape_;
  int rank_, num_ranks_;
  int chunks_per_lane_ = 0, half_ranks_ = 0, half_rank_ = 0;
  bool in_second_half_ = false, turning_rank_ = false;
  int lane_stage_[2] = {0, 0};
  // Per-lane counters: next chunk to compute / send / receive.
  int f_[2] = {0, 0}, b_[2] = {0, 0};
  int send_f_[2] = {0, 0}, send_b_[2] = {0, 0}, recv_f_[2] = {0, 0}, recv_b_[2] = {0, 0};
  std::deque<Pass> deferred_weights_;
};

void DualPipeRankBuilder::build() {
  const int n = half_ranks_, h = half_rank_, chunks = chunks_per_lane_;

  // Step 1: fill the nearer direction: 2(n-h-1) forwards of phase 0.
  for (int i = 0; i < (n - h - 1) * 2; ++i) forward_chunk(0);

  // Step 2: h+1 pairs of forwards, one of each phase. The receive for the next phase-0 forward is
  // posted one op early so it travels while the phase-1 forward runs.
  // NOTES: a DualPipe middle rank sends its phase-0 output right after computing it, because the
  // other middle rank's phase-1 forward of the same round consumes it; a turning rank also keeps
  // its last phase-1 output until step 4, where it leaves after the next phase-0 forward.
  const bool send_phase0_early = !v_shape_ && turning_rank_;
  recv_forward(0);
  for (int i = 0; i < h + 1; ++i) {
    forward_chunk(0, /*recv=*/false, /*send=*/send_phase0_early);
    recv_forward(0);
    forward_chunk(1, /*recv=*/true, /*send=*/!turning_rank_ || i < h);
    if (!send_phase0_early) send_forward(0);
  }

  // Step 3: n-h-1 rounds of B(phase 1, input only), W, F(phase 1): zero-bubble while the first
  // backwards come back.
  for (int i = 0; i < n - h - 1; ++i) {
    backward_chunk(1, /*defer_weights=*/true);
    recv_forward(1);
    weight_chunk();
    forward_chunk(1, /*recv=*/false);
  }

  // Step 4, the steady state: pairs F0&B1, F1&B0, each forward overlapped with a full backward.
  for (int i = 0; i < chunks - 2 * n + h + 1; ++i) {
    if (i == 0) {
      if (turning_rank_) {
        // NOTES: the reference does not overlap this pair on the turning rank "to further reduce
        // bubble size": F0 runs alone, then the held-back phase-1 output leaves, then B1.
        forward_chunk(0, /*recv=*/false, /*send=*/false);
        send_forward(1);
        backward_chunk(1, /*defer_weights=*/false, /*recv=*/true, /*send=*/false);
        send_forward(0);
        send_backward(1);
      } else {
        forward_backward_chunk(0, 1, /*recv_f=*/false);
      }
    } else {
      forward_backward_chunk(0, 1);
    }
    forward_backward_chunk(1, 0);
  }

  // Step 5: n-h-1 rounds of B1 then F1&B0: the nearer direction has no forwards left.
  for (int i = 0; i < n - h - 1; ++i) {
    backward_chunk(1);
    forward_backward_chunk(1, 0);
  }

  // Step 6: h+1 pairs B1, B0. The second half of them defer their weights (zero bubble); which
  // backward of the middle pair switches depends on the parity of h.
  bool defer = false;
  for (int i = 0; i < h + 1; ++i) {
    if (i == (h + 1) / 2 && h % 2 == 1) defer = true;
    backward_chunk(1, defer);
    if (i == (h + 1) / 2 && h % 2 == 0) defer = true;
    backward_chunk(0, defer);
  }

  // Step 7: n-h-1 rounds of W then B0 (input only).
  for (int i = 0; i < n - h - 1; ++i) {
    weight_chunk();
    backward_chunk(0, /*defer_weights=*/true);
  }

  // Step 8: the remaining weight gradients.
  while (!deferred_weights_.empty()) weight_chunk();
}

Schedule dual_schedule(Method method, int pp, int micro_batches) {
  const bool v_shape = method == Method::DualPipeV;
  const std::string_view name = method_name(method);
  FP8MOE_CHECK(pp >= 2 && pp % 2 == 0,
               name << ": pp must be even and >= 2 (" << (v_shape ? "PP stages fold onto PP/2 ranks" : "ranks pair up as r and PP-1-r")
                    << "), got pp = " << pp);
  if (v_shape) {
    FP8MOE_CHECK(micro_batches >= pp, name << ": micro-batches must be >= pp (twice the " << pp / 2
                                           << " ranks), got micro-batches = " << micro_batches);
  } else {
    FP8MOE_CHECK(micro_batches % 2 == 0,
                 name << ": micro-batches must be even (half are fed from each end), got " << micro_batches);
    FP8MOE_CHECK(micro_batches >= 2 * pp,
                 name << ": micro-batches must be >= 2*pp = " << 2 * pp << ", got " << micro_batches);
  }

  Schedule s;
  s.method = method;
  s.num_ranks = v_shape ? pp / 2 : pp;
  s.num_stages = pp;
  s.num_micro_batches = micro_batches;
  s.micro_batch_direction.assign(micro_batches, 0);
  if (v_shape) {
    s.stage_rank.assign(1, std::vector<int>(pp));
    for (int stage = 0; stage < pp; ++stage) s.stage_rank[0][stage] = std::min(stage, pp - 1 - stage);
  } else {
    for (int mb = micro_batches / 2; mb < micro_batches; ++mb) s.micro_batch_direction[mb] = 1;
    s.stage_rank.assign(2, std::vector<int>(pp));
    for (int stage = 0; stage < pp; ++stage) {
      s.stage_rank[0][stage] = stage;
      s.stage_rank[1][stage] = pp - 1 - stage;
    }
  }
  s.rank_ops.assign(s.num_ranks, {});
  for (int rank = 0; rank < s.num_ranks; ++rank) DualPipeRankBuilder(s, rank, v_shape).build();
  return s;
}

}  // namespace

Schedule dualpipe_schedule(int pp, int micro_batches) {
  return dual_schedule(Method::DualPipe, pp, micro_batches);
}

Schedule dualpipev_schedule(int pp, int micro_batches) {
  return dual_schedule(Method::DualPipeV, pp, micro_batches);
}

}  // namespace fp8moe::pipeline
