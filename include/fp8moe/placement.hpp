// Expert placement with redundant experts (DeepSeek-V3 §3.4: the most loaded experts get extra
// copies, chosen from load statistics, and the copies are rearranged to balance the GPUs; the
// public form of the algorithm is DeepSeek's EPLB). Given per-layer expert loads and the number of
// physical expert slots, nodes and GPUs, place_experts returns for every MoE layer which logical
// expert each slot holds, the slots of every expert and the replica counts.
//   hierarchical  (groups % nodes == 0) expert groups are packed onto nodes so that a token's
//                 group-limited routing stays inside the nodes it already reaches, the node's
//                 experts are replicated inside the node, and the replicas packed onto its GPUs;
//   global        otherwise: one node, replicas packed onto all GPUs.
// Slot s lives on GPU s / (slots / gpus); GPU g on node g / (gpus / nodes).
//   ExpertPlacement p = place_experts(loads, {.slots = 288, .nodes = 4, .gpus = 32, .groups = 8});
//   PlacementBalance b = placement_balance(loads, p);  // b.overall(): max / mean tokens per GPU
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace fp8moe {

// loads[layer][expert]: tokens (or any non-negative weight) routed to each logical expert.
using ExpertLoads = std::vector<std::vector<double>>;

struct PlacementShape {
  int64_t slots = 0;   // physical expert slots over all GPUs (>= experts)
  int64_t nodes = 1;
  int64_t gpus = 1;    // over all nodes
  int64_t groups = 1;  // expert groups of the router (n_group); 1: no group structure
};

struct ExpertPlacement {
  int64_t layers = 0, experts = 0;
  PlacementShape shape;
  bool hierarchical = false;
  std::vector<std::vector<int32_t>> phy_to_log;               // [layer][slot] logical expert
  std::vector<std::vector<int32_t>> phy_replica;              // [layer][slot] which copy of it
  std::vector<std::vector<std::vector<int32_t>>> log_to_phy;  // [layer][expert] its slots, by copy
  std::vector<std::vector<int32_t>> replicas;                 // [layer][expert] number of copies

  int64_t slots_per_gpu() const { return shape.slots / shape.gpus; }
  int64_t gpu_of_slot(int64_t slot) const { return slot / slots_per_gpu(); }
};

// The placement of `loads` ([layers][experts], every row the same length) on `shape`. Errors
// (fp8moe::Error) name the problem: loads of the wrong shape or negative, fewer slots than
// experts, slots not divisible by the GPUs, GPUs not divisible by the nodes, experts not
// divisible by the groups, groups not divisible by the nodes when hierarchical is forced.
enum class PlacementPolicy : uint8_t { automatic, hierarchical, global };
ExpertPlacement place_experts(const ExpertLoads& loads, const PlacementShape& shape,
                              PlacementPolicy policy = PlacementPolicy::automatic);

// One copy of every expert, experts in order on slots 0..E-1 (E slots): the placement without
// redundant experts, the "before" of a rebalance.
ExpertPlacement identity_placement(int64_t layers, int64_t experts, int64_t nodes, int64_t gpus);

// Tokens per GPU when every expert's tokens are spread evenly over its copies.
struct PlacementBalance {
  std::vector<std::vector<double>> gpu_tokens;  // [layer][gpu]
  std::vector<double> max, mean;                // [layer]
  double ratio(int64_t layer) const;            // max / mean of the layer (1 is perfect)
  // The sum of the layers' maxima over the sum of their means: what the slowest GPU of every MoE
  // layer costs over the balanced step.
  double overall() const;
};
PlacementBalance placement_balance(const ExpertLoads& loads, const ExpertPlacement& p);

// Reads loads from a file: a JSON array of per-layer arrays; JSON lines with an "expert_loads"
// field (fp8moe train's metrics.jsonl; the lines are summed); or plain text, one layer a line,
// numbers separated by spaces or commas.
ExpertLoads read_expert_loads(const std::string& path);

}  // namespace fp8moe
