// `fp8moe bench attention` (bench.hpp): the CUDA causal attention's paths (model_ops.hpp,
// AttentionPath: flash, the GEMM path looped and batched) side by side on one shape, by default the hidden-2048 config's (B = 8 sequences of
// 512 tokens, 16 heads, Dk 192, Dv 128), in FP32 or (--compute bf16) with BF16 GEMM operands.
// Timing as in bench.cpp (bench_util.hpp): L2 flushed before every timed run, median. The backward
// is timed on the forward's out and lse.
// FLOPs as the trainer counts them (train_flops_per_token): 2 * (Dk + Dv) per (query, key) pair
// with seq_len / 2 keys per query on average, the backward twice the forward (its recomputation of
// the scores not counted).
// Check: the GEMM path's outputs against the flash kernels', max |gemm - flash| / max |flash| per
// tensor below 1e-4 in FP32; 1e-2 in bf16, where the two paths' FP32 values of P and dS differ in
// the last bits and so may round to neighbouring BF16 values (2^-8 apart) before they multiply;
// the batched GEMMs' bits against the looped ones'.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/ops/model_ops.hpp"

namespace fp8moe::cuda {

namespace {

using namespace bench;

// A device [T, H, D] f32 tensor of N(0, 1) values.
struct Heads {
  DeviceBuffer buf;
  TensorView view;
  Heads(int64_t T, int64_t H, int64_t D)
      : buf(size_t(T * H * D) * 4), view(buf.p, DType::f32, {T, H, D}, Device::cuda) {}
  void randomize(uint64_t seed) {
    const int64_t n = view.numel();
    DeviceBuffer bf(size_t(n) * 2);
    fill_normal_bf16(bf.p, n, seed);
    cuda_convert(TensorView(bf.p, DType::bf16, {n}, Device::cuda), TensorView(buf.p, DType::f32, {n}, Device::cuda), nullptr);
  }
};

// max |a - b| / max |b| over two device tensors of n floats.
double rel_diff(const void* a, const void* b, size_t n) {
  const auto ha = to_host<float>(a, n), hb = to_host<float>(b, n);
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(double(ha[i]) - double(hb[i]));
    num = std::isfinite(d) ? std::max(num, d) : INFINITY;
    den = std::max(den, std::fabs(double(hb[i])));
  }
  return den > 0 ? num / den : num;
}

}  // namespace

