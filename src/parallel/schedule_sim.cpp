// Event-driven run of a schedule: every rank issues its ops in order on one compute stream; a
// communication op is posted at the rank's current time and does not block; a compute op first
// waits for every communication op its rank posted before it (batch_isend_irecv + wait), then for
// nothing else, and runs for its cost. A rank whose next compute op waits on a message nobody will
// post blocks; when no rank can move and some are unfinished, the schedule deadlocks.
// Every compute op also checks that its inputs are on the rank when it starts (its forward input,
// its output gradient, its own forward before its backward, its B before its W), so the same run
// proves dependency order. The validator runs it once per send mode with unit costs.
#include <algorithm>
#include <set>
#include <sstream>

#include "schedule_build.hpp"

namespace fp8moe::pipeline {

namespace {

constexpr double kNotYet = -1.0;

class Executor {
 public:
  Executor(const Schedule& s, const OpCosts& costs, SendMode mode)
      : s_(s), costs_(costs), mode_(mode), num_passes_(size_t(s.num_micro_batches) * s.num_stages) {
    send_posted_.assign(2 * num_passes_, kNotYet);
    recv_posted_.assign(2 * num_passes_, kNotYet);
    forward_end_.assign(num_passes_, kNotYet);
    backward_end_.assign(num_passes_, kNotYet);
    weight_end_.assign(num_passes_, kNotYet);
    input_ready_.assign(num_passes_, kNotYet);
    grad_ready_.assign(num_passes_, kNotYet);
    ranks_.resize(s.num_ranks);
  }

  Simulation run();

 private:
  struct RankState {
    size_t pc = 0;
    double clock = 0;
    std::vector<size_t> pending;  // posted, not yet waited-for communication ops (indices)
    bool finished = false;
    RankTimeline timeline;
  };

  size_t pass_index(const Pass& p) const {
    FP8MOE_CHECK(p.micro_batch >= 0 && p.micro_batch < s_.num_micro_batches && p.stage >= 0 &&
                     p.stage < s_.num_stages,
                 "schedule: pass (micro-batch " << p.micro_batch << ", stage " << p.stage
                                                << ") is out of range");
    return size_t(p.micro_batch) * s_.num_stages + p.stage;
  }
  size_t message_index(const Op& op) const {
    const bool gradient = op.kind == OpKind::SendGradient || op.kind == OpKind::RecvGradient;
    return (gradient ? num_passes_ : 0) + pass_index(op.pass);
  }
  bool is_send(OpKind k) const { return k == OpKind::SendActivation || k == OpKind::SendGradient; }

  // Completion time of a posted communication op, or kNotYet while its partner is not posted.
  double completion(const Op& op) const {
    const size_t m = message_index(op);
    if (is_send(op.kind)) {
      if (mode_ == SendMode::Buffered) return send_posted_[m];
      if (recv_posted_[m] == kNotYet) return kNotYet;
    } else if (send_posted_[m] == kNotYet) {
      return kNotYet;
    }
    const double posted = mode_ == SendMode::Buffered ? send_posted_[m]
                                                      : std::max(send_posted_[m], recv_posted_[m]);
    return posted + costs_.comm_latency;
  }

  std::string where(int rank, size_t pc) const {
    std::ostringstream os;
    os << "rank " << rank << " op " << pc << " (" << op_label(s_, s_.rank_ops[rank][pc]) << ")";
    return os.str();
  }

  bool step(int rank);
  void post(int rank, const Op& op);
  void complete_pending(int rank, RankState& st);
  void require_inputs(int rank, size_t pc, const Op& op) const;
  void start_compute(int rank, size_t pc, const Op& op, double start, double end);
  std::string describe_deadlock() const;

