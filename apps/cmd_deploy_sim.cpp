// `fp8moe deploy-sim`: the deployment simulator (src/serve/deploy_sim.hpp) for the report's
// prefill and decode units and DeepSeek's production ones, beside the published figures.
//   fp8moe deploy-sim                        fp8moe's measured H200 kernel rates, H800 links
//   fp8moe deploy-sim --roofline-attention   attention at the GEMM rate, decode at the copy rate
//   fp8moe deploy-sim --unit production-decode --batch-per-gpu 128 --ib-gbps 40
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "serve/deploy_sim.hpp"

namespace fp8moe {
namespace {

struct DeploySimArgs {
  std::string config = "deepseek-v3";
  std::string unit = "all";
  std::string gpu = "h800";
  serve::KernelRates rates;
  serve::LinkModel links;
  bool links_set = false;
  bool roofline_attention = false;
  bool attention_given = false;  // --attention-tflops on the command line: kept under --roofline-attention
  bool serial = false;
  int64_t tokens_per_gpu = 0, batch_per_gpu = 0, context = 0;
  double load_sigma = -1;
};

void deploy_sim_command(DeploySimArgs a) {
  const ModelConfig cfg = load_config(a.config);
  FP8MOE_CHECK(a.gpu == "h800" || a.gpu == "h200", "--gpu: unknown '" << a.gpu << "' (expected h800 or h200)");
  // The kernel rates are H200 measurements; an H800 has the same Tensor Cores and 3.35 of the
  // H200's 4.8 TB/s of HBM.
  if (a.gpu == "h800") a.rates.memory_scale *= 3.35 / 4.8;
  if (a.roofline_attention) {
    if (!a.attention_given) a.rates.attention_tflops = a.rates.gemm_tflops;
    a.rates.attention_full_square = false;
    a.rates.decode_attention_fraction = 1.0;
    a.rates.decode_attention_tflops = a.rates.attention_tflops;
  }
  serve::check_rates(a.rates, a.links);
  std::vector<serve::DeployUnit> units;
  for (const auto& [name, make] : {std::pair{"report-prefill", &serve::report_prefill_unit},
                                   std::pair{"report-decode", &serve::report_decode_unit},
                                   std::pair{"production-prefill", &serve::production_prefill_unit},
                                   std::pair{"production-decode", &serve::production_decode_unit}})
    if (a.unit == "all" || a.unit == name) units.push_back(make());
  FP8MOE_CHECK(!units.empty(), "--unit: unknown '" << a.unit
                                                   << "' (expected all, report-prefill, report-decode, production-prefill "
                                                      "or production-decode)");
  std::printf("%s on %s (kernel rates: fp8 GEMM %.0f, grouped %.0f, attention %.0f TFLOPS%s; weights %.2f, copy %.2f TB/s "
              "x %.2f; decode attention at %.1f%% of the cache read, %.0f TFLOPS), NVLink %.0f GB/s, IB %.0f GB/s + %.1f us\n\n",
              cfg.name.c_str(), a.gpu.c_str(), a.rates.gemm_tflops, a.rates.grouped_tflops, a.rates.attention_tflops,
              a.rates.attention_full_square ? " whole square" : " causal half", a.rates.weight_stream_tbps,
              a.rates.copy_tbps, a.rates.memory_scale, 100 * a.rates.decode_attention_fraction,
              a.rates.decode_attention_tflops, a.links.nvlink_gbps,
              a.links.ib_gbps, a.links.ib_latency_us);
  std::printf("%-38s %5s %7s %7s | %8s %8s %8s %8s %8s %8s %8s | %8s %8s | %10s %10s | %s\n", "unit", "GPUs", "batch",
              "context", "proj", "attn", "experts", "sh+dense", "TP", "IB", "NVLink", "overlap", "serial",
              "tok/s/node", "serial", "published");
  for (serve::DeployUnit u : units) {
    if (a.tokens_per_gpu > 0 && !u.decode) u.tokens_per_gpu = a.tokens_per_gpu;
    if (a.batch_per_gpu > 0 && u.decode) u.batch_per_gpu = a.batch_per_gpu;
    if (a.context > 0) u.context = a.context;
    if (a.load_sigma >= 0) u.load_sigma = a.load_sigma;
    const serve::DeployResult r = serve::simulate_deploy(cfg, u, a.rates, a.links);
    const auto ms = [](double s) { return s * 1e3; };
    char published[96] = "-";
    if (u.published_tokens_per_node_s > 0)
      std::snprintf(published, sizeof published, "%.1fk (%s)", u.published_tokens_per_node_s / 1e3,
                    u.published_note.c_str());
    std::printf("%-38s %5lld %7lld %7lld | %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f | %8.2f %8.2f | %9.1fk %9.1fk | %s\n",
                u.name.c_str(), (long long)(u.nodes * u.gpus_per_node),
                (long long)(u.decode ? u.batch_per_gpu : u.tokens_per_gpu), (long long)u.context, ms(r.attn_proj),
                ms(r.attn_core), ms(r.experts), ms(r.shared + r.dense_mlp + r.head), ms(r.tp_comm), ms(r.ib),
                ms(r.nvlink), ms(r.time_overlap), ms(r.time_serial), r.tokens_per_node_s / 1e3,
                r.tokens_per_node_s_serial / 1e3, published);
    std::printf("%-38s expert max/mean after placement %.3f, remote nodes per token %.2f%s\n", "",
                r.expert_imbalance, r.remote_nodes,
                u.decode ? (", " + std::to_string(r.tokens_per_user_s).substr(0, 5) + " tokens/s per user").c_str()
                         : "");
  }
  std::printf("\nms per GPU per pass (prefill: the batch's tokens) or step (decode), summed over the %lld layers; "
              "overlap: two micro-batches, max(compute, communication) per layer.\n",
              (long long)cfg.num_hidden_layers);
}

void add_deploy_sim(CLI::App& app) {
  auto* cmd = app.add_subcommand("deploy-sim", "predict prefill and decode tokens/s per node of DeepSeek-V3 deployments");
  auto a = std::make_shared<DeploySimArgs>();
  cmd->add_option("-c,--config", a->config, "model config")->capture_default_str();
  cmd->add_option("--unit", a->unit, "all | report-prefill | report-decode | production-prefill | production-decode")
      ->capture_default_str();
  cmd->add_option("--gpu", a->gpu, "h800 (the published units' GPU: HBM rates x 3.35/4.8) | h200")->capture_default_str();
  cmd->add_option("--gemm-tflops", a->rates.gemm_tflops, "FP8 dense GEMM")->capture_default_str();
  cmd->add_option("--grouped-tflops", a->rates.grouped_tflops, "FP8 grouped GEMM")->capture_default_str();
  auto* attention = cmd->add_option("--attention-tflops", a->rates.attention_tflops, "attention")->capture_default_str();
  cmd->add_option("--weight-stream-tbps", a->rates.weight_stream_tbps, "weights streamed by small-M GEMMs")
      ->capture_default_str();
  cmd->add_option("--copy-tbps", a->rates.copy_tbps, "device copy")->capture_default_str();
  cmd->add_option("--decode-attention-fraction", a->rates.decode_attention_fraction,
                  "decode attention's share of the cache read at copy rate")
      ->capture_default_str();
  cmd->add_option("--decode-attention-tflops", a->rates.decode_attention_tflops, "decode attention's math")
      ->capture_default_str();
  cmd->add_flag("--roofline-attention", a->roofline_attention,
                "attention at the GEMM rate (or --attention-tflops; causal half), decode attention at the copy rate");
  cmd->add_option("--nvlink-gbps", a->links.nvlink_gbps, "NVLink per GPU and direction")->capture_default_str();
  cmd->add_option("--nvlink-latency-us", a->links.nvlink_latency_us, "NVLink per transfer")->capture_default_str();
  cmd->add_option("--ib-gbps", a->links.ib_gbps, "InfiniBand per GPU and direction")->capture_default_str();
  cmd->add_option("--ib-latency-us", a->links.ib_latency_us, "InfiniBand per transfer")->capture_default_str();
  cmd->add_option("--tokens-per-gpu", a->tokens_per_gpu, "prefill tokens per GPU per pass (0: the unit's, 8192)");
  cmd->add_option("--batch-per-gpu", a->batch_per_gpu, "decode sequences per GPU (0: the unit's, 88)");
  cmd->add_option("--context", a->context, "prompt length (prefill) or cached tokens (decode); 0: the unit's");
  cmd->add_option("--load-sigma", a->load_sigma, "lognormal sigma of the expert loads (default 0.5)");
  cmd->callback([a, attention] {
    a->attention_given = attention->count() > 0;
    deploy_sim_command(*a);
  });
}

const bool registered = cli::register_command(&add_deploy_sim);

}  // namespace
}  // namespace fp8moe
