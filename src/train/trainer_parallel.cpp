// The trainer's multi-rank part (trainer_parallel.hpp).
#include "trainer_parallel.hpp"

#include <cstdio>
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

namespace fp8moe {

void TrainerParallel::report_memory(nlohmann::json& memory, bool print) const {
  const Zero1AdamW::Memory m = zero->memory();
  const double n = double(zero->numel());
  const double moment_bytes = zero->config().moments == MomentPrecision::bf16 ? 2.0 : 4.0;
  const double formula = (4.0 + 2.0 * moment_bytes) / double(layout.dp);  // bytes per parameter
  memory["zero1"] = {{"dp", layout.dp},
                     {"parameters", zero->numel()},
                     {"master_shard", m.master},
                     {"moments_shard", m.moments},
                     {"gradient_shard", m.gradient_shard},
                     {"gradient_bucket", m.bucket},
                     {"optimizer_bytes_per_parameter", double(m.master + m.moments) / n},
                     {"formula_bytes_per_parameter", formula}};
  if (print)
    std::printf("ZeRO-1 over %lld ranks: master weights and moments %.3f bytes per parameter per rank (formula "
                "(4 + 2 x %.0f) / %lld = %.3f); weights 4, gradients 4 and the gradient bucket %.3f, whole\n",
                (long long)layout.dp, double(m.master + m.moments) / n, moment_bytes, (long long)layout.dp, formula,
                double(m.bucket) / n);
}

}  // namespace fp8moe
