// `fp8moe serve`: the OpenAI-compatible HTTP server (src/serve/server.hpp) with continuous batching.
//   fp8moe serve --checkpoint runs/tiny/checkpoint.safetensors --port 8000
//   fp8moe serve --hf out/hf --cache fp8 --cache-blocks 1024
//   fp8moe serve --dummy configs/tiny.json --port 0     (random weights: load tests)
//   curl -N localhost:8000/v1/completions -d '{"model": "fp8moe", "prompt": "Hi", "stream": true}'
//   mpirun -np 3 fp8moe serve --dummy configs/tiny.json --disaggregate
//                       (rank 0: HTTP and prefill; ranks 1..: decode, each request on the one with
//                       the fewest in flight; the cache handed over by Comm)
// Prints "fp8moe serve: listening on http://HOST:PORT" once it accepts connections; SIGINT or
// SIGTERM stops it (in-flight requests are cancelled) with exit status 0.
#ifdef FP8MOE_HAVE_SERVER
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

#include "commands.hpp"
#include "fp8moe/backend.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/model.hpp"
#include "serve/disaggregated_front.hpp"
#include "serve/server.hpp"

namespace fp8moe {
namespace {

struct Args {
  std::string checkpoint, hf, dummy, backend = "auto", linear = "auto", cache = "bf16";
  uint64_t seed = 1;
  int64_t cache_blocks = 1024;
  bool shared_as_routed = false;
  bool disaggregate = false;
  int64_t expert_slots = 0, expert_nodes = 1, expert_gpus = 1, rebalance_every = 0;
  serve::ServerOptions server;
};

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }

void run(Args& a) {
  FP8MOE_CHECK(int(!a.checkpoint.empty()) + int(!a.hf.empty()) + int(!a.dummy.empty()) == 1,
               "give exactly one of --checkpoint FILE, --hf FOLDER and --dummy CONFIG");
  auto be = make_backend(a.backend == "auto" ? default_backend_name() : a.backend);
  std::unique_ptr<Model> dummy;
  serve::WeightSet w;
  if (!a.dummy.empty()) {
    dummy = std::make_unique<Model>(load_config(a.dummy), Recipe::from_name("fp32"), *be, a.seed);
    w = serve::weights_of(*dummy);
  } else {
    w = a.hf.empty() ? serve::load_checkpoint_weights(a.checkpoint) : serve::load_hf_weights(a.hf);
  }
  serve::EngineOptions eo;
  eo.linear = a.linear;
  eo.cache = serve::cache_dtype_from_name(a.cache);
  eo.cache_blocks = a.cache_blocks;
  eo.shared_as_routed = a.shared_as_routed;
  eo.expert_slots = a.expert_slots;
  eo.expert_nodes = a.expert_nodes;
  eo.expert_gpus = a.expert_gpus;
  eo.rebalance_every = a.rebalance_every;
  serve::Engine engine(w, *be, eo);
  std::unique_ptr<Comm> comm;
  std::unique_ptr<serve::DisaggregatedFront> front;
  if (a.disaggregate) {
    comm = make_comm("mpi");
    FP8MOE_CHECK(comm->size() >= 2, "fp8moe serve --disaggregate runs on 2 or more ranks (rank 0 prefills and "
                                    "serves HTTP, the others decode), the "
                                        << comm->name() << " communicator has " << comm->size()
                                        << "; start it with mpirun -np 2 or more");
    if (comm->rank() > 0) {  // stopped by the front's end message, not by signals
      std::signal(SIGINT, SIG_IGN);
      std::signal(SIGTERM, SIG_IGN);
      serve::Scheduler decode(engine, a.server.scheduler);
      serve::serve_decode_rank(decode, engine, *comm, 0);
      return;
    }
    std::vector<int> decode_ranks;
    for (int r = 1; r < comm->size(); ++r) decode_ranks.push_back(r);
    front = std::make_unique<serve::DisaggregatedFront>(engine, *comm, decode_ranks, a.server.scheduler.max_step_tokens);
  }
  serve::Server server = front ? serve::Server(engine, *front, a.server) : serve::Server(engine, a.server);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::atomic<bool> done{false};
  // Stop requests repeat until run() returns: a signal before the server listens is not lost.
  std::thread watcher([&] {
    bool said = false;
    while (!done) {
      if (g_stop) {
        if (!said) std::fprintf(stderr, "fp8moe serve: stopping\n");
        said = true;
        server.stop();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  try {
    server.run([&](int port) {
      std::printf("fp8moe serve: listening on http://%s:%d (model %s, %s, backend %s, cache %s x %lld blocks)\n",
                  a.server.host.c_str(), port, a.server.model.c_str(), w.cfg.name.c_str(), be->name().c_str(),
                  a.cache.c_str(), static_cast<long long>(a.cache_blocks));
      std::fflush(stdout);
    });
  } catch (...) {
    done = true;
    watcher.join();
    throw;
  }
  done = true;
  watcher.join();
  if (front) {
    front->finish();
    std::printf("fp8moe serve: %lld handovers, %.3f GB/s\n", static_cast<long long>(front->handover().requests),
                front->handover().gb_per_s());
  }
}

void add_serve(CLI::App& app) {
  auto a = std::make_shared<Args>();
  CLI::App* c = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching");
  c->add_option("--checkpoint", a->checkpoint, "Training checkpoint (checkpoint.safetensors)");
  c->add_option("--hf", a->hf, "Folder written by fp8moe export");
  c->add_option("--dummy", a->dummy, "Model config: random weights (load tests)");
  c->add_option("--seed", a->seed, "Seed of the --dummy weights");
  c->add_option("--host", a->server.host, "Address to listen on");
  c->add_option("--port", a->server.port, "Port (0: any free one, printed)")->check(CLI::Range(0, 65535));
  c->add_option("--model-name", a->server.model, "The model id clients name");
  c->add_option("--http-threads", a->server.http_threads, "Connections served at once")->check(CLI::PositiveNumber);
  c->add_option("--backend", a->backend, "auto | cpu | cuda | cublaslt");
  c->add_option("--linear", a->linear, "Linear precision")->check(CLI::IsMember({"auto", "f32", "bf16", "fp8"}));
  c->add_option("--cache", a->cache, "Latent cache dtype")->check(CLI::IsMember({"f32", "bf16", "fp8"}));
  c->add_option("--cache-blocks", a->cache_blocks, "Cache blocks of 64 tokens")->check(CLI::PositiveNumber);
  c->add_option("--expert-slots", a->expert_slots, "Redundant experts: slots for copies of the routed experts (0: one each)");
  c->add_option("--expert-nodes", a->expert_nodes, "Redundant experts: nodes of the virtual GPUs")->check(CLI::PositiveNumber);
  c->add_option("--expert-gpus", a->expert_gpus, "Redundant experts: virtual GPUs holding the slots")->check(CLI::PositiveNumber);
  c->add_option("--rebalance-every", a->rebalance_every, "Redundant experts: engine steps between placements (0: never)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--max-step-tokens", a->server.scheduler.max_step_tokens, "Tokens per engine step")
      ->check(CLI::PositiveNumber);
  c->add_option("--max-running", a->server.scheduler.max_running, "Requests in the running batch")
      ->check(CLI::PositiveNumber);
  c->add_flag("--disaggregate", a->disaggregate,
              "Under mpirun -np N >= 2: prefill on rank 0 (with the HTTP front), decode on ranks 1..N-1");
  c->add_flag("--shared-as-routed", a->shared_as_routed, "Run the shared expert as a routed expert every token picks");
  c->callback([a] { run(*a); });
}

const bool registered = cli::register_command(&add_serve);

}  // namespace
}  // namespace fp8moe
#endif  // FP8MOE_HAVE_SERVER