int run_attention_bench(const AttentionBenchOptions& opt) {
  const cudaDeviceProp& prop = device_props();
  const int64_t B = opt.batch, S = opt.seq_len, H = opt.heads, Dk = opt.dk, Dv = opt.dv, T = B * S;
  FP8MOE_CHECK(B > 0 && S > 0 && H > 0 && Dk > 0 && Dv > 0, "bench attention: every dimension must be positive");
  const uint64_t seed = opt.seed ? opt.seed : (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  const double scale = 1.0 / std::sqrt(double(Dk));
  FP8MOE_CHECK(opt.compute == "f32" || opt.compute == "bf16",
               "bench attention: compute '" << opt.compute << "' must be f32 or bf16");
  const DType compute = opt.compute == "bf16" ? DType::bf16 : DType::f32;
  const double tolerance = compute == DType::bf16 ? 1e-2 : 1e-4;
  Heads q(T, H, Dk), k(T, H, Dk), v(T, H, Dv), dout(T, H, Dv);
  // Per path: out, lse [H, T] (as a [H, T, 1] array), dq, dk, dv.
  struct Outputs {
    Heads out, lse, dq, dk, dv;
    Outputs(int64_t T, int64_t H, int64_t Dk, int64_t Dv)
        : out(T, H, Dv), lse(H, T, 1), dq(T, H, Dk), dk(T, H, Dk), dv(T, H, Dv) {}
    TensorView lse_view() const { return TensorView(lse.buf.p, DType::f32, {lse.view.size(0), lse.view.size(1)}, Device::cuda); }
  };
  constexpr int kPaths = 3;
  const AttentionPath paths[kPaths] = {AttentionPath::flash, AttentionPath::gemm_looped, AttentionPath::gemm_batched};
  const char* names[kPaths] = {"flash (CUDA cores)", "gemm, looped (cuBLASLt, a GEMM per sequence)",
                               "gemm, batched (cuBLASLt, one GEMM over sequences and heads)"};
  std::vector<std::unique_ptr<Outputs>> outs;
  for (int p = 0; p < kPaths; ++p) outs.push_back(std::make_unique<Outputs>(T, H, Dk, Dv));
  q.randomize(seed);
  k.randomize(seed + 1);
  v.randomize(seed + 2);
  dout.randomize(seed + 3);

  const size_t fwd_per = cuda_attention_workspace_bytes(S, H, Dk, Dv, compute, false),
               bwd_per = cuda_attention_workspace_bytes(S, H, Dk, Dv, compute, true);
  const double fwd_flops = 2.0 * double(T) * (double(S) / 2.0) * double(H) * double(Dk + Dv), bwd_flops = 2 * fwd_flops;
  std::printf("# fp8moe bench attention on %s: B = %lld sequences of %lld, H = %lld, Dk = %lld, Dv = %lld, compute %s, "
              "seed %llu, median of %d, L2 flushed\n",
              prop.name, (long long)B, (long long)S, (long long)H, (long long)Dk, (long long)Dv, opt.compute.c_str(),
              (unsigned long long)seed, opt.iters);
  std::printf("# GEMM path workspace per sequence: forward %.1f MiB, backward %.1f MiB; cap %.0f MiB; for all %lld "
              "sequences forward %.0f MiB, backward %.0f MiB\n",
              double(fwd_per) / (1 << 20), double(bwd_per) / (1 << 20), double(kAttentionWorkspaceCap) / (1 << 20),
              (long long)B, double(B * fwd_per) / (1 << 20), double(B * bwd_per) / (1 << 20));
  std::printf("# causal FLOPs: forward %.2f G, backward %.2f G (2x forward)\n", fwd_flops / 1e9, bwd_flops / 1e9);
  std::printf("| path | forward us | forward TFLOPS | backward us | backward TFLOPS |\n|---|---|---|---|---|\n");
  std::fflush(stdout);

  Timer timer;
  double us[kPaths][2];
  for (int p = 0; p < kPaths; ++p) {
    Outputs& o = *outs[size_t(p)];
    us[p][0] = timer.median_us(
        [&] { cuda_attention_forward(q.view, k.view, v.view, o.out.view, o.lse_view(), S, scale, compute, nullptr, paths[p]); },
        opt.warmup, opt.iters);
    // Every backward takes the flash forward's out and lse.
    us[p][1] = timer.median_us(
        [&] {
          cuda_attention_backward(q.view, k.view, v.view, outs[0]->out.view, outs[0]->lse_view(), dout.view, o.dq.view,
                                  o.dk.view, o.dv.view, S, scale, compute, nullptr, paths[p]);
        },
        opt.warmup, opt.iters);
    std::printf("| %s | %.1f | %.2f | %.1f | %.2f |\n", names[p], us[p][0], fwd_flops / (us[p][0] * 1e6), us[p][1],
                bwd_flops / (us[p][1] * 1e6));
    std::fflush(stdout);
  }

  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto tensors = [](const Outputs& o) {
    return std::array<const Heads*, 5>{&o.out, &o.lse, &o.dq, &o.dk, &o.dv};
  };
  const auto f = tensors(*outs[0]), l = tensors(*outs[1]), g = tensors(*outs[2]);
  double diffs[5];
  bool same_bits = true;
  for (int i = 0; i < 5; ++i) {
    const size_t n = size_t(g[i]->view.numel());
    diffs[i] = rel_diff(g[i]->buf.p, f[i]->buf.p, n);
    same_bits = same_bits && to_host<uint32_t>(g[i]->buf.p, n) == to_host<uint32_t>(l[i]->buf.p, n);
  }
  const double worst = *std::max_element(diffs, diffs + 5);
  std::printf("# speedup batched / flash: forward %.2fx, backward %.2fx; batched / looped: forward %.2fx, backward %.2fx\n",
              us[0][0] / us[2][0], us[0][1] / us[2][1], us[1][0] / us[2][0], us[1][1] / us[2][1]);
  std::printf("# batched vs flash, max |diff| / max |flash|: out %.1e, lse %.1e, dq %.1e, dk %.1e, dv %.1e (%s)\n",
              diffs[0], diffs[1], diffs[2], diffs[3], diffs[4], worst < tolerance ? "ok" : "MISMATCH");
  std::printf("# batched vs looped: %s; the gemm path takes the %s form here\n",
              same_bits ? "bitwise equal" : "BITS DIFFER", cuda_attention_batched(B, S, H) ? "batched" : "looped");
  if (!same_bits) return 1;
  return worst < tolerance ? 0 : 1;
}

}  // namespace fp8moe::cuda
