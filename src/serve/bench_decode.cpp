// The decode-step benchmark (bench_decode.hpp).
#include "serve/bench_decode.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "serve/engine.hpp"
#include "serve/weights.hpp"

namespace fp8moe::serve {

namespace {

using Clock = std::chrono::steady_clock;

// Device copy bandwidth in bytes/s, read + write counted (the figure docs/PERF.md calls the copy
// bandwidth): the median of 5 copies of a buffer well past the caches.
double copy_bandwidth(Backend& be) {
  const int64_t n = be.device() == Device::cpu ? (int64_t(64) << 20) : (int64_t(1) << 30);  // bytes
  Tensor a = be.zeros(DType::f32, {n / 4}), b = be.zeros(DType::f32, {n / 4});
  be.copy(b.view(), a.view());
  be.synchronize();
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    be.copy(b.view(), a.view());
    be.synchronize();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return 2.0 * double(n) / t[2];
}

}  // namespace

int bench_decode(Backend& be, const DecodeBenchOptions& opt) {
  FP8MOE_CHECK(!opt.batches.empty(), "bench decode: --batch needs at least one size");
  FP8MOE_CHECK(opt.context >= 0 && opt.iters >= 1, "bench decode: --context must be >= 0 and --iters >= 1");
  const ModelConfig cfg = load_config(opt.config);
  const int64_t Bmax = *std::max_element(opt.batches.begin(), opt.batches.end());
  // Two untimed steps first: with graphs the second records the step that the timed ones replay.
  constexpr int kWarmup = 2;
  FP8MOE_CHECK(opt.context + opt.iters + kWarmup <= cfg.max_position_embeddings,
               "bench decode: --context " << opt.context << " + " << opt.iters + kWarmup
                                          << " steps exceeds the context of " << cfg.max_position_embeddings);
  const double bw = copy_bandwidth(be);
  EngineOptions eo;
  eo.linear = opt.linear;
  eo.cache = cache_dtype_from_name(opt.cache);
  eo.shared_as_routed = opt.shared_as_routed;
  eo.graphs = opt.graphs;
  const int64_t per_seq = blocks_for(opt.context + opt.iters + kWarmup);
  eo.cache_blocks = Bmax * per_seq;
  Engine engine(random_weights(cfg, 1), be, eo);  // the engine converts them (FP8: 128x128 blocks)
  std::printf("bench decode: %s on %s, linear %s, cache %s (%lld bytes/token), context %lld, copy bandwidth %.0f GB/s, "
              "graphs %s\n",
              cfg.name.c_str(), be.name().c_str(), opt.linear.c_str(), opt.cache.c_str(),
              static_cast<long long>(engine.cache().bytes_per_token()), static_cast<long long>(opt.context), bw / 1e9,
              opt.graphs ? "on" : "off");
  std::printf("| batch | step ms | tokens/s | MB read/step | roofline ms | of roofline | replays |\n"
              "|---|---|---|---|---|---|---|\n");
  // The cache content does not change the step's work: the tables point at zero latents.
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(Bmax));
  for (int64_t b = 0; b < Bmax; ++b)
    for (int64_t j = 0; j < per_seq; ++j) tables[size_t(b)].push_back(int32_t(b * per_seq + j));
  for (const int64_t B : opt.batches) {
    FP8MOE_CHECK(B >= 1, "bench decode: batch sizes must be >= 1, got " << B);
    const auto step = [&](int64_t i) {
      std::vector<SeqChunk> chunks;
      for (int64_t b = 0; b < B; ++b)
        chunks.push_back(SeqChunk{&tables[size_t(b)], opt.context + i,
                                  {int32_t((b * 7 + i) % std::min<int64_t>(cfg.vocab_size, 256))}, 1});
      engine.step(chunks);  // returns the logits on the host: synchronized
    };
    for (int i = 0; i < kWarmup; ++i) step(i);
    const int64_t replays = engine.graph_replays();
    std::vector<double> t;
    for (int i = kWarmup; i < kWarmup + opt.iters; ++i) {
      const auto t0 = Clock::now();
      step(i);
      t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    const double s = t[t.size() / 2], bytes = engine.decode_step_bytes(B, opt.context), roof = bytes / bw;
    std::printf("| %lld | %.3f | %.1f | %.1f | %.3f | %.1f%% | %lld of %d |\n", static_cast<long long>(B), s * 1e3,
                double(B) / s, bytes / 1e6, roof * 1e3, 100.0 * roof / s,
                static_cast<long long>(engine.graph_replays() - replays), opt.iters);
  }
  if (!engine.graph_note().empty()) std::printf("# graphs off: %s\n", engine.graph_note().c_str());
  return 0;
}

}  // namespace fp8moe::serve
