// Stages of the pipeline: the cost model over the trunk's sublayers and the balanced split
// (include/fp8moe/pipeline_executor.hpp).
#include <algorithm>
#include <charconv>
#include <limits>
#include <sstream>

#include "fp8moe/error.hpp"
#include "fp8moe/pipeline_executor.hpp"

namespace fp8moe::pipeline {

std::string StageSplit::str() const {
  std::string s;
  for (int i = 0; i < stages(); ++i) {
    if (i) s += ',';
    s += std::to_string(size(i));
  }
  return s;
}

namespace {

// Multiply-adds per token of one MLA attention sublayer (the projections, and QK^T and PV over
// seq_len / 2 keys on average under the causal mask) and of one MLP or MoE sublayer.
double attention_cost(const ModelConfig& c) {
  const double D = double(c.hidden_size), H = double(c.num_attention_heads);
  const double q = c.q_lora_rank > 0 ? D * double(c.q_lora_rank) + double(c.q_lora_rank) * H * double(c.qk_head_dim())
                                     : D * H * double(c.qk_head_dim());
  const double kv = D * double(c.kv_lora_rank + c.qk_rope_head_dim) +
                    double(c.kv_lora_rank) * H * double(c.qk_nope_head_dim + c.v_head_dim);
  const double out = H * double(c.v_head_dim) * D;
  const double scores = double(c.seq_len) / 2.0 * H * double(c.qk_head_dim() + c.v_head_dim);
  return q + kv + out + scores;
}

double mlp_cost(const ModelConfig& c, int64_t layer) {
  const double D = double(c.hidden_size);
  if (!c.is_moe_layer(layer)) return 3.0 * D * double(c.intermediate_size);
  return 3.0 * D * double(c.moe_intermediate_size) * double(c.n_shared_experts + c.num_experts_per_tok) +
         D * double(c.n_routed_experts);
}

}  // namespace

StageCosts stage_costs(const ModelConfig& cfg) {
  StageCosts s;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    s.sublayers.push_back(attention_cost(cfg));
    s.sublayers.push_back(mlp_cost(cfg, l));
  }
  const double D = double(cfg.hidden_size), V = double(cfg.vocab_size);
  s.embedding = D;  // a lookup and its scatter-add
  s.head = D * V;
  // The MTP module: eh_proj, one transformer block and the shared head, per depth.
  for (int64_t l = cfg.num_hidden_layers; l < cfg.num_layers_total(); ++l)
    s.head += 2.0 * D * D + attention_cost(cfg) + mlp_cost(cfg, l) + D * V;
  return s;
}

StageSplit balanced_split(const ModelConfig& cfg, int stages) {
  const StageCosts c = stage_costs(cfg);
  const int n = int(c.sublayers.size());
  FP8MOE_CHECK(stages >= 1 && stages <= n, "pipeline: " << stages << " stages need at least as many trunk sublayers; '"
                                                       << cfg.name << "' has " << n << " (" << cfg.num_hidden_layers
                                                       << " layers x attention + MLP/MoE)");
  std::vector<double> prefix(size_t(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[size_t(i) + 1] = prefix[size_t(i)] + c.sublayers[size_t(i)];
  auto cost = [&](int s, int a, int b) {  // stage s running sublayers [a, b)
    return prefix[size_t(b)] - prefix[size_t(a)] + (s == 0 ? c.embedding : 0.0) + (s == stages - 1 ? c.head : 0.0);
  };
  // best[s][i]: the smallest largest-stage cost of sublayers [0, i) in stages [0, s]; ties go to
  // the earlier cut, so the split is a function of the config alone.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(stages), std::vector<double>(size_t(n) + 1, inf));
  std::vector<std::vector<int>> cut(size_t(stages), std::vector<int>(size_t(n) + 1, 0));
  for (int i = 1; i <= n; ++i) best[0][size_t(i)] = cost(0, 0, i);
  for (int s = 1; s < stages; ++s)
    for (int i = s + 1; i <= n; ++i)
      for (int j = s; j < i; ++j) {
        const double v = std::max(best[size_t(s) - 1][size_t(j)], cost(s, j, i));
        if (v < best[size_t(s)][size_t(i)]) {
          best[size_t(s)][size_t(i)] = v;
          cut[size_t(s)][size_t(i)] = j;
        }
      }
  StageSplit split;
  split.first.assign(size_t(stages) + 1, 0);
  split.first[size_t(stages)] = n;
  for (int s = stages - 1, i = n; s > 0; --s) i = split.first[size_t(s)] = cut[size_t(s)][size_t(i)];
  return split;
}

StageSplit parse_split(std::string_view spec, const ModelConfig& cfg, int stages) {
  const int n = int(2 * cfg.num_hidden_layers);
  StageSplit split;
  split.first.push_back(0);
  for (size_t at = 0; at <= spec.size();) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string_view item = spec.substr(at, comma - at);
    int v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    FP8MOE_CHECK(ec == std::errc() && end == item.data() + item.size() && v >= 1,
                 "--pp-split '" << spec << "': '" << item << "' is not a count of sublayers >= 1");
    split.first.push_back(split.first.back() + v);
    at = comma + 1;
  }
  FP8MOE_CHECK(split.stages() == stages, "--pp-split '" << spec << "' gives " << split.stages() << " stages, the schedule has "
                                                        << stages);
  FP8MOE_CHECK(split.first.back() == n, "--pp-split '" << spec << "' covers " << split.first.back()
                                                       << " trunk sublayers, '" << cfg.name << "' has " << n << " ("
                                                       << cfg.num_hidden_layers << " layers x attention + MLP/MoE)");
  return split;
}

StageShard stage_shard(const Schedule& schedule, const StageSplit& split, int rank) {
  FP8MOE_CHECK(split.stages() == schedule.num_stages, "pipeline: the split " << split.str() << " has " << split.stages()
                                                                             << " stages, the schedule " << schedule.num_stages);
  StageShard shard;
  shard.sublayers.assign(size_t(split.first.back()), false);
  shard.embedding = shard.head = false;
  for (const std::vector<int>& direction : schedule.stage_rank)
    for (int s = 0; s < schedule.num_stages; ++s) {
      if (direction[size_t(s)] != rank) continue;
      for (int i = split.first[size_t(s)]; i < split.first[size_t(s) + 1]; ++i) shard.sublayers[size_t(i)] = true;
      shard.embedding = shard.embedding || s == 0;
      shard.head = shard.head || s == schedule.num_stages - 1;
    }
  return shard;
}

int stages_for(Method method, int pp) { return method == Method::DualPipeV ? 2 * pp : pp; }

}  // namespace fp8moe::pipeline
