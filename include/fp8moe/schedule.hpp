// Pipeline-parallel schedules as data: 1F1B, ZB1P, DualPipe and DualPipeV (report §3.2.1, Table 2).
// A Schedule is, for every pipeline rank, the ordered list of operations that rank issues: compute
// (forward F, backward B, backward-for-weights W, an overlapped F&B pair) and the point-to-point
// sends/receives between ranks. The executor that runs schedules on GPUs consumes exactly this;
// here it is generated, validated (schedule_validate), simulated (schedule_sim) and drawn.
//   fp8moe schedule --method dualpipe --pp 8 --micro-batches 20
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/error.hpp"

namespace fp8moe::pipeline {

enum class Method { OneFOneB, ZB1P, DualPipe, DualPipeV };

std::string_view method_name(Method method);  // "1f1b", "zb1p", "dualpipe", "dualpipev"
Method parse_method(std::string_view name);   // throws Error listing the accepted names
const std::vector<Method>& all_methods();

// One stage of one micro-batch: the unit every F, B and W acts on. Stages are numbered along the
// micro-batch's own path (0 = where it enters), so a DualPipe micro-batch fed from the last rank
// runs stage 0 on rank PP-1.
struct Pass {
  int micro_batch = -1;
  int stage = -1;
  friend bool operator==(const Pass&, const Pass&) = default;
};

enum class OpKind {
  Forward,          // F(pass)
  Backward,         // B(pass): full backward, or input-only when defers_weights (W follows later)
  Weight,           // W(pass): the deferred backward-for-weights of an input-only B
  ForwardBackward,  // F(pass) and full B(backward_pass) overlapped as one chunk (DualPipe's F&B)
  SendActivation,   // output of F(pass) to the rank of stage pass.stage+1
  RecvActivation,   // input of F(micro_batch, pass.stage+1), produced by F(pass) on `peer`
  SendGradient,     // input-gradient of B(pass) to the rank of stage pass.stage-1
  RecvGradient,     // output-gradient of B(micro_batch, pass.stage-1), produced by B(pass) on `peer`
};

bool is_compute(OpKind kind);
bool is_comm(OpKind kind);

// Sends and receives name the *producing* pass, so a send and the receive it matches carry the
// same (kind family, pass). Communication ops are non-blocking posts: a compute op first waits
// for every communication op its rank posted before it (as batch_isend_irecv + wait does).
struct Op {
  OpKind kind = OpKind::Forward;
  Pass pass;                    // see OpKind
  Pass backward_pass;           // ForwardBackward only
  bool defers_weights = false;  // Backward only: input gradient now, W(pass) later
  int peer = -1;                // communication ops only: the other rank
};

struct Schedule {
  Method method = Method::OneFOneB;
  int num_ranks = 0;
  int num_stages = 0;  // stages along one micro-batch's path
  int num_micro_batches = 0;
  // DualPipe feeds micro-batches from both ends: direction 0 enters at rank 0, direction 1 at
  // rank PP-1. The other methods have one direction.
  std::vector<int> micro_batch_direction;    // [num_micro_batches]
  std::vector<std::vector<int>> stage_rank;  // [directions][num_stages] -> rank holding the stage
  std::vector<std::vector<Op>> rank_ops;     // [num_ranks][ops in issue order]

