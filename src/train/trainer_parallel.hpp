// What the trainer does differently on several ranks (--dp/--ep, under mpirun), kept out of the
// loop in trainer.cpp: the layout and its communicators, the expert-parallel MoE layer, ZeRO-1,
// the sums of losses and expert loads over the data-parallel ranks, and the checkpoint's moments
// gathered from the shards. Absent (nullptr) for one process without --ep: training as before.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "fp8moe/model.hpp"
#include "fp8moe/parallel.hpp"
#include "fp8moe/zero1.hpp"

namespace fp8moe {

struct TrainerParallel {
  LaunchInfo launch;
  std::unique_ptr<Comm> world;
  ParallelLayout layout;
  ParallelGroups groups;
  std::unique_ptr<Zero1AdamW> zero;

  // nullptr for one process without --ep; otherwise validates the layout against the world and
  // the model (on every rank, before any work), applies node-limited routing to cfg and makes
  // the GPU of this local rank current.
  static std::unique_ptr<TrainerParallel> make(const ParallelOptions& opt, ModelConfig& cfg);
  bool rank0() const { return layout.rank == 0; }
  int64_t dp() const { return layout.dp; }
  int64_t dp_rank() const { return layout.rank; }
  // After the model is made: its routed experts expert-parallel (--ep), the optimizer sharded.
  void attach(Model& model, Backend& be, const std::vector<ParamRef>& refs, const AdamWConfig& cfg);
  // Sums over the data-parallel ranks (rank order), in place.
  void sum(Backend& be, std::vector<double>& v);
  void sum(Backend& be, std::vector<std::vector<int64_t>>& loads);
  // The optimizer's bytes per rank beside the ZeRO-1 formula (FP32 master + two moments over dp),
  // into the first step's metrics line (and printed).
  void report_memory(nlohmann::json& memory, bool print) const;
};

}  // namespace fp8moe
