// The trainer's multi-rank part (trainer_parallel.hpp).
#include "trainer_parallel.hpp"

#include <cstring>

namespace fp8moe {

std::unique_ptr<TrainerParallel> TrainerParallel::make(const ParallelOptions& opt, ModelConfig& cfg) {
  const LaunchInfo launch = launch_info();
  if (launch.size == 1 && opt.ep == 0 && opt.dp <= 1 && opt.ranks_per_node == 0 && opt.max_nodes == 0) return nullptr;
  auto p = std::make_unique<TrainerParallel>();
  p->launch = launch;
  // The layout is a function of the options, the launch and the model: every rank raises the
  // same error before any rank makes a communicator.
  p->layout = make_parallel_layout(opt, launch.size, launch.rank, cfg);
  apply_node_limited_routing(p->layout, cfg);
  select_local_gpu(launch);
  p->world = make_comm(opt.comm);
  p->groups = make_parallel_groups(*p->world, p->layout);
  return p;
}

void TrainerParallel::attach(Model& model, Backend& be, const std::vector<ParamRef>& refs, const AdamWConfig& cfg) {
  if (layout.expert_parallel) model.set_routed_experts(make_expert_parallel(model, *groups.ep, layout));
  zero = std::make_unique<Zero1AdamW>(be, *groups.dp, refs, cfg);
}

void TrainerParallel::sum(Backend& be, std::vector<double>& v) {
  if (v.empty()) return;
  Tensor h = Tensor::host(DType::f64, {int64_t(v.size())});
  std::memcpy(h.view().data, v.data(), v.size() * sizeof(double));
  Tensor d = be.empty(DType::f64, {int64_t(v.size())});
  be.copy(d.view(), h.view());
  groups.dp->all_reduce(d.view(), be.stream());
  be.copy(h.view(), d.view());
  be.synchronize();
  std::memcpy(v.data(), h.view().data, v.size() * sizeof(double));
}

void TrainerParallel::sum(Backend& be, std::vector<std::vector<int64_t>>& loads) {
  std::vector<double> flat;  // exact: counts far below 2^53
  for (const auto& l : loads) flat.insert(flat.end(), l.begin(), l.end());
  sum(be, flat);
  size_t k = 0;
  for (auto& l : loads)
    for (auto& x : l) x = int64_t(flat[k++]);
}

}  // namespace fp8moe