  int rank_of(const Pass& p) const { return stage_rank[micro_batch_direction[p.micro_batch]][p.stage]; }
};

// Generators. `pp` is the number of pipeline stages; it is also the number of ranks, except for
// DualPipeV which folds the PP stages onto PP/2 ranks (rank r holds stages r and PP-1-r).
// Each throws Error naming the violated constraint (DualPipe: PP even, micro-batches even and
// >= 2*PP; DualPipeV: PP even, micro-batches >= PP; 1F1B and ZB1P: micro-batches >= PP).
Schedule one_f_one_b_schedule(int pp, int micro_batches);
Schedule zb1p_schedule(int pp, int micro_batches);
Schedule dualpipe_schedule(int pp, int micro_batches);
Schedule dualpipev_schedule(int pp, int micro_batches);
Schedule make_schedule(Method method, int pp, int micro_batches);

// Validation: every micro-batch has exactly one F, one B and one W per stage (a full backward
// counts as B and W), each on the rank holding the stage, in dependency order; every send has
// exactly one matching receive on the right peer; and an event-driven run proves the schedule
// completes, with sends both buffered and rendezvous. Returns every problem found (empty = valid).
std::vector<std::string> find_schedule_problems(const Schedule& schedule);
void validate_schedule(const Schedule& schedule);  // throws Error with the problems

// Per-op costs in arbitrary time units. `backward` is a full backward (input and weights); an
// input-only backward costs backward - weight. `forward_backward` is one overlapped F&B chunk.
struct OpCosts {
  double forward = 1.0;
  double backward = 2.0;
  double weight = 1.0;
  double forward_backward = 3.0;
  double comm_latency = 0.0;  // from the end of the producing op to the data at the receiver
};
void check_costs(const OpCosts& costs);  // throws Error naming the bad cost
double op_cost(const Op& op, const OpCosts& costs);

// How a send completes. Buffered: at once (the data travels on its own). Rendezvous: only once the
// receiver has posted the matching receive (NCCL's behaviour for large messages); stricter.
enum class SendMode { Buffered, Rendezvous };

struct TimedOp {
  int op_index = -1;  // into rank_ops[rank]
  double start = 0, end = 0;
};

struct RankTimeline {
  std::vector<TimedOp> compute;  // compute ops only, in issue order
  double busy = 0;               // sum of compute durations
  double bubble = 0;             // makespan - busy: idle time inside the step
  int peak_activations = 0;      // most passes whose activations are held (F started, W not done)
  int parameter_stages = 0;      // distinct stage parameter sets held, in units of one stage
};

struct Simulation {
  double makespan = 0;
  std::vector<RankTimeline> ranks;
  double bubble = 0;          // the largest rank bubble
  int peak_activations = 0;   // the largest rank peak
  int parameter_stages = 0;   // the largest rank count
};

// Event-driven run of the schedule. Throws Error naming the blocked ops when it cannot complete
// (deadlock) or when an op runs before its inputs are there.
Simulation simulate(const Schedule& schedule, const OpCosts& costs,
                    SendMode send_mode = SendMode::Buffered);

// Table 2 of the report: bubble, parameters (in stage units per rank) and activations (in units
// of one stage of one micro-batch) per rank. DualPipeV shares DualPipe's row with PP = stages.
struct Table2Row {
  double bubble = 0;
  int parameter_stages = 0;
  int activations = 0;
};
Table2Row table2_row(Method method, int pp, const OpCosts& costs);

// Text: one row per rank, time to the right, like Figure 5 of the report.
struct TextTimelineOptions {
  double columns_per_unit = 0;  // 0: wide enough for the longest label of a unit-cost op
  bool color = false;           // ANSI background colours per op kind
};
std::string render_timeline_text(const Schedule& schedule, const Simulation& sim,
                                 const OpCosts& costs, const TextTimelineOptions& options = {});
std::string render_timeline_svg(const Schedule& schedule, const Simulation& sim, const OpCosts& costs);

// Short label of an op: F3, B3, W3 (micro-batch 3 of direction/chunk 0), f3, b3, w3 (direction or
// chunk 1), F3+b5 (an overlapped pair), >F3 / <F3 (send/receive of F3's output) and so on.
std::string op_label(const Schedule& schedule, const Op& op);

// All methods side by side for one PP, micro-batch count and cost set.
struct MethodComparison {
  Method method = Method::OneFOneB;
  std::string refused;  // non-empty: the method refused this request, and why
  int ranks = 0;
  Simulation sim;
  Table2Row formula;
};
std::vector<MethodComparison> compare_methods(int pp, int micro_batches, const OpCosts& costs);
std::string render_comparison_table(int pp, int micro_batches, const OpCosts& costs,
                                    const std::vector<MethodComparison>& rows);

}  // namespace fp8moe::pipeline