  const Schedule& s_;
  const OpCosts& costs_;
  SendMode mode_;
  size_t num_passes_;
  std::vector<double> send_posted_, recv_posted_;           // [2 * passes] by message
  std::vector<double> forward_end_, backward_end_, weight_end_;  // [passes]
  std::vector<double> input_ready_, grad_ready_;            // [passes] data on the pass's rank
  std::vector<RankState> ranks_;
};

void Executor::post(int rank, const Op& op) {
  const size_t m = message_index(op);
  auto& posted = is_send(op.kind) ? send_posted_ : recv_posted_;
  FP8MOE_CHECK(posted[m] == kNotYet, "schedule: " << where(rank, ranks_[rank].pc) << " posts a message that was already posted");
  posted[m] = ranks_[rank].clock;
}

// The data of completed receives is now on the rank.
void Executor::complete_pending(int rank, RankState& st) {
  for (size_t i : st.pending) {
    const Op& op = s_.rank_ops[rank][i];
    const double t = completion(op);
    st.clock = std::max(st.clock, t);
    if (op.kind == OpKind::RecvActivation) input_ready_[pass_index(detail::RankOps::next_stage(op.pass))] = t;
    if (op.kind == OpKind::RecvGradient) grad_ready_[pass_index(detail::RankOps::prev_stage(op.pass))] = t;
  }
  st.pending.clear();
}

void Executor::require_inputs(int rank, size_t pc, const Op& op) const {
  auto need = [&](bool ok, const char* what, const Pass& p) {
    FP8MOE_CHECK(ok, "schedule: " << where(rank, pc) << " runs before " << what << " of micro-batch "
                                  << p.micro_batch << " stage " << p.stage << " is on rank " << rank);
  };
  auto need_forward_inputs = [&](const Pass& p) {
    need(s_.rank_of(p) == rank, "the stage", p);
    need(forward_end_[pass_index(p)] == kNotYet, "(it repeats) the forward", p);
    need(p.stage == 0 || input_ready_[pass_index(p)] != kNotYet, "the input activation", p);
  };
  auto need_backward_inputs = [&](const Pass& p) {
    need(s_.rank_of(p) == rank, "the stage", p);
    need(backward_end_[pass_index(p)] == kNotYet, "(it repeats) the backward", p);
    need(forward_end_[pass_index(p)] != kNotYet, "the forward", p);
    need(p.stage == s_.num_stages - 1 || grad_ready_[pass_index(p)] != kNotYet, "the output gradient", p);
  };
  switch (op.kind) {
    case OpKind::Forward: need_forward_inputs(op.pass); break;
    case OpKind::Backward: need_backward_inputs(op.pass); break;
    case OpKind::ForwardBackward:
      need_forward_inputs(op.pass);
      need_backward_inputs(op.backward_pass);
      break;
    case OpKind::Weight:
      need(s_.rank_of(op.pass) == rank, "the stage", op.pass);
      need(backward_end_[pass_index(op.pass)] != kNotYet, "the input-only backward", op.pass);
      need(weight_end_[pass_index(op.pass)] == kNotYet, "(it repeats) the weight gradient", op.pass);
      break;
    default: break;
  }
}

void Executor::start_compute(int rank, size_t pc, const Op& op, double start, double end) {
  auto& st = ranks_[rank];
  st.timeline.compute.push_back({int(pc), start, end});
  st.timeline.busy += end - start;
  auto forward_done = [&](const Pass& p) {
    forward_end_[pass_index(p)] = end;
    const Pass next = detail::RankOps::next_stage(p);
    if (next.stage < s_.num_stages && s_.rank_of(next) == rank) input_ready_[pass_index(next)] = end;
  };
  auto backward_done = [&](const Pass& p, bool full) {
    backward_end_[pass_index(p)] = end;
    if (full) weight_end_[pass_index(p)] = end;
    const Pass prev = detail::RankOps::prev_stage(p);
    if (prev.stage >= 0 && s_.rank_of(prev) == rank) grad_ready_[pass_index(prev)] = end;
  };
  switch (op.kind) {
    case OpKind::Forward: forward_done(op.pass); break;
    case OpKind::Backward: backward_done(op.pass, !op.defers_weights); break;
    case OpKind::ForwardBackward:
      forward_done(op.pass);
      backward_done(op.backward_pass, true);
      break;
    case OpKind::Weight: weight_end_[pass_index(op.pass)] = end; break;
    default: break;
  }
}

// Advances one rank by one op if it can; false when it is blocked or finished.
bool Executor::step(int rank) {
  auto& st = ranks_[rank];
  if (st.finished) return false;
  const auto& ops = s_.rank_ops[rank];
  auto all_pending_complete = [&] {
    for (size_t i : st.pending)
      if (completion(ops[i]) == kNotYet) return false;
    return true;
  };
  if (st.pc == ops.size()) {  // the final wait for what is still in flight
    if (!all_pending_complete()) return false;
    complete_pending(rank, st);
    st.finished = true;
    return true;
  }
  const Op& op = ops[st.pc];
  if (is_comm(op.kind)) {
    post(rank, op);
    st.pending.push_back(st.pc++);
    return true;
  }
  if (!all_pending_complete()) return false;
  complete_pending(rank, st);
  require_inputs(rank, st.pc, op);
  const double start = st.clock, end = start + op_cost(op, costs_);
  start_compute(rank, st.pc, op, start, end);
  st.clock = end;
  ++st.pc;
  return true;
}

std::string Executor::describe_deadlock() const {
  std::ostringstream os;
  os << "schedule: deadlock, no rank can proceed:";
  for (int r = 0; r < s_.num_ranks; ++r) {
    const auto& st = ranks_[r];
    if (st.finished) continue;
    os << "\n  rank " << r << " at "
       << (st.pc < s_.rank_ops[r].size() ? op_label(s_, s_.rank_ops[r][st.pc]) : std::string("its end"))
       << ", waiting for:";
    for (size_t i : st.pending)
      if (completion(s_.rank_ops[r][i]) == kNotYet) os << " " << op_label(s_, s_.rank_ops[r][i]);
  }
  return os.str();
}

Simulation Executor::run() {
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s_.num_ranks; ++r)
      while (step(r)) progress = true;
  }
  for (const auto& st : ranks_) FP8MOE_CHECK(st.finished, describe_deadlock());

