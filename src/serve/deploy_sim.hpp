// The deployment simulator (DeepSeek-V3 §3.4): tokens/s per node of a prefill or decode unit of
// a DeepSeek-V3-shaped model, from kernel rates and a link model, layer by layer. Per GPU and MoE
// layer it adds up the attention projections, the attention itself, the routed experts (the
// slowest GPU after the redundant experts' placement of lognormal loads, placement.hpp), the
// shared expert, and the dispatch and combine over InfiniBand and NVLink; with two micro-batches
// in flight a layer takes max(compute, communication), without them the sum.
//   prefill  T tokens per GPU of prompts `context` tokens long, compute-bound GEMMs; tokens/s per
//            node = GPUs per node x T / (the layers' time).
//   decode   B sequences per GPU, `context` cached tokens each; weight- and cache-read-bound;
//            tokens/s per node = GPUs per node x B / (the layers' time + the head's).
//   serve::DeployResult r = serve::simulate_deploy(cfg, serve::report_prefill_unit(), {}, serve::LinkModel::h800());
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fp8moe/config.hpp"

namespace fp8moe::serve {

// Per GPU. Defaults: fp8moe's measured H200 figures (docs/PERF.md's summary) where it has them.
struct KernelRates {
  double gemm_tflops = 1317;             // FP8 dense GEMM, 4096x7168x16384, sustained
  double grouped_tflops = 1300;          // FP8 grouped GEMM, contiguous (1221-1374 measured)
  double weight_stream_tbps = 3.0;       // small-M / decode grouped GEMMs streaming their weights
  double copy_tbps = 3.85;               // device copy, read + written (3.8-3.9 measured)
  double attention_tflops = 32;          // causal attention, the GEMM path (whole S x S square)
  bool attention_full_square = true;     // the GEMM path computes the masked half too
  // mla_decode_attention at 128 heads: over the FP8 latent cache it reads the cache at 8% of the
  // copy rate (the FP8 codes widened to FP16 before mma.sync), and its mma.sync bounds the BF16
  // cache at 174-181 TFLOP/s.
  double decode_attention_fraction = 0.08;
  double decode_attention_tflops = 178;
  double memory_scale = 1.0;             // memory-bound rates x this (H800 / H200 HBM: 3.35 / 4.8)
};

// Per GPU and direction, GB/s and microseconds per transfer.
struct LinkModel {
  double nvlink_gbps = 200, nvlink_latency_us = 2;
  double ib_gbps = 50, ib_latency_us = 4;
  static LinkModel h800() { return {}; }                // NVLink 400 GB/s both ways, 400 Gb/s IB
  static LinkModel h200() { return {450, 2, 50, 4}; }   // NVLink 900 GB/s both ways
};

struct DeployUnit {
  std::string name;
  bool decode = false;
  int64_t nodes = 4, gpus_per_node = 8;
  int64_t attention_tp = 1;     // attention tensor parallel (with sequence parallel), DP the rest
  int64_t slots = 288;          // expert slots over the unit's GPUs (routed + redundant [+ shared])
  bool shared_as_routed = false;  // the shared expert placed as routed slots (the report's decode)
  int64_t tokens_per_gpu = 8192;  // prefill: tokens per GPU per pass (both micro-batches)
  int64_t batch_per_gpu = 88;     // decode: sequences per GPU
  int64_t context = 4096;         // prefill: prompt length; decode: cached tokens per sequence
  int64_t max_nodes = 4;          // nodes a token's experts span at most (0: no limit)
  double load_sigma = 0.5;        // lognormal sigma of the expert loads the placement balances (the
                                  // tiny model trained here: 0.32 and 0.67 over its two MoE layers)
  double published_tokens_per_node_s = 0;  // 0: none published
  std::string published_note;
};

DeployUnit report_prefill_unit();      // §3.4.1: 32 GPUs, attention TP4 + SP with DP8, EP32, 32 redundant
DeployUnit report_decode_unit();       // §3.4.2: 320 GPUs, EP320, one expert per GPU
DeployUnit production_prefill_unit();  // DeepSeek's inference overview: EP32 on 4 nodes
DeployUnit production_decode_unit();   // EP144 on 18 nodes

struct DeployResult {
  // Seconds per GPU for the whole pass (prefill) or step (decode), over the layers.
  double attn_proj = 0, attn_core = 0, tp_comm = 0, experts = 0, shared = 0, dense_mlp = 0, head = 0;
  double ib = 0, nvlink = 0;             // dispatch + combine
  double compute = 0, comm = 0;          // the sums the overlap takes the max of, layer by layer
  double time_overlap = 0, time_serial = 0;
  double expert_imbalance = 1;           // max / mean routed tokens per GPU after the placement
  double remote_nodes = 0;               // nodes other than its own a token's experts are on
  double tokens_per_node_s = 0;          // with the overlap
  double tokens_per_node_s_serial = 0;
  double tokens_per_user_s = 0;          // decode: 1 / step time
};

// Throws fp8moe::Error unless every rate and bandwidth is > 0 and every latency >= 0.
void check_rates(const KernelRates& rates, const LinkModel& links);
DeployResult simulate_deploy(const ModelConfig& cfg, const DeployUnit& unit, const KernelRates& rates,
                             const LinkModel& links);

}  // namespace fp8moe::serve
