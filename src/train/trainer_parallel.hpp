// What the trainer does differently on several ranks (--pp/--dp/--ep, under mpirun), kept out of
// the loop in trainer.cpp: the layout and its communicators, the pipeline schedule and its
// executor, the stages and the share of the routed experts this rank's model holds, ZeRO-1,
// the sums of losses and expert loads over the data-parallel ranks, and the checkpoint's moments,
// experts and stages gathered from the shards. Absent (nullptr) for one process without --ep: training as before.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <vector>

#include "fp8moe/model.hpp"
#include "fp8moe/parallel.hpp"
#include "fp8moe/pipeline_executor.hpp"
#include "fp8moe/pipeline_trace.hpp"
#include "fp8moe/zero1.hpp"

namespace fp8moe {

struct TrainerParallel {
  LaunchInfo launch;
  std::unique_ptr<Comm> world;
  ParallelLayout layout;
  ParallelGroups groups;
  std::unique_ptr<Zero1AdamW> zero;
  // --pp > 1: this rank's op lists and stages, and the executor running them (attach).
  std::optional<pipeline::Schedule> schedule;
  pipeline::StageSplit split;
  std::unique_ptr<pipeline::Executor> executor;
  std::shared_ptr<RoutedExperts> experts;  // --ep: the expert-parallel MoE layers
  // Trainable parameters each pipeline rank holds (attach; [pp]), and the whole model's.
  std::vector<int64_t> held_per_stage_rank;
  int64_t whole_trainable = 0;
  ModelConfig model_cfg;  // the model's (attach)
  // --fb; with compare, the summary of the last step of each kind (begin_step) and this step's kind.
  std::string fb = "overlap";
  pipeline::RankSummary fb_compare[3];
  int compare_kind = 0;

  // nullptr for one process without --ep or --pp; otherwise validates the layout and the
  // pipeline schedule of `micro_batches` per data-parallel rank against the world and the model
  // (on every rank, before any work), applies node-limited routing to cfg and makes the GPU of
  // this local rank current.
  static std::unique_ptr<TrainerParallel> make(const ParallelOptions& opt, ModelConfig& cfg, int64_t micro_batches);
  bool rank0() const { return layout.rank == 0; }
  int64_t dp() const { return layout.dp; }
  int64_t dp_rank() const { return layout.dp_rank(); }
  // True on every rank when `mine` is true on any.
  bool any(Backend& be, bool mine);
  // The routed experts this rank's model holds: its expert-parallel share with --ep, else all.
  ExpertShard expert_shard() const;
  // What this rank's model holds of the pipeline stages: its own (--pp), else all.
  StageShard stage_shard() const;
  // After the model is made: its routed experts expert-parallel (--ep), the optimizer sharded
  // (the routed experts' parameters over the expert-data-parallel group), with --pp over this
  // pipeline rank's parameters, the gradient norm the whole model's.
  void attach(Model& model, Backend& be, const std::vector<ParamRef>& refs, const AdamWConfig& cfg);
  // The checkpoint's whole model from the experts' shards: `tensors` holds this rank's (names with
  // ".mlp.experts.<e>." among others); adds those of the other ranks of its expert-parallel
  // group, named by their experts. Collective over every expert-parallel group; `keep` owns the
  // host copies the new views point to.
  void gather_experts(Backend& be, std::map<std::string, TensorView>& tensors, std::vector<Tensor>& keep);
  // The checkpoint's whole model from the pipeline ranks' stages: `tensors` holds this rank's
  // (parameters, "ema." and "optimizer.exp_avg[_sq]." ones, its expert-parallel group's experts
  // gathered); pipeline rank 0 adds those the others hold and it does not. Collective over every
  // pipeline group; `keep` owns the host copies the new views point to.
  void gather_stages(std::map<std::string, TensorView>& tensors, std::vector<Tensor>& keep);
  // Sums over the data-parallel ranks (rank order), in place.
  void sum(Backend& be, std::vector<double>& v);
  void sum(Backend& be, std::vector<std::vector<int64_t>>& loads);
  // The optimizer's bytes per rank beside the ZeRO-1 formula (FP32 master + two moments over dp),
  // into the first step's metrics line (and printed).
  void report_memory(nlohmann::json& memory, bool print) const;
  // The executor's last step: this rank's Chrome trace to `path` with .rankN before its
  // extension; rank 0 gathers every rank's summary and prints it beside the simulator's bubble
  // for the measured op costs and Table 2's formula (when `print`).
  void write_trace(const std::string& path, bool print) const;
  // Around each step's executor run: with --fb compare the steps cycle through three kinds, each
  // with the device synchronized at every op's end: the F&B chunks serial with every component
  // synchronized too (each half's own time), serial, and overlapped; each kind's last summary is
  // kept.
  void begin_step(int64_t step);
  void end_step();
  // --ep: the forward dispatches' traffic per token over every rank (DispatchTraffic), printed by
  // rank 0 beside the report's figures (when `print`). Collective over the world.
  void report_traffic(Backend& be, int64_t hidden, int64_t topk, bool print) const;
};

}  // namespace fp8moe
