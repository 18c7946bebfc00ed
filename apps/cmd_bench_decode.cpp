// `fp8moe bench decode`: whole decode steps against their roofline (src/serve/bench_decode.hpp),
// on the GPU when there is one, else on the CPU.
//   fp8moe bench decode --config configs/1b.json --batch 1,32,256 --context 512
//   fp8moe bench decode --config configs/tiny.json --backend cpu --iters 3
#include <memory>

#include "commands.hpp"
#include "fp8moe/backend.hpp"
#include "serve/bench_decode.hpp"

namespace fp8moe::cli {

void add_bench_decode(CLI::App& bench) {
  auto o = std::make_shared<serve::DecodeBenchOptions>();
  auto backend = std::make_shared<std::string>("auto");
  CLI::App* c = bench.add_subcommand("decode", "Whole decode steps (random weights) against the weights + cache roofline");
  c->add_option("--config", o->config, "Model config");
  c->add_option("--batch", o->batches, "Batch sizes")->delimiter(',');
  c->add_option("--context", o->context, "Tokens already in every sequence's cache")->check(CLI::NonNegativeNumber);
  c->add_option("--linear", o->linear, "Linear precision")->check(CLI::IsMember({"f32", "bf16", "fp8"}));
  c->add_option("--cache", o->cache, "Latent cache dtype")->check(CLI::IsMember({"f32", "bf16", "fp8"}));
  c->add_option("--iters", o->iters, "Timed steps per batch size (median)")->check(CLI::PositiveNumber);
  c->add_flag("--shared-as-routed", o->shared_as_routed, "The shared expert as a routed expert");
  auto graphs = std::make_shared<std::string>("on");
  c->add_option("--graphs", *graphs, "decode steps as CUDA graphs where the backend captures them: on | off")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  c->add_option("--backend", *backend, "auto | cpu | cuda | cublaslt");
  c->callback([o, backend, graphs] {
    o->graphs = *graphs == "on";
    auto be = make_backend(*backend == "auto" ? default_backend_name() : *backend);
    serve::bench_decode(*be, *o);
  });
}

}  // namespace fp8moe::cli
