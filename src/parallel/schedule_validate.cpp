// Schedule validator. Static checks: every (micro-batch, stage) gets exactly one F, one B and one
// W (a full backward, alone or in an overlapped F&B, counts as B and W; a W exists only for an
// input-only B), each on the rank that holds the stage; every message between two ranks is sent
// once and received once, by the right ranks, and messages within a rank do not exist. Dynamic
// check: the event-driven run (schedule_sim.cpp), with buffered and with rendezvous sends, completes
// and finds every input in place, which proves dependency order and freedom from deadlock.
#include <sstream>

#include "schedule_build.hpp"

namespace fp8moe::pipeline {

namespace {

struct PassCounts {
  int forward = 0, backward = 0, weight = 0, deferred = 0;
};

struct MessageCounts {
  int sends = 0, recvs = 0;
};

std::string pass_name(const Pass& p) {
  return "micro-batch " + std::to_string(p.micro_batch) + " stage " + std::to_string(p.stage);
}

}  // namespace

std::vector<std::string> find_schedule_problems(const Schedule& s) {
  std::vector<std::string> problems;
  auto problem = [&](const std::string& text) {
    if (problems.size() < 50) problems.push_back(text);
  };
  const int M = s.num_micro_batches, S = s.num_stages;
  if (s.num_ranks <= 0 || M <= 0 || S <= 0 || int(s.rank_ops.size()) != s.num_ranks ||
      int(s.micro_batch_direction.size()) != M) {
    problem("schedule shape: ranks, stages, micro-batches and per-rank op lists disagree");
    return problems;
  }
  auto in_range = [&](const Pass& p) { return p.micro_batch >= 0 && p.micro_batch < M && p.stage >= 0 && p.stage < S; };
  std::vector<PassCounts> passes(size_t(M) * S);
  std::vector<MessageCounts> messages(2 * size_t(M) * S);
  auto index = [&](const Pass& p) { return size_t(p.micro_batch) * S + p.stage; };

  for (int rank = 0; rank < s.num_ranks; ++rank) {
    for (size_t i = 0; i < s.rank_ops[rank].size(); ++i) {
      const Op& op = s.rank_ops[rank][i];
      auto where = [&] {
        std::ostringstream os;
        os << "rank " << rank << " op " << i << " (" << op_label(s, op) << ")";
        return os.str();
      };
      if (!in_range(op.pass) || (op.kind == OpKind::ForwardBackward && !in_range(op.backward_pass))) {
        problem(where() + ": pass out of range");
        continue;
      }
      auto on_own_rank = [&](const Pass& p) {
        if (s.rank_of(p) != rank)
          problem(where() + ": " + pass_name(p) + " belongs to rank " + std::to_string(s.rank_of(p)));
      };
      switch (op.kind) {
        case OpKind::Forward:
          on_own_rank(op.pass);
          ++passes[index(op.pass)].forward;
          break;
        case OpKind::Backward:
          on_own_rank(op.pass);
          ++passes[index(op.pass)].backward;
          if (op.defers_weights) ++passes[index(op.pass)].deferred;
          else ++passes[index(op.pass)].weight;
          break;
        case OpKind::Weight:
          on_own_rank(op.pass);
          ++passes[index(op.pass)].weight;
          break;
        case OpKind::ForwardBackward:
          on_own_rank(op.pass);
          on_own_rank(op.backward_pass);
          ++passes[index(op.pass)].forward;
          ++passes[index(op.backward_pass)].backward;
          ++passes[index(op.backward_pass)].weight;
          break;
        default: {
          const bool activation = op.kind == OpKind::SendActivation || op.kind == OpKind::RecvActivation;
          const bool send = op.kind == OpKind::SendActivation || op.kind == OpKind::SendGradient;
          const Pass consumer{op.pass.micro_batch, op.pass.stage + (activation ? 1 : -1)};
          if (!in_range(consumer)) {
            problem(where() + ": the message leaves the pipeline");
            break;
          }
          const int producer_rank = s.rank_of(op.pass), consumer_rank = s.rank_of(consumer);
          const int self = send ? producer_rank : consumer_rank, peer = send ? consumer_rank : producer_rank;
          if (self != rank || op.peer != peer)
            problem(where() + ": expected on rank " + std::to_string(self) + " with peer " + std::to_string(peer));
          if (producer_rank == consumer_rank)
            problem(where() + ": producer and consumer are on the same rank, nothing to send");
          auto& count = messages[(activation ? 0 : size_t(M) * S) + index(op.pass)];
          ++(send ? count.sends : count.recvs);
        }
      }
    }
  }

  for (int mb = 0; mb < M; ++mb) {
    for (int stage = 0; stage < S; ++stage) {
      const Pass p{mb, stage};
      const PassCounts& c = passes[index(p)];
      if (c.forward != 1) problem(pass_name(p) + ": " + std::to_string(c.forward) + " forwards, expected 1");
      if (c.backward != 1) problem(pass_name(p) + ": " + std::to_string(c.backward) + " backwards, expected 1");
      if (c.weight != 1) problem(pass_name(p) + ": " + std::to_string(c.weight) + " weight gradients, expected 1");
      if (c.deferred > 0 && c.weight - (c.backward - c.deferred) != c.deferred)
        problem(pass_name(p) + ": an input-only backward without its W");
      for (int family = 0; family < 2; ++family) {
        const Pass consumer{mb, stage + (family == 0 ? 1 : -1)};
        const bool crosses = in_range(consumer) && s.rank_of(p) != s.rank_of(consumer);
        const MessageCounts& m = messages[size_t(family) * M * S + index(p)];
        const int expected = crosses ? 1 : 0;
        if (m.sends != expected || m.recvs != expected)
          problem(pass_name(p) + (family == 0 ? ": activation" : ": gradient") + " message sent " +
                  std::to_string(m.sends) + "x, received " + std::to_string(m.recvs) + "x, expected " +
                  std::to_string(expected) + "x");
      }
    }
  }
  if (!problems.empty()) return problems;

  // Unit costs: F = B-input = W = 1. Timing does not matter, only that the run completes.
  const OpCosts unit{1.0, 2.0, 1.0, 2.0, 0.5};
  for (SendMode mode : {SendMode::Buffered, SendMode::Rendezvous}) {
    try {
      simulate(s, unit, mode);
    } catch (const Error& e) {
      problem(std::string(mode == SendMode::Buffered ? "buffered sends: " : "rendezvous sends: ") + e.what());
    }
  }
  return problems;
}

void validate_schedule(const Schedule& schedule) {
  const auto problems = find_schedule_problems(schedule);
  std::ostringstream os;
  for (const auto& p : problems) os << "\n  " << p;
  FP8MOE_CHECK(problems.empty(), method_name(schedule.method) << " schedule is invalid:" << os.str());
}

}  // namespace fp8moe::pipeline