  Simulation sim;
  for (const auto& st : ranks_) sim.makespan = std::max(sim.makespan, st.clock);
  for (int r = 0; r < s_.num_ranks; ++r) {
    RankTimeline t = std::move(ranks_[r].timeline);
    t.bubble = sim.makespan - t.busy;
    // Activations are allocated as a forward starts and freed once the weight gradient is done
    // (a full backward does both), so an overlapped F&B holds one more while it runs.
    int held = 0;
    std::set<std::pair<int, int>> parameter_sets;  // (direction, stage)
    for (const Op& op : s_.rank_ops[r]) {
      if (!is_compute(op.kind)) continue;
      if (op.kind == OpKind::Forward || op.kind == OpKind::ForwardBackward) {
        ++held;
        parameter_sets.insert({s_.micro_batch_direction[op.pass.micro_batch], op.pass.stage});
      }
      t.peak_activations = std::max(t.peak_activations, held);
      if ((op.kind == OpKind::Backward && !op.defers_weights) || op.kind == OpKind::Weight ||
          op.kind == OpKind::ForwardBackward)
        --held;
    }
    t.parameter_stages = int(parameter_sets.size());
    sim.bubble = std::max(sim.bubble, t.bubble);
    sim.peak_activations = std::max(sim.peak_activations, t.peak_activations);
    sim.parameter_stages = std::max(sim.parameter_stages, t.parameter_stages);
    sim.ranks.push_back(std::move(t));
  }
  return sim;
}

}  // namespace

Simulation simulate(const Schedule& schedule, const OpCosts& costs, SendMode send_mode) {
  check_costs(costs);
  return Executor(schedule, costs, send_mode).run();
}

}  // namespace fp8moe::pipeline
