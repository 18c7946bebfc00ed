// The parallel layout of a training run: validation of --dp/--ep/--ranks-per-node/--max-nodes
// against the world and the model, node-limited routing, and the sub-communicators
// (include/fp8moe/parallel.hpp). Tested by tests/parallel/test_parallel_layout.cpp.
#include <algorithm>
#include <sstream>

#include "fp8moe/error.hpp"
#include "fp8moe/parallel.hpp"

namespace fp8moe {

std::string ParallelLayout::str() const {
  std::ostringstream o;
  o << "world " << world << " = ";
  if (pp > 1) o << "pp " << pp << " x ";
  o << "dp " << dp;
  if (expert_parallel)
    o << ", ep " << ep << " (" << experts_per_rank << " of " << experts << " routed experts per rank, each on "
      << dp / ep << " rank" << (dp / ep > 1 ? "s" : "") << "), " << nodes << " node" << (nodes > 1 ? "s" : "")
      << " of " << ranks_per_node << " rank" << (ranks_per_node > 1 ? "s" : "") << " per group, tokens to at most "
      << max_nodes;
  return o.str();
}

ParallelLayout make_parallel_layout(const ParallelOptions& opt, int64_t world, int64_t rank, const ModelConfig& cfg) {
  FP8MOE_CHECK(world >= 1 && rank >= 0 && rank < world, "parallel layout: rank " << rank << " of " << world);
  ParallelLayout l;
  l.world = world;
  l.rank = rank;
  FP8MOE_CHECK(opt.pp >= 1, "--pp must be >= 1, got " << opt.pp);
  l.pp = opt.pp;
  FP8MOE_CHECK(world % l.pp == 0, "--pp " << l.pp << " must divide the world size " << world << " (world = pp x dp)");
  FP8MOE_CHECK(opt.dp >= 0, "--dp must be >= 1 (0: the world size / --pp), got " << opt.dp);
  l.dp = opt.dp == 0 ? world / l.pp : opt.dp;
  FP8MOE_CHECK(world % l.dp == 0, "--dp " << l.dp << " must divide the world size " << world << " (world = pp x dp)");
  FP8MOE_CHECK(world == l.pp * l.dp, "--pp " << l.pp << " x --dp " << l.dp << " = " << l.pp * l.dp
                                             << " ranks, the world has " << world << " (world = pp x dp)");
  FP8MOE_CHECK(opt.ep >= 0, "--ep must be >= 1 (0: no expert parallelism), got " << opt.ep);
  l.expert_parallel = opt.ep > 0;
  l.ep = std::max<int64_t>(opt.ep, 1);
  l.experts = cfg.n_routed_experts;
  FP8MOE_CHECK(l.dp % l.ep == 0, "--ep " << l.ep << " must divide --dp " << l.dp);
  FP8MOE_CHECK(l.experts % l.ep == 0, "--ep " << l.ep << " must divide the routed experts (n_routed_experts = "
                                              << l.experts << " in '" << cfg.name << "')");
  l.experts_per_rank = l.experts / l.ep;
  FP8MOE_CHECK(opt.ep_transport == "comm" || opt.ep_transport == "nvlink" || opt.ep_transport == "auto",
               "--ep-transport must be comm, nvlink or auto, got '" << opt.ep_transport << "'");
  l.ep_transport = opt.ep_transport;
  FP8MOE_CHECK(opt.ranks_per_node >= 0, "--ranks-per-node must be >= 1 (0: one node), got " << opt.ranks_per_node);
  const int64_t rpn = opt.ranks_per_node == 0 ? world : opt.ranks_per_node;
  FP8MOE_CHECK(world % rpn == 0, "--ranks-per-node " << rpn << " must divide the world size " << world);
  if (l.ep > rpn) {
    FP8MOE_CHECK(l.ep % rpn == 0, "--ranks-per-node " << rpn << " must divide --ep " << l.ep
                                                      << " (an expert-parallel group spans whole nodes)");
    l.ranks_per_node = rpn;
    l.nodes = l.ep / rpn;
  } else {
    FP8MOE_CHECK(rpn % l.ep == 0, "--ep " << l.ep << " must divide --ranks-per-node " << rpn
                                          << " (an expert-parallel group inside one node)");
    l.ranks_per_node = l.ep;
    l.nodes = 1;
  }
  FP8MOE_CHECK(opt.comm_sms == 0 || (opt.comm_sms >= 2 && opt.comm_sms <= 256 && opt.comm_sms % 2 == 0),
               "--comm-sms must be even in 2..256 (the NVLink kernels run num_sms / 2 channels; 0: the transport's "
               "default), got " << opt.comm_sms);
  l.comm_sms = opt.comm_sms;
  FP8MOE_CHECK(opt.max_nodes >= 0, "--max-nodes must be >= 1 (0: min(4, nodes)), got " << opt.max_nodes);
  l.max_nodes = opt.max_nodes == 0 ? std::min<int64_t>(4, l.nodes) : opt.max_nodes;
  FP8MOE_CHECK(l.max_nodes <= l.nodes, "--max-nodes " << l.max_nodes << " is larger than the nodes of an expert-parallel group ("
                                                      << l.nodes << " = --ep " << l.ep << " / --ranks-per-node "
                                                      << l.ranks_per_node << ")");
  if (l.nodes > 1) {
    const int64_t reach = l.max_nodes * (l.experts / l.nodes);
    FP8MOE_CHECK(cfg.num_experts_per_tok <= reach, "--max-nodes " << l.max_nodes << ": " << l.max_nodes << " nodes of "
                                                                  << l.experts / l.nodes << " experts cannot hold top-k = "
                                                                  << cfg.num_experts_per_tok);
  }
  return l;
}

void apply_node_limited_routing(const ParallelLayout& l, ModelConfig& cfg) {
  if (!l.expert_parallel || l.nodes <= 1) return;
  cfg.n_group = l.nodes;
  cfg.topk_group = l.max_nodes;
}

ParallelGroups make_parallel_groups(Comm& world, const ParallelLayout& l) {
  FP8MOE_CHECK(world.size() == l.world && world.rank() == l.rank,
               "parallel groups: the communicator is rank " << world.rank() << " of " << world.size()
                                                            << ", the layout rank " << l.rank << " of " << l.world);
  ParallelGroups g;
  g.dp = world.split(int(l.pp_rank()), int(l.rank));
  g.pp = world.split(int(l.dp_rank()), int(l.pp_rank()));
  g.ep = world.split(int(l.ep_group()), int(l.ep_rank()));
  g.edp = world.split(int(l.pp_rank() * l.ep + l.ep_rank()), int(l.ep_group()));
  return g;
}

}  // namespace fp8moe
