// The trainer's multi-rank part (trainer_parallel.hpp).
#include "trainer_parallel.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <tuple>

#include "fp8moe/pipeline_trace.hpp"

namespace fp8moe {

std::unique_ptr<TrainerParallel> TrainerParallel::make(const ParallelOptions& opt, ModelConfig& cfg,
                                                       int64_t micro_batches) {
  const LaunchInfo launch = launch_info();
  // DualPipeV runs two stages per rank: at --pp 1 both on one rank, its F&B chunks included.
  const bool one_rank_v = opt.schedule == "dualpipev";
  if (launch.size == 1 && opt.ep == 0 && opt.dp <= 1 && opt.pp <= 1 && !one_rank_v && opt.ranks_per_node == 0 &&
      opt.max_nodes == 0 && opt.comm_sms == 0)
    return nullptr;
  auto p = std::make_unique<TrainerParallel>();
  p->launch = launch;
  // The layout and the schedule are functions of the options, the launch and the model: every
  // rank raises the same error before any rank makes a communicator.
  p->layout = make_parallel_layout(opt, launch.size, launch.rank, cfg);
  FP8MOE_CHECK(opt.fb == "overlap" || opt.fb == "serial" || opt.fb == "compare",
               "--fb: expected overlap, serial or compare, got '" << opt.fb << "'");
  p->fb = opt.fb;
  if (p->layout.pp > 1 || one_rank_v) {
    try {
      const pipeline::Method method = pipeline::parse_method(opt.schedule);
      const int stages = pipeline::stages_for(method, int(p->layout.pp));
      p->schedule = pipeline::make_schedule(method, method == pipeline::Method::DualPipeV ? stages : int(p->layout.pp),
                                            int(micro_batches));
      p->split = opt.pp_split.empty() ? pipeline::balanced_split(cfg, stages)
                                      : pipeline::parse_split(opt.pp_split, cfg, stages);
    } catch (const Error& e) {
      FP8MOE_CHECK(false, "--schedule " << opt.schedule << " --pp " << p->layout.pp << " --grad-accum " << micro_batches
                                        << ": " << e.what());
    }
  }
  apply_node_limited_routing(p->layout, cfg);
  select_local_gpu(launch);
  if (opt.comm_sms > 0) {  // NCCL reads them when the communicator is made
    const std::string n = std::to_string(opt.comm_sms);
    setenv("NCCL_MIN_CTAS", n.c_str(), 1);
    setenv("NCCL_MAX_CTAS", n.c_str(), 1);
  }
  p->world = make_comm(opt.comm);
  p->groups = make_parallel_groups(*p->world, p->layout);
  return p;
}

namespace {

// A routed expert's parameter: "...mlp.experts.<e>.<rest>" (the shared expert is mlp.shared_experts).
constexpr std::string_view kExperts = ".mlp.experts.";

}  // namespace

ExpertShard TrainerParallel::expert_shard() const {
  if (!layout.expert_parallel) return {};
  return {layout.first_expert(), layout.experts_per_rank};
}

StageShard TrainerParallel::stage_shard() const {
  if (!schedule) return {};
  return pipeline::stage_shard(*schedule, split, int(layout.pp_rank()));
}

void TrainerParallel::attach(Model& model, Backend& be, const std::vector<ParamRef>& refs, const AdamWConfig& cfg) {
  if (layout.expert_parallel) {
    experts = make_expert_parallel(model, *groups.ep, layout);
    model.set_routed_experts(experts);
  }
  // Something must run kernels to take the SMs: NCCL, or the NVLink expert-parallel kernels.
  FP8MOE_CHECK(layout.comm_sms == 0 || world->name() != "mpi" || (experts && expert_parallel_transport(*experts) == "nvlink"),
               "--comm-sms " << layout.comm_sms << ": the mpi engine stages messages through the host and runs no "
                             "kernels to give SMs to, and the expert-parallel layer does not run on the NVLink "
                             "transport (use --comm nccl, one GPU per rank, or --ep-transport nvlink)");
  if (schedule) {
    executor = std::make_unique<pipeline::Executor>(model, *schedule, split, groups.pp.get());
    executor->set_fb_mode(fb == "overlap" ? pipeline::FbMode::overlap : pipeline::FbMode::serial);
    // FP8MOE_PIPELINE_FAIL_AT=R:K makes world rank R fail at op K of every step: how the tests
    // check that the other ranks stop with an error instead of waiting.
    if (const char* at = std::getenv("FP8MOE_PIPELINE_FAIL_AT")) {
      int r = -1, k = -1;
      FP8MOE_CHECK(std::sscanf(at, "%d:%d", &r, &k) == 2, "FP8MOE_PIPELINE_FAIL_AT='" << at << "': expected RANK:OP");
      if (r == int(layout.rank)) executor->fail_at(k);
    }
  }
  std::vector<bool> expert;
  for (const ParamRef& r : refs) expert.push_back(layout.expert_parallel && r.name.find(kExperts) != std::string::npos);
  zero = std::make_unique<Zero1AdamW>(be, *groups.dp, refs, cfg, layout.expert_parallel ? groups.edp.get() : nullptr,
                                      expert);
  model_cfg = model.config();
  // Each trainable parameter counted once over the pipeline ranks: on the lowest holding it.
  // The routed experts count ep times (the other ranks of the expert-parallel group hold the others).
  const int64_t ep = layout.expert_parallel ? layout.ep : 1;
  int64_t mine = 0, counted_numel = 0;
  std::vector<bool> counted;
  std::vector<StageShard> shards;
  for (int64_t r = 0; schedule && r < layout.pp; ++r) shards.push_back(pipeline::stage_shard(*schedule, split, int(r)));
  for (size_t i = 0; i < refs.size(); ++i) {
    bool lowest = true;
    for (int64_t r = 0; r < int64_t(shards.size()) && r < layout.pp_rank(); ++r)
      lowest = lowest && !shards[size_t(r)].holds(model.config(), refs[i].name);
    counted.push_back(lowest);
    mine += refs[i].value.numel();
    if (lowest) counted_numel += refs[i].value.numel() * (expert[i] ? ep : 1);
  }
  if (schedule) zero->count_norm_over(*groups.pp, counted);
  held_per_stage_rank.clear();
  whole_trainable = 0;
  const int64_t pair[2] = {mine, counted_numel};
  const auto all = groups.pp->exchange(std::string(reinterpret_cast<const char*>(pair), sizeof pair));
  for (const std::string& b : all) {
    int64_t v[2];
    std::memcpy(v, b.data(), sizeof v);
    held_per_stage_rank.push_back(v[0]);
    whole_trainable += v[1];
  }
}

void TrainerParallel::gather_stages(std::map<std::string, TensorView>& tensors, std::vector<Tensor>& keep) {
  if (!schedule) return;
  const StageShard first = pipeline::stage_shard(*schedule, split, 0);
  // A checkpoint name's parameter: the name without its "ema." or "optimizer.exp_avg[_sq]." prefix.
  auto parameter = [](std::string_view n) {
    for (std::string_view p : {"ema.", "optimizer.exp_avg.", "optimizer.exp_avg_sq."})
      if (n.starts_with(p)) return n.substr(p.size());
    return n;
  };
  // This rank's tensors that pipeline rank 0 lacks, as records: name length, name, dtype, ndim,
  // shape, bytes.
  std::string mine;
  auto put = [&](const void* p, size_t n) { mine.append(static_cast<const char*>(p), n); };
  if (layout.pp_rank() != 0)
    for (const auto& [name, t] : tensors) {
      if (first.holds(model_cfg, parameter(name))) continue;
      const uint64_t len = name.size(), bytes = uint64_t(t.nbytes());
      const int32_t dt = int32_t(t.dtype), nd = t.ndim;
      FP8MOE_CHECK(t.device == Device::cpu, "checkpoint: " << name << " is not a host tensor");
      put(&len, sizeof len);
      put(name.data(), name.size());
      put(&dt, sizeof dt);
      put(&nd, sizeof nd);
      for (int d = 0; d < nd; ++d) put(&t.shape[d], sizeof(int64_t));
      put(&bytes, sizeof bytes);
      put(t.data, bytes);
    }
  const auto all = groups.pp->exchange(mine);
  if (layout.pp_rank() != 0) return;
  for (const std::string& b : all) {
    size_t at = 0;
    auto get = [&](void* p, size_t n) {
      std::memcpy(p, b.data() + at, n);
      at += n;
    };
    while (at < b.size()) {
      uint64_t len = 0, bytes = 0;
      int32_t dt = 0, nd = 0;
      get(&len, sizeof len);
      std::string name(b.data() + at, len);
      at += len;
      get(&dt, sizeof dt);
      get(&nd, sizeof nd);
      std::vector<int64_t> shape(static_cast<size_t>(nd));
      for (auto& d : shape) get(&d, sizeof d);
      get(&bytes, sizeof bytes);
      if (tensors.count(name)) {  // a parameter two pipeline ranks hold: the lower rank's, the same
        at += bytes;
        continue;
      }
      TensorView like;
      like.dtype = DType(dt);
      like.ndim = nd;
      for (int d = nd; d-- > 0;) {
        like.shape[size_t(d)] = shape[size_t(d)];
        like.strides[size_t(d)] = d + 1 < nd ? like.strides[size_t(d) + 1] * like.shape[size_t(d) + 1] : 1;
      }
      keep.push_back(Tensor::host_like(like));
      FP8MOE_CHECK(keep.back().view().nbytes() == bytes, "checkpoint: " << name << " from another pipeline rank is "
                                                                          << bytes << " bytes for " << like.str());
      get(keep.back().view().data, bytes);
      tensors[name] = keep.back().view();
    }
  }
}

void TrainerParallel::gather_experts(Backend& be, std::map<std::string, TensorView>& tensors, std::vector<Tensor>& keep) {
  if (!layout.expert_parallel || layout.ep == 1) return;
  const int64_t El = layout.experts_per_rank, first = layout.first_expert(), P = layout.ep;
  // This rank's expert tensors by (prefix, local expert, rest): the same order on every rank.
  std::map<std::tuple<std::string, int64_t, std::string>, TensorView> mine;
  for (const auto& [name, t] : tensors) {
    const size_t at = name.find(kExperts);
    if (at == std::string::npos) continue;
    const size_t e0 = at + kExperts.size(), e1 = name.find('.', e0);
    const int64_t e = std::stoll(name.substr(e0, e1 - e0));
    FP8MOE_CHECK(e >= first && e < first + El, "checkpoint: " << name << " is not among this rank's routed experts ["
                                                              << first << ", " << first + El << ")");
    mine[{name.substr(0, e0), e - first, name.substr(e1)}] = t;
  }
  for (const auto& [key, t] : mine) {
    const auto& [prefix, local, rest] = key;
    const int64_t n = t.numel();
    const size_t bytes = size_t(n) * dtype_size(t.dtype);
    Tensor send = be.empty(t.dtype, {n}), all = be.empty(t.dtype, {P * n});
    be.copy(send.view(), TensorView(t.data, t.dtype, {n}, t.device));
    groups.ep->all_gather(send.view(), all.view(), be.stream());
    const Tensor host = be.to_host(all);
    for (int64_t r = 0; r < P; ++r) {
      if (r == layout.ep_rank()) continue;
      keep.push_back(Tensor::host_like(t));
      std::memcpy(keep.back().view().data, static_cast<const char*>(host.view().data) + size_t(r) * bytes, bytes);
      tensors[prefix + std::to_string(r * El + local) + rest] = keep.back().view();
    }
  }
}

namespace {

void sum_over(Comm& comm, Backend& be, std::vector<double>& v) {
  if (v.empty()) return;
  Tensor h = Tensor::host(DType::f64, {int64_t(v.size())});
  std::memcpy(h.view().data, v.data(), v.size() * sizeof(double));
  Tensor d = be.empty(DType::f64, {int64_t(v.size())});
  be.copy(d.view(), h.view());
  comm.all_reduce(d.view(), be.stream());
  be.copy(h.view(), d.view());
  be.synchronize();
  std::memcpy(v.data(), h.view().data, v.size() * sizeof(double));
}

}  // namespace

void TrainerParallel::sum(Backend& be, std::vector<double>& v) { sum_over(*groups.dp, be, v); }

void TrainerParallel::report_traffic(Backend& be, int64_t hidden, int64_t topk, bool print) const {
  if (!experts) return;
  const DispatchTraffic t = dispatch_traffic(*experts);
  std::vector<double> v{double(t.tokens), double(t.token_nodes), double(t.cross_node_rows), double(t.in_node_rows),
                        double(t.one_hop_cross_rows), double(t.combine_cross_node_rows), double(t.combine_in_node_rows)};
  sum_over(*world, be, v);  // exact: counts far below 2^53
  if (!print || !rank0() || v[0] == 0) return;
  const double n = v[0], row = double(hidden + hidden / 128 * 4);  // FP8 row and its 1x128 scales
  std::printf("expert-parallel dispatch, %lld tokens x MoE layers (forward, every rank): per token %.2f nodes reached "
              "(%.2f experts per node), %.2f rows across nodes and %.2f inside (%.0f and %.0f bytes of FP8 rows); one "
              "hop would send %.2f across. The report: at most 4 nodes, 3.2 experts per node on average\n",
              (long long)n, v[1] / n, double(topk) * n / v[1], v[2] / n, v[3] / n, v[2] / n * row, v[3] / n * row,
              v[4] / n);
  std::printf("expert-parallel combine (forward, every rank): per token %.2f rows across nodes and %.2f inside (%.0f and "
              "%.0f bytes of BF16 rows, one per slot)\n",
              v[5] / n, v[6] / n, v[5] / n * 2 * double(hidden), v[6] / n * 2 * double(hidden));
}

bool TrainerParallel::any(Backend& be, bool mine) {
  Tensor d = be.zeros(DType::f64, {1});
  if (mine) {
    Tensor h = Tensor::host(DType::f64, {1});
    h.ptr<double>()[0] = 1;
    be.copy(d.view(), h.view());
  }
  world->all_reduce(d.view(), be.stream());
  return be.to_host(d).ptr<double>()[0] > 0;
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
  // The whole model's trainable parameters: the replicated ones and every rank's experts.
  const int64_t held = zero->numel(), experts = zero->expert_numel();
  // With pipeline stages, the sum over the pipeline ranks of what each holds first (attach).
  const int64_t whole = schedule ? whole_trainable : held - experts + experts * (layout.expert_parallel ? layout.ep : 1);
  const double n = double(whole);
  const double moment_bytes = zero->config().moments == MomentPrecision::bf16 ? 2.0 : 4.0;
  // Bytes per parameter of the whole model; a pipeline rank's share of the parameters with --pp.
  const double share = schedule ? double(held) / n : 1.0;
  const double formula = (4.0 + 2.0 * moment_bytes) / double(layout.dp) * share;
  memory["zero1"] = {{"dp", layout.dp},
                     {"ep", layout.expert_parallel ? layout.ep : 0},
                     {"parameters", whole},
                     {"parameters_held", held},
                     {"expert_parameters_held", experts},
                     {"master_shard", m.master},
                     {"moments_shard", m.moments},
                     {"gradient_shard", m.gradient_shard},
                     {"gradient_bucket", m.bucket},
                     {"optimizer_bytes_per_parameter", double(m.master + m.moments) / n},
                     {"formula_bytes_per_parameter", formula}};
  if (schedule) memory["zero1"]["parameters_held_per_pipeline_rank"] = held_per_stage_rank;
  if (print && schedule) {
    std::printf("pipeline ranks hold their stages' parameters only, of the %lld trainable:", (long long)whole);
    for (size_t r = 0; r < held_per_stage_rank.size(); ++r)
      std::printf(" rank %zu %lld (%.1f%%)", r, (long long)held_per_stage_rank[r],
                  100.0 * double(held_per_stage_rank[r]) / double(whole));
    std::printf("\n");
  }
  if (print)
    std::printf("ZeRO-1 over %lld ranks: master weights and moments %.3f bytes per parameter per rank (formula "
                "(4 + 2 x %.0f) / %lld x %.3f = %.3f); this rank holds %lld of the %lld parameters (routed experts %lld), "
                "their weights 4, gradients 4 and the gradient buckets %.3f bytes per parameter held\n",
                (long long)layout.dp, double(m.master + m.moments) / n, moment_bytes, (long long)layout.dp, share, formula,
                (long long)held, (long long)whole, (long long)experts, double(m.bucket) / double(held));
}

}  // namespace fp8moe

