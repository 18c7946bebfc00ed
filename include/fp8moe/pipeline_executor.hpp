// The pipeline executor: runs one rank's op list of a schedule (fp8moe/schedule.hpp) on the real
// model. The trunk's sublayers (Model::trunk(): attention and MLP/MoE halves) are split into
// stages; stage 0 also runs the embedding, the last stage the final norm, the head and the MTP
// module (their backward at the end of the forward, so a B of the last stage starts from the
// head's gradient). Activations and gradients go between ranks through Comm's isend/irecv on a
// communication stream, posted where the schedule posts them and waited for before the next
// compute op. The paired F&B chunks run their forward and backward halves on two streams
// (paired_chunk.hpp), or serial on one (set_fb_mode), with the same bits.
//
// A rank's model holds the parameters of its stages only (stage_shard below: Model's StageShard),
// or the whole model; a rank computes, and accumulates gradients for, its stages only, and
// sum_gradients() adds the gradients of each parameter over the ranks holding it, in rank order
// (DualPipe's two copies of a stage, the embedding that stage 0 and the MTP module share; a whole
// model: over every rank, the others adding zeros, the same bits).
//   auto split = pipeline::balanced_split(cfg, schedule.num_stages);
//   Model model(cfg, recipe, be, seed, {}, pipeline::stage_shard(schedule, split, pp_rank));
//   pipeline::Executor ex(model, schedule, split, pp_comm);
//   std::vector<StepStats> st = ex.run(tokens, targets, 1.0 / micro_batches);
//   ex.sum_gradients();
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/comm.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/paired_chunk.hpp"
#include "fp8moe/schedule.hpp"

namespace fp8moe::pipeline {

// Which trunk sublayers each stage runs: stage s runs trunk()[first[s], first[s + 1]).
struct StageSplit {
  std::vector<int> first;  // [stages + 1], first[0] = 0, last = trunk size
  int stages() const { return int(first.size()) - 1; }
  int size(int stage) const { return first[size_t(stage) + 1] - first[size_t(stage)]; }
  std::string str() const;  // sublayers per stage: "3,2,3"
};

// Relative cost (multiply-adds per token) of each trunk sublayer, and of the embedding (on stage
// 0) and the head with the MTP module (on the last stage): the balance's cost model.
struct StageCosts {
  std::vector<double> sublayers;
  double embedding = 0, head = 0;
};
StageCosts stage_costs(const ModelConfig& cfg);
// The contiguous split into `stages` non-empty stages whose most expensive stage is cheapest.
// Throws Error when the trunk has fewer sublayers than stages.
StageSplit balanced_split(const ModelConfig& cfg, int stages);
// "3,2,3": sublayers per stage, as --pp-split gives them; throws Error naming what does not fit.
StageSplit parse_split(std::string_view spec, const ModelConfig& cfg, int stages);

// One op as the executor ran it: what it did (kind and passes as in the schedule's Op) and when,
// in seconds from the start of the step. Compute ops also carry their components (each
// sublayer's forward, input and weight backward, the head, waits for communication).
struct Component {
  std::string name;  // "F layers.1.moe", "B layers.0.attn", "W embed", "wait", ...
  double start = 0, end = 0;
};
struct ExecutedOp {
  Op op;
  double start = 0, end = 0;  // communication ops: the post
  double wait = 0;            // compute ops: seconds waiting for the communication posted before
  std::vector<Component> components;
};

enum class DeviceTimes { off, ops, components };

class Executor {
 public:
  // `comm`: the pipeline ranks, rank r running schedule.rank_ops[r] (nullptr: one rank). Throws
  // Error when the split's stages are not the schedule's or the sends between two ranks are not
  // posted in the order their receives are (one message stream per pair of ranks).
  Executor(Model& model, Schedule schedule, StageSplit split, Comm* comm);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  const Schedule& schedule() const;
  const StageSplit& split() const;
  int rank() const;

  // One step over the schedule's micro-batches (tokens/targets [B, S] i32 each, host or backend):
  // gradients of grad_scale * loss added to this rank's stages' parameters. Returns, on every
  // rank, each micro-batch's StepStats as Model::forward_backward gives them (the losses and
  // loads of every stage, gathered over the pipeline ranks): the layers write them on the device
  // into one table for all micro-batches, which the step reads back once, at its end.
  std::vector<StepStats> run(const std::vector<Tensor>& tokens, const std::vector<Tensor>& targets, double grad_scale);
  // Forward only of one micro-batch (evaluation; tokens/targets [B, S] i32) along the stages of
  // the schedule's first direction: on every rank, the StepStats of Model::forward (the main
  // loss bitwise; the balance loss summed by stage), nothing kept. Collective over the pipeline ranks.
  StepStats forward(const Tensor& tokens, const Tensor& targets);
  // Adds the gradients of the trainable parameters over the pipeline ranks holding them, in rank order.
  void sum_gradients();

  // The last run's ops in the order they ran, with their times and components.
  const std::vector<ExecutedOp>& executed() const;

  // The most bytes this rank kept for backward at once during the last run: the trunk's saved
  // state of every pass in flight, with the MTP module's while a head call holds it. At one rank
  // with 1F1B: Model::saved_memory()'s total after a forward_backward.
  int64_t peak_saved_bytes() const;

  // Test hook: the rank throws Error when it reaches op `op_index` of its list (-1: never).
  void fail_at(int op_index);

  // How the paired F&B chunks run (paired_chunk.hpp): overlap (the default) on two streams, or
  // serial on one, in the same order and with the same bits.
  void set_fb_mode(FbMode mode);
  FbMode fb_mode() const;
  // Off by default. ops: the device is synchronized at the end of every compute op, so that the
  // recorded op times are the device's; components: also at the end of every component outside
  // an overlapped chunk (the serial chunk's components then time each half on its own). Costs
  // the overlap between ops (and between components).
  void set_device_times(DeviceTimes times);
  // Steps as CUDA graphs (off by default; where the backend can_capture(), the schedule has one
  // rank, device times are off and the checks are deferred). A step whose micro-batch shapes,
  // target counts, grad_scale, MTP loss weight and F&B mode are those of the step before is
  // recorded once, and every later step with the same ones replays the recording: the inputs are
  // copied into the tensors it reads, the stats table zeroed, and the step's work is one launch.
  // Another step (new shapes or counts) runs as usual and is recorded when it repeats. The bits
  // are those of the steps without graphs. A capture that fails turns graphs off for the
  // executor's life, with the reason in graph_note().
  void set_graphs(bool on);
  // A sublayer's weight gradients on a second stream beside the next sublayer's input gradient
  // (on by default; where W follows its B, outside overlapped F&B chunks and device times):
  // the same bits, the SMs that small GEMMs leave idle used.
  void set_wgrad_stream(bool on);
  int64_t graph_replays() const;  // steps run as replays so far (the recording's own included)
  const std::string& graph_note() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// What pipeline rank `rank` holds of the model: the trunk sublayers of the stages it runs (in
// either direction: DualPipe's rank holds a stage of each), the embedding with stage 0 and the
// head side with the last stage (Model's StageShard: the MTP module's embedding too).
StageShard stage_shard(const Schedule& schedule, const StageSplit& split, int rank);

// The number of ranks and stages a method runs with on `pp` pipeline ranks (DualPipeV: 2 x pp
// stages, rank r holding stages r and 2 pp - 1 - r; the others: pp stages, one per rank).
int stages_for(Method method, int pp);

}  // namespace fp8moe::pipeline
