// `fp8moe bench tbo` (bench.hpp): the two-micro-batch decode layer step of src/serve/two_batch.hpp
// with P expert-parallel ranks as P buffers on one GPU, in its four modes: overlapped (attention on
// a compute stream, dispatch, experts and combine on a communication stream), sequential (one
// chain per rank), the compute alone (attention and experts, no all-to-all) and the communication
// alone (dispatches and combines). Each timed run is `layers` layer steps of every rank, from an
// event on a lead stream that every stream waits for to the lead's wait for all; median of
// `iters`, per layer. The overlapped and sequential runs' residuals and MoE outputs are compared
// bit for bit first.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "fp8moe/error.hpp"
#include "serve/two_batch.hpp"

namespace fp8moe::cuda {

namespace {

using serve::TwoBatchLayer;
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

using bench::median;

// Microseconds per layer of `mode`, median of iters.
double time_mode(TwoBatchLayer& L, TwoBatchMode mode, const TboBenchOptions& opt, cudaStream_t lead) {
  cudaEvent_t e0, e1;
  FP8MOE_CUDA_CHECK(cudaEventCreate(&e0));
  FP8MOE_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int i = 0; i < opt.warmup + opt.iters; ++i) {
    L.reset_input();  // keeps the values of repeated runs those of the first
    FP8MOE_CUDA_CHECK(cudaEventRecord(e0, lead));
    L.run(mode, opt.layers, lead);
    FP8MOE_CUDA_CHECK(cudaEventRecord(e1, lead));
    FP8MOE_CUDA_CHECK(cudaEventSynchronize(e1));
    L.check();
    float ms = 0;
    FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= opt.warmup) us.push_back(1e3 * double(ms) / opt.layers);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(us);
}

// Every rank's residual and MoE output after `layers` steps of `mode` from the seed's input.
std::vector<float> results(TwoBatchLayer& L, TwoBatchMode mode, int layers, cudaStream_t lead) {
  L.reset_input();
  L.run(mode, layers, lead);
  L.check();
  std::vector<float> all;
  for (int p = 0; p < L.shape().ranks; ++p) {
    const std::vector<float> x = L.residual(p), y = L.moe_out(p);
    all.insert(all.end(), x.begin(), x.end());
    all.insert(all.end(), y.begin(), y.end());
  }
  return all;
}

}  // namespace

int run_tbo_bench(const TboBenchOptions& opt) {
  FP8MOE_CHECK(opt.iters >= 1 && opt.layers >= 1, "bench tbo: --iters and --layers must be >= 1");
  cudaDeviceProp prop;
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  FP8MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("# fp8moe bench tbo on %s (%d SMs): P ranks as P buffers on this GPU; per rank a compute stream and "
              "one communication stream per micro-batch (one EpGroup each, low-latency mode, %d blocks per kernel); "
              "us per layer, median of %d runs of %d layers, seed %llu\n",
              prop.name, prop.multiProcessorCount, opt.num_sms, opt.iters, opt.layers, (unsigned long long)opt.seed);
  std::printf("# overlapped: ATTN(A) ATTN(B) on the compute stream, DISPATCH MOE COMBINE of A during ATTN(B) and of B "
              "during the next layer's ATTN(A); sequential: one chain per rank; compute: attention + experts alone; "
              "comm: dispatch + combine alone\n");
  std::printf("| shape | ranks | tokens per rank | context | overlapped | sequential | compute | comm "
              "| max(compute, comm) | sequential / overlapped | overlapped / max | overlapped = sequential |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  cudaStream_t lead;
  FP8MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&lead, cudaStreamNonBlocking));
  int failures = 0;
  for (const std::string& name : bench::comma_list(opt.shapes, "bench tbo --shapes"))
    for (const std::string& ranks : bench::comma_list(opt.ranks, "bench tbo --ranks")) {
      TwoBatchShape s = shape_named(name);
      s.ranks = std::stoi(ranks);
      if (opt.tokens > 0) s.tokens = opt.tokens;
      if (opt.context > 0) s.context = opt.context;
      s.num_sms = opt.num_sms;
      s.seed = opt.seed;
      TwoBatchLayer L(s);
      const std::vector<float> over = results(L, TwoBatchMode::overlapped, opt.layers, lead);
      const std::vector<float> seq = results(L, TwoBatchMode::sequential, opt.layers, lead);
      const bool equal = std::memcmp(over.data(), seq.data(), over.size() * sizeof(float)) == 0;
      failures += !equal;
      const double t_over = time_mode(L, TwoBatchMode::overlapped, opt, lead);
      const double t_seq = time_mode(L, TwoBatchMode::sequential, opt, lead);
      const double t_comp = time_mode(L, TwoBatchMode::compute_only, opt, lead);
      const double t_comm = time_mode(L, TwoBatchMode::comm_only, opt, lead);
      const double bound = std::max(t_comp, t_comm);
      std::printf("| %s | %d | %lld (%lld + %lld) | %lld | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %s |\n",
                  name.c_str(), s.ranks, (long long)s.tokens, (long long)s.tokens / 2, (long long)s.tokens / 2,
                  (long long)s.context, t_over, t_seq, t_comp, t_comm, bound, t_seq / t_over, t_over / bound,
                  equal ? "yes (bitwise)" : "NO");
      std::fflush(stdout);
    }
  cudaStreamDestroy(lead);
  return failures == 0 ? 0 : 1;
}

}  // namespace fp8moe::cuda
