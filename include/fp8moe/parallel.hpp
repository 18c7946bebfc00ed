// The parallel layout of a training run (DeepSeek-V3 §3.2): world = pp x dp ranks, pipeline rank
// p holding the dp consecutive ranks [p * dp, (p + 1) * dp) (include/fp8moe/pipeline_executor.hpp
// runs the stages); inside each, expert parallelism shards each MoE layer's routed experts over `ep` consecutive ranks
// inside the data-parallel dimension (rank r holds experts [(r % ep) * E / ep, ...)); everything
// else is replicated; each expert is replicated over dp / ep ranks (its expert-data-parallel
// group). Nodes are `ranks_per_node` consecutive ranks; routing is node-limited to `max_nodes`
// nodes per token (the report: 4) by the model's group routing with one group per node.
//   auto layout = fp8moe::make_parallel_layout(opts, comm->size(), comm->rank(), cfg);  // throws
//   fp8moe::apply_node_limited_routing(layout, cfg);
//   auto groups = fp8moe::make_parallel_groups(*comm, layout);
//   model.set_routed_experts(fp8moe::make_expert_parallel(model, *groups.ep, layout));
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "fp8moe/comm.hpp"
#include "fp8moe/config.hpp"

namespace fp8moe {

class Model;
class RoutedExperts;

struct ParallelOptions {
  int64_t pp = 1;              // pipeline ranks (DualPipeV: 2 x pp stages, two per rank)
  std::string schedule = "1f1b";  // 1f1b | zb1p | dualpipe | dualpipev (fp8moe/schedule.hpp);
                                  // dualpipev also at pp 1 (its two stages on one rank)
  std::string pp_split;        // trunk sublayers per stage, "3,2,..."; empty: balanced by cost
  int64_t dp = 0;              // data-parallel ranks; 0: the world size / pp
  int64_t ep = 0;              // expert-parallel ranks; 0: the routed experts run in each process
                               // as without a layout; >= 1: the expert-parallel layer (FP8
                               // dispatch, BF16 combine) over ep ranks, 1 included
  int64_t ranks_per_node = 0;  // 0: every rank of an expert-parallel group on one node
  int64_t max_nodes = 0;       // nodes a token may reach; 0: min(4, nodes), the report's 4
  std::string comm = "auto";   // mpi | nccl | auto (comm.hpp)
  // How the expert-parallel layer moves its rows: "comm" (the communicator's all_to_all_v, any
  // backend), "nvlink" (the peer-memory kernels of src/cuda/ep/: CUDA sm_90 ranks of one host,
  // one node), "auto" (nvlink where every rank of the group can, else comm).
  std::string ep_transport = "auto";
  // The paired F&B chunks of DualPipe and DualPipeV (paired_chunk.hpp): overlap (two streams),
  // serial (one), or compare (steps in turn serial with each half timed alone, serial, and
  // overlapped, the same bits; the trace summary prints the chunk times).
  std::string fb = "overlap";
  // SMs given to communication kernels; 0: each transport's default. Even, 2..256. It reaches
  // ParallelLayout::comm_sms, which sets the CTAs of NCCL's kernels (NCCL_MIN_CTAS =
  // NCCL_MAX_CTAS = n, one CTA per SM, before the communicator is made) and is the num_sms
  // (blocks of each kernel, num_sms / 2 channels) of the NVLink expert-parallel kernels
  // (src/cuda/ep, EpConfig::num_sms). Refused where neither runs: the MPI engine (it stages
  // through the host) without the NVLink transport.
  int64_t comm_sms = 0;
};

struct ParallelLayout {
  int64_t world = 1, rank = 0;
  int64_t pp = 1, dp = 1, ep = 1;
  bool expert_parallel = false;   // ParallelOptions::ep >= 1
  int64_t ranks_per_node = 1;     // within an expert-parallel group: min(option, ep)
  int64_t nodes = 1;              // nodes of one expert-parallel group (ep / ranks_per_node)
  int64_t max_nodes = 1;
  int64_t experts = 0, experts_per_rank = 0;
  std::string ep_transport = "comm";  // ParallelOptions::ep_transport, validated
  int64_t comm_sms = 0;           // ParallelOptions::comm_sms
  int64_t pp_rank() const { return rank / dp; }         // pipeline rank
  int64_t dp_rank() const { return rank % dp; }         // place inside the data-parallel group
  int64_t ep_rank() const { return rank % ep; }         // place inside the expert-parallel group
  int64_t ep_group() const { return rank / ep; }        // which expert-parallel group
  int64_t first_expert() const { return ep_rank() * experts_per_rank; }
  std::string str() const;
};

// Validates the options against the world and the model; throws fp8moe::Error naming the option
// and the value it needs. A pure function of its arguments: every rank raises the same error
// before any work.
ParallelLayout make_parallel_layout(const ParallelOptions& opt, int64_t world, int64_t rank, const ModelConfig& cfg);
// Node-limited routing: with nodes > 1, the model's group routing with one group per node
// (n_group = nodes, topk_group = max_nodes); unchanged otherwise.
void apply_node_limited_routing(const ParallelLayout& layout, ModelConfig& cfg);

// The sub-communicators of a layout (Comm::split; collective over `world`).
struct ParallelGroups {
  std::unique_ptr<Comm> dp;   // the data-parallel ranks of this pipeline rank
  std::unique_ptr<Comm> pp;   // the pipeline ranks of this data-parallel rank, ordered by pp_rank
  std::unique_ptr<Comm> ep;   // this rank's expert-parallel group, ordered by ep_rank
  std::unique_ptr<Comm> edp;  // the ranks holding the same experts (expert-data-parallel)
};
ParallelGroups make_parallel_groups(Comm& world, const ParallelLayout& layout);

// The expert-parallel routed experts of every MoE layer of `model` over `ep` (layout.ep ranks),
// moving their rows as layout.ep_transport says (collective over ep; "nvlink" where it cannot be:
// an fp8moe::Error on every rank).
std::shared_ptr<RoutedExperts> make_expert_parallel(Model& model, Comm& ep, const ParallelLayout& layout);

// What this rank's forward dispatches sent since make_expert_parallel, summed over MoE layers:
// its tokens, the nodes they reached (distinct nodes of each token's experts), the rows sent
// over a link between nodes and inside a node (DispatchRoute), and the rows a one-hop dispatch
// would have sent across nodes (one per token and rank on another node) for comparison; and the
// BF16 rows its forward combines sent back across nodes and inside them (CombineRoute: one per
// slot, so as many across as one hop sends).
struct DispatchTraffic {
  int64_t tokens = 0, token_nodes = 0, cross_node_rows = 0, in_node_rows = 0, one_hop_cross_rows = 0;
  int64_t combine_cross_node_rows = 0, combine_in_node_rows = 0;
};
// Of an object made by make_expert_parallel (throws Error otherwise).
DispatchTraffic dispatch_traffic(const RoutedExperts& expert_parallel);
// The transport it moves its rows with (layout.ep_transport resolved): "comm" | "nvlink".
std::string expert_parallel_transport(const RoutedExperts& expert_parallel);

}  // namespace fp8moe
