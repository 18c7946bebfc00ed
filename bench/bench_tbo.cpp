// `fp8moe bench tbo` (bench.hpp): the two-micro-batch layer steps with P expert-parallel ranks as
// P buffers on one GPU, decode (src/serve/two_batch.hpp) and prefill
// (src/serve/two_batch_prefill.hpp), in their four modes: overlapped (the two micro-batches'
// compute and communication on separate streams), sequential (one chain per rank), the compute
// alone (attention and experts, no all-to-all) and the communication alone. A decode run is
// `layers` layer steps of every rank from an event on a lead stream that every stream waits for to
// the lead's wait for all; a prefill run, launched by one host thread per rank, is timed on the
// host from its start to the device's end. Median of `iters`, per layer. The overlapped and
// sequential runs' residuals and MoE outputs are compared bit for bit first.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "fp8moe/error.hpp"
#include "serve/two_batch.hpp"
#include "serve/two_batch_prefill.hpp"

namespace fp8moe::cuda {

namespace {

using serve::PrefillShape;
using serve::TwoBatchLayer;
using serve::TwoBatchPrefill;
using serve::TwoBatchMode;
using serve::TwoBatchShape;

// DeepSeek-V3's decode layer (hidden 7168, 128 heads, 256 experts top-8, 128 tokens per rank in
// two micro-batches of 64), or a smaller one of the same structure.
TwoBatchShape shape_named(const std::string& name) {
  TwoBatchShape s;
  if (name == "v3") return s;
  FP8MOE_CHECK(name == "small", "bench tbo --shapes: unknown shape '" << name << "' (v3, small)");
  s.hidden = 2048;
  s.q_rank = 512;
  s.heads = 16;
  s.experts = 64;
  s.topk = 6;
  s.expert_inter = 1408;
  s.tokens = 64;
  s.context = 512;
  return s;
}

// DeepSeek-V3's prefill layer (4096 tokens per rank in two micro-batches of 2048, sequences of 512),
// or the smaller one.
PrefillShape prefill_shape_named(const std::string& name) {
  PrefillShape s;
  s.seq_len = 512;
  if (name == "v3") return s;
  FP8MOE_CHECK(name == "small", "bench tbo --shapes: unknown shape '" << name << "' (v3, small)");
  s.hidden = 2048;
  s.q_rank = 512;
  s.heads = 16;
  s.experts = 64;
  s.topk = 6;
  s.expert_inter = 1408;
  s.tokens = 2048;
  return s;
}

using bench::median;

// Microseconds per layer of `mode`, median of iters; timed(mode) runs the layers from the seed's
// input and returns their microseconds.
template <class Layer, class Timed>
double time_mode(Layer& L, TwoBatchMode mode, const TboBenchOptions& opt, Timed timed) {
  std::vector<double> us;
  for (int i = 0; i < opt.warmup + opt.iters; ++i) {
    L.reset_input();  // keeps the values of repeated runs those of the first
    const double t = timed(mode);
    if (i >= opt.warmup) us.push_back(t / opt.layers);
  }
  return median(us);
}

// Every rank's residual and MoE output after the layers of `mode` from the seed's input.
template <class Layer, class Timed>
std::vector<float> results(Layer& L, TwoBatchMode mode, Timed timed) {
  L.reset_input();
  timed(mode);
  std::vector<float> all;
  for (int p = 0; p < L.shape().ranks; ++p) {
    const std::vector<float> x = L.residual(p), y = L.moe_out(p);
    all.insert(all.end(), x.begin(), x.end());
    all.insert(all.end(), y.begin(), y.end());
  }
  return all;
}

// One table row: the bitwise comparison, then the four modes' times. False when they differ.
template <class Layer, class Timed>
bool report(Layer& L, const std::string& phase, const std::string& name, const std::string& tokens,
            const std::string& length, const TboBenchOptions& opt, Timed timed) {
  const std::vector<float> over = results(L, TwoBatchMode::overlapped, timed);
  const std::vector<float> seq = results(L, TwoBatchMode::sequential, timed);
  const bool equal = std::memcmp(over.data(), seq.data(), over.size() * sizeof(float)) == 0;
  const double t_over = time_mode(L, TwoBatchMode::overlapped, opt, timed);
  const double t_seq = time_mode(L, TwoBatchMode::sequential, opt, timed);
  const double t_comp = time_mode(L, TwoBatchMode::compute_only, opt, timed);
  const double t_comm = time_mode(L, TwoBatchMode::comm_only, opt, timed);
  const double bound = std::max(t_comp, t_comm);
  std::printf("| %s | %s | %d | %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %s |\n", phase.c_str(),
              name.c_str(), L.shape().ranks, tokens.c_str(), length.c_str(), t_over, t_seq, t_comp, t_comm, bound,
              t_seq / t_over, t_over / bound, equal ? "yes (bitwise)" : "NO");
  std::fflush(stdout);
  return equal;
}

std::string split(int64_t tokens) {
  return std::to_string(tokens) + " (" + std::to_string(tokens / 2) + " + " + std::to_string(tokens / 2) + ")";
}

}  // namespace

int run_tbo_bench(const TboBenchOptions& opt) {
  FP8MOE_CHECK(opt.iters >= 1 && opt.layers >= 1, "bench tbo: --iters and --layers must be >= 1");
  const std::vector<std::string> phases = bench::comma_list(opt.phases, "bench tbo --phases");
  for (const std::string& p : phases)
    FP8MOE_CHECK(p == "decode" || p == "prefill", "bench tbo --phases: unknown phase '" << p << "' (decode, prefill)");
  cudaDeviceProp prop;
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  FP8MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("# fp8moe bench tbo on %s (%d SMs): P ranks as P buffers on this GPU; per rank a compute stream and "
              "one communication stream per micro-batch (one EpGroup each, %d blocks per kernel; decode: low-latency "
              "mode, prefill: normal mode, one host thread per rank); us per layer, median of %d runs of %d layers, "
              "seed %llu\n",
              prop.name, prop.multiProcessorCount, opt.num_sms, opt.iters, opt.layers, (unsigned long long)opt.seed);
  std::printf("# decode overlapped: ATTN(A) ATTN(B) on the compute stream, DISPATCH MOE COMBINE of A during ATTN(B) "
              "and of B during the next layer's ATTN(A); prefill overlapped: ATTN(A) ATTN(B) MOE(A) MOE(B) on the "
              "compute stream, DISPATCH(A) during ATTN(B), DISPATCH(B) during MOE(A), COMBINE(A) during MOE(B), "
              "COMBINE(B) during the next ATTN(A); sequential: one chain per rank; compute: attention + experts "
              "alone; comm: the all-to-alls alone\n");
  std::printf("| phase | shape | ranks | tokens per rank | context / sequence | overlapped | sequential | compute | "
              "comm | max(compute, comm) | sequential / overlapped | overlapped / max | overlapped = sequential |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  cudaStream_t lead;
  FP8MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&lead, cudaStreamNonBlocking));
  int failures = 0;
  for (const std::string& phase : phases)
    for (const std::string& name : bench::comma_list(opt.shapes, "bench tbo --shapes"))
      for (const std::string& ranks : bench::comma_list(opt.ranks, "bench tbo --ranks")) {
        if (phase == "decode") {
          TwoBatchShape s = shape_named(name);
          s.ranks = std::stoi(ranks);
          if (opt.tokens > 0) s.tokens = opt.tokens;
          if (opt.context > 0) s.context = opt.context;
          s.num_sms = opt.num_sms;
          s.seed = opt.seed;
          TwoBatchLayer L(s);
          cudaEvent_t e0, e1;
          FP8MOE_CUDA_CHECK(cudaEventCreate(&e0));
          FP8MOE_CUDA_CHECK(cudaEventCreate(&e1));
          auto timed = [&](TwoBatchMode mode) {
            FP8MOE_CUDA_CHECK(cudaEventRecord(e0, lead));
            L.run(mode, opt.layers, lead);
            FP8MOE_CUDA_CHECK(cudaEventRecord(e1, lead));
            FP8MOE_CUDA_CHECK(cudaEventSynchronize(e1));
            L.check();
            float ms = 0;
            FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            return 1e3 * double(ms);
          };
          failures += !report(L, phase, name, split(s.tokens), std::to_string(s.context), opt, timed);
          cudaEventDestroy(e0);
          cudaEventDestroy(e1);
        } else {
          PrefillShape s = prefill_shape_named(name);
          s.ranks = std::stoi(ranks);
          if (opt.tokens > 0) s.tokens = opt.tokens;
          if (opt.seq_len > 0) s.seq_len = opt.seq_len;
          s.num_sms = opt.num_sms;
          s.seed = opt.seed;
          TwoBatchPrefill L(s);
          auto timed = [&](TwoBatchMode mode) {
            const auto t0 = std::chrono::steady_clock::now();
            L.run(mode, opt.layers);
            return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
          };
          failures += !report(L, phase, name, split(s.tokens), std::to_string(s.seq_len), opt, timed);
        }
      }
  cudaStreamDestroy(lead);
  return failures == 0 ? 0 : 1;
}

}  // namespace fp8moe::cuda