namespace fp8moe {

void TrainerParallel::begin_step(int64_t step) {
  if (!executor || fb != "compare") return;
  compare_kind = int(step % 3);
  executor->set_fb_mode(compare_kind == 2 ? pipeline::FbMode::overlap : pipeline::FbMode::serial);
  executor->set_device_times(compare_kind == 0 ? pipeline::DeviceTimes::components : pipeline::DeviceTimes::ops);
}

void TrainerParallel::end_step() {
  if (executor && fb == "compare") fb_compare[compare_kind] = pipeline::summarize(executor->executed());
}

void TrainerParallel::write_trace(const std::string& path, bool print) const {
  if (!executor) return;
  const std::filesystem::path p(path);
  const std::filesystem::path mine = p.parent_path() / (p.stem().string() + ".rank" + std::to_string(layout.rank) +
                                                        (p.has_extension() ? p.extension().string() : ".json"));
  {
    std::ofstream out(mine);
    out << pipeline::chrome_trace(*schedule, executor->rank(), executor->executed());
    if (!out) throw IoError("--trace: writing '" + mine.string() + "' failed");
  }
  // This step's, and with --fb compare the last step's of each kind.
  const pipeline::RankSummary mine_s[4] = {pipeline::summarize(executor->executed()), fb_compare[0], fb_compare[1],
                                           fb_compare[2]};
  const auto all = world->exchange(std::string(reinterpret_cast<const char*>(mine_s), sizeof mine_s));
  if (!print) return;
  std::vector<pipeline::RankSummary> ranks, halves, serial, overlapped;
  for (const std::string& b : all) {
    pipeline::RankSummary x[4];
    std::memcpy(x, b.data(), sizeof x);
    ranks.push_back(x[0]), halves.push_back(x[1]), serial.push_back(x[2]), overlapped.push_back(x[3]);
  }
  std::printf("pipeline %s, %lld ranks x dp %lld, %d micro-batches, stages %s; the last step, ms:\n",
              std::string(pipeline::method_name(schedule->method)).c_str(), (long long)layout.pp, (long long)layout.dp,
              schedule->num_micro_batches, split.str().c_str());
  std::printf("rank     step     busy     wait   bubble\n");
  double bubble = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const auto& x = ranks[r];
    std::printf("%4zu %8.2f %8.2f %8.2f %8.2f\n", r, 1e3 * x.step, 1e3 * x.busy, 1e3 * x.wait, 1e3 * x.bubble);
    bubble = std::max(bubble, x.bubble);
  }
  const pipeline::OpCosts c = pipeline::measured_costs(ranks);
  std::printf("measured op costs, ms: F %.3f, B %.3f, W %.3f, F&B %.3f\n", 1e3 * c.forward, 1e3 * c.backward,
              1e3 * c.weight, 1e3 * c.forward_backward);
  const std::string traces =
      (p.parent_path() / (p.stem().string() + ".rank*" + (p.has_extension() ? p.extension().string() : ".json"))).string();
  // The mean costs can fall outside the simulator's domain (B <= W where the stages differ: a
  // full B of a short stage against the W of a long one): then the comparison is left out.
  try {
    const double sim = pipeline::simulate(*schedule, c).bubble;
    const double formula = pipeline::table2_row(schedule->method, schedule->num_stages, c).bubble;
    std::printf("bubble, ms: measured %.2f (the largest over ranks), simulated %.2f, Table 2 %.2f; traces %s\n",
                1e3 * bubble, 1e3 * sim, 1e3 * formula, traces.c_str());
  } catch (const Error& e) {
    std::printf("bubble, ms: measured %.2f (the largest over ranks); not simulated: %s; traces %s\n", 1e3 * bubble,
                e.what(), traces.c_str());
  }
  // The paired chunks: each rank's mean chunk time against its halves' (serial with device times:
  // each half's own device time).
  auto per_chunk = [](double t, const pipeline::RankSummary& x) { return 1e3 * t / x.forward_backwards; };
  for (size_t r = 0; r < ranks.size(); ++r) {
    const auto& x = ranks[r];
    if (x.forward_backwards == 0) continue;
    if (fb != "compare") {
      std::printf("F&B chunks, rank %zu (%s): %d, %.3f ms each; their halves' components: forward %.3f + backward %.3f ms\n",
                  r, fb.c_str(), x.forward_backwards, per_chunk(x.forward_backward, x), per_chunk(x.fb_forward_half, x),
                  per_chunk(x.fb_backward_half, x));
      continue;
    }
    const auto &h = halves[r], &a = serial[r], &o = overlapped[r];
    if (h.forward_backwards == 0 || a.forward_backwards == 0 || o.forward_backwards == 0) continue;
    const double sum = per_chunk(h.fb_forward_half + h.fb_backward_half, h), one = per_chunk(a.forward_backward, a),
                 two = per_chunk(o.forward_backward, o);
    std::printf("F&B chunks, rank %zu: %d per step; overlapped %.3f ms against serial %.3f ms (%.3fx) and against its "
                "halves run alone, forward %.3f + backward %.3f = %.3f ms (%.3fx)\n",
                r, o.forward_backwards, two, one, two / one, per_chunk(h.fb_forward_half, h), per_chunk(h.fb_backward_half, h),
                sum, two / sum);
  }
}

}  // namespace fp8moe
