// The deployment simulator (deploy_sim.hpp).
#include "serve/deploy_sim.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "fp8moe/error.hpp"
#include "fp8moe/placement.hpp"

namespace fp8moe::serve {

DeployUnit report_prefill_unit() {
  DeployUnit u;
  u.name = "report prefill (TP4+SP, DP8, EP32)";
  u.nodes = 4;
  u.attention_tp = 4;
  u.slots = 256 + 32;  // 8 experts + 1 redundant per GPU
  return u;
}

DeployUnit report_decode_unit() {
  DeployUnit u;
  u.name = "report decode (TP4+SP, DP80, EP320)";
  u.decode = true;
  u.nodes = 40;
  u.attention_tp = 4;
  u.slots = 320;  // one expert per GPU; 64 GPUs hold the redundant and the shared experts
  u.shared_as_routed = true;
  u.context = 4989;
  u.max_nodes = 0;
  return u;
}

DeployUnit production_prefill_unit() {
  DeployUnit u = report_prefill_unit();
  u.name = "production prefill (DP32, EP32)";
  u.attention_tp = 1;
  u.published_tokens_per_node_s = 73.7e3;
  u.published_note = "input tokens, 56.3% of them cache hits";
  return u;
}

DeployUnit production_decode_unit() {
  DeployUnit u = report_decode_unit();
  u.name = "production decode (DP144, EP144)";
  u.nodes = 18;
  u.attention_tp = 1;
  u.slots = 256 + 32;  // 2 routed experts per GPU, the shared one on every GPU
  u.shared_as_routed = false;
  u.published_tokens_per_node_s = 14.8e3;
  u.published_note = "output tokens, 20-22 tokens/s per user";
  return u;
}

namespace {

// max / mean routed tokens per GPU after placing lognormal loads (8 layers' worth of samples);
// the shared expert, where it is placed as routed slots, carries every token.
double placed_imbalance(const ModelConfig& cfg, const DeployUnit& u) {
  const int64_t E = cfg.n_routed_experts, G = u.nodes * u.gpus_per_node;
  std::mt19937 rng(1);
  std::lognormal_distribution<double> d(0.0, u.load_sigma);
  ExpertLoads loads(8);
  for (auto& row : loads) {
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += row.emplace_back(d(rng));
    if (u.shared_as_routed) row.push_back(sum / double(cfg.num_experts_per_tok));
  }
  const int64_t groups = u.shared_as_routed ? 1 : cfg.n_group;
  return placement_balance(loads, place_experts(loads, {u.slots, u.nodes, G, groups})).overall();
}

// Nodes other than the token's own that hold at least one of its experts: `topk_group` of the
// groups (n_group / nodes on each node) under the hierarchical placement, else k picks anywhere.
double remote_nodes(const ModelConfig& cfg, const DeployUnit& u, double picks) {
  const double N = double(u.nodes);
  if (N <= 1) return 0;
  double untouched = 1;
  if (!u.decode && cfg.n_group % u.nodes == 0) {
    const double g = double(cfg.n_group), per = g / N;
    for (int64_t i = 0; i < cfg.topk_group; ++i) untouched *= (g - per - double(i)) / (g - double(i));
  } else {
    untouched = std::pow(1 - 1 / N, picks);
  }
  double touched = N * (1 - untouched);
  if (u.max_nodes > 0) touched = std::min(touched, double(u.max_nodes));
  return touched * (N - 1) / N;
}

}  // namespace

void check_rates(const KernelRates& r, const LinkModel& links) {
  FP8MOE_CHECK(r.gemm_tflops > 0 && r.grouped_tflops > 0 && r.weight_stream_tbps > 0 && r.copy_tbps > 0 &&
                   r.attention_tflops > 0 && r.decode_attention_tflops > 0 && r.decode_attention_fraction > 0 &&
                   r.memory_scale > 0,
               "deploy-sim: kernel rates must be > 0");
  FP8MOE_CHECK(links.nvlink_gbps > 0 && links.ib_gbps > 0 && links.nvlink_latency_us >= 0 && links.ib_latency_us >= 0,
               "deploy-sim: link bandwidths must be > 0 and latencies >= 0");
}

DeployResult simulate_deploy(const ModelConfig& cfg, const DeployUnit& u, const KernelRates& r, const LinkModel& links) {
  const int64_t G = u.nodes * u.gpus_per_node;
  FP8MOE_CHECK(u.nodes >= 1 && u.gpus_per_node >= 1 && u.attention_tp >= 1 && G % u.attention_tp == 0,
               "deploy-sim: " << u.name << ": " << u.nodes << " x " << u.gpus_per_node << " GPUs do not divide into "
                              << "attention TP groups of " << u.attention_tp);
  FP8MOE_CHECK(u.slots % G == 0, "deploy-sim: " << u.name << ": " << u.slots << " expert slots are not divisible by "
                                                << G << " GPUs");
  FP8MOE_CHECK(u.tokens_per_gpu >= 1 && u.batch_per_gpu >= 1 && u.context >= 1,
               "deploy-sim: " << u.name << ": tokens, batch and context must be >= 1");
  check_rates(r, links);
  const double D = double(cfg.hidden_size), H = double(cfg.num_attention_heads), dn = double(cfg.qk_nope_head_dim),
               dr = double(cfg.qk_rope_head_dim), dv = double(cfg.v_head_dim), rq = double(cfg.q_lora_rank),
               rkv = double(cfg.kv_lora_rank), F = double(cfg.moe_intermediate_size), I = double(cfg.intermediate_size),
               V = double(cfg.vocab_size), tp = double(u.attention_tp);
  const double gemm = r.gemm_tflops * 1e12, grouped = r.grouped_tflops * 1e12, attn = r.attention_tflops * 1e12;
  const double stream = r.weight_stream_tbps * 1e12 * r.memory_scale, copy = r.copy_tbps * 1e12 * r.memory_scale;
  const double nvl = links.nvlink_gbps * 1e9, ib = links.ib_gbps * 1e9;
  const double nvl_lat = links.nvlink_latency_us * 1e-6, ib_lat = links.ib_latency_us * 1e-6;
  // Parameters of one layer's attention projections, one expert, the dense MLP (FP8: a byte each).
  const double p_attn = (rq > 0 ? D * rq + rq * H * (dn + dr) : D * H * (dn + dr)) + D * (rkv + dr) +
                        rkv * H * (dn + dv) + H * dv * D;
  const double p_expert = 3 * D * F, p_dense = 3 * D * I;
  const double k = double(cfg.num_experts_per_tok) + (u.shared_as_routed ? 1 : 0);
  const double shared_n = u.shared_as_routed ? 0 : double(cfg.n_shared_experts);
  const double tokens = double(u.decode ? u.batch_per_gpu : u.tokens_per_gpu);
  const double per_gpu_slots = double(u.slots / G), gpn = double(u.gpus_per_node);
  // A token on the wire: FP8 with a scale per 128 channels out, BF16 back.
  const double dispatch_bytes = D + 4 * D / 128, combine_bytes = 2 * D;

  DeployResult o;
  o.expert_imbalance = placed_imbalance(cfg, u);
  o.remote_nodes = remote_nodes(cfg, u, k);
  // Per layer.
  double a_proj, a_core, tp_comm, experts, shared, dense, ibt, nvlt;
  // Sequence parallel: the attention input gathered and its output reduce-scattered in the TP group.
  tp_comm = tp > 1 ? 2 * (tp - 1) * tokens * D * 2 / nvl + 2 * nvl_lat : 0;
  if (!u.decode) {
    const double ctx = r.attention_full_square ? double(u.context) : double(u.context + 1) / 2;
    a_proj = 2 * p_attn * tokens / gemm;
    a_core = tokens * 2 * ctx * H * (dn + dr + dv) / attn;
    experts = tokens * k * o.expert_imbalance * 2 * p_expert / grouped;
    shared = tokens * shared_n * 2 * p_expert / gemm;
    dense = 2 * p_dense * tokens / gemm;
    // Normal dispatch: one copy per remote node over IB, forwarded over NVLink to the GPUs there.
    ibt = tokens * o.remote_nodes * (dispatch_bytes + combine_bytes) / ib + 2 * ib_lat;
    const double gpus_touched = double(G) * (1 - std::pow(1 - 1 / double(G), k));
    nvlt = tokens * gpus_touched * (dispatch_bytes + combine_bytes) / nvl + 2 * nvl_lat;
  } else {
    // The weights are read once per step whatever the batch; TP splits them, the tokens add up.
    a_proj = std::max(p_attn / tp / stream, 2 * p_attn * tokens / gemm);
    const double cache_bytes = rkv + 4 * rkv / 128 + 2 * dr;  // the FP8 latent cache, per token
    const double ctx = double(u.context);
    a_core = std::max(tokens * ctx * cache_bytes / (copy * r.decode_attention_fraction),
                      tokens * 2 * ctx * H * (2 * rkv + dr) / (r.decode_attention_tflops * 1e12));  // absorbed
    const double routed_tokens = tokens * k * o.expert_imbalance;
    experts = std::max(per_gpu_slots * p_expert / stream, routed_tokens * 2 * p_expert / grouped);
    shared = shared_n > 0 ? std::max(shared_n * p_expert / stream, tokens * shared_n * 2 * p_expert / gemm) : 0;
    dense = std::max(p_dense / tp / stream, 2 * p_dense * tokens / gemm);
    // Low-latency dispatch: every pick straight to its expert's GPU, RDMA off the node.
    const double off_node = k * (1 - gpn / double(G)), in_node = k * (gpn - 1) / double(G);
    ibt = tokens * off_node * (dispatch_bytes + combine_bytes) / ib + 2 * ib_lat;
    nvlt = tokens * in_node * (dispatch_bytes + combine_bytes) / nvl + 2 * nvl_lat;
  }
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const bool moe = cfg.is_moe_layer(l);
    const double compute = a_proj + a_core + (moe ? experts + shared : dense);
    const double comm = tp_comm + (moe ? std::max(ibt, nvlt) : 0);
    o.attn_proj += a_proj;
    o.attn_core += a_core;
    o.tp_comm += tp_comm;
    (moe ? o.experts : o.dense_mlp) += moe ? experts : dense;
    if (moe) {
      o.shared += shared;
      o.ib += ibt;
      o.nvlink += nvlt;
    }
    o.compute += compute;
    o.comm += comm;
    o.time_overlap += std::max(compute, comm);
    o.time_serial += compute + comm;
  }
  if (u.decode) {  // the head over every sequence's token, BF16 weights
    o.head = std::max(2 * D * V / stream, 2 * D * V * tokens / gemm);
    o.compute += o.head;
    o.time_overlap += o.head;
    o.time_serial += o.head;
    o.tokens_per_user_s = 1 / o.time_overlap;
  }
  o.tokens_per_node_s = gpn * tokens / o.time_overlap;
  o.tokens_per_node_s_serial = gpn * tokens / o.time_serial;
  return o;
}

}  // namespace fp8moe::serve
