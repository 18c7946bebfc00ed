// `fp8moe bench attention` (bench.hpp): the CUDA causal attention's two paths (model_ops.hpp,
// AttentionPath) side by side on one shape, by default the hidden-2048 config's (B = 8 sequences of
// 512 tokens, 16 heads, Dk 192, Dv 128), in FP32 or (--compute bf16) with BF16 GEMM operands.
// Timing as in bench.cpp (bench_util.hpp): L2 flushed before every timed run, median. The backward
// is timed on the forward's out and lse.
// FLOPs as the trainer counts them (train_flops_per_token): 2 * (Dk + Dv) per (query, key) pair
// with seq_len / 2 keys per query on average, the backward twice the forward (its recomputation of
// the scores not counted).
// Check: the GEMM path's outputs against the flash kernels', max |gemm - flash| / max |flash| per
// tensor below 1e-4 in FP32; 1e-2 in bf16, where the two paths' FP32 values of P and dS differ in
// the last bits and so may round to neighbouring BF16 values (2^-8 apart) before they multiply.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

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
  Heads q(T, H, Dk), k(T, H, Dk), v(T, H, Dv), dout(T, H, Dv), dq(T, H, Dk), dk(T, H, Dk), dv(T, H, Dv);
  Heads out_f(T, H, Dv), out_g(T, H, Dv), dq_g(T, H, Dk), dk_g(T, H, Dk), dv_g(T, H, Dv);
  DeviceBuffer lse_f(size_t(H * T) * 4), lse_g(size_t(H * T) * 4);
  const TensorView lse_fv(lse_f.p, DType::f32, {H, T}, Device::cuda), lse_gv(lse_g.p, DType::f32, {H, T}, Device::cuda);
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
  double us[2][2];
  const AttentionPath paths[2] = {AttentionPath::flash, AttentionPath::gemm};
  for (int p = 0; p < 2; ++p) {
    const bool gemm = paths[p] == AttentionPath::gemm;
    const TensorView& out = gemm ? out_g.view : out_f.view;
    const TensorView& lse = gemm ? lse_gv : lse_fv;
    us[p][0] = timer.median_us([&] { cuda_attention_forward(q.view, k.view, v.view, out, lse, S, scale, compute, nullptr, paths[p]); },
                               opt.warmup, opt.iters);
    // Both backwards take the flash forward's out and lse.
    us[p][1] = timer.median_us(
        [&] {
          cuda_attention_backward(q.view, k.view, v.view, out_f.view, lse_fv, dout.view, gemm ? dq_g.view : dq.view,
                                  gemm ? dk_g.view : dk.view, gemm ? dv_g.view : dv.view, S, scale, compute, nullptr,
                                  paths[p]);
        },
        opt.warmup, opt.iters);
    std::printf("| %s | %.1f | %.2f | %.1f | %.2f |\n", gemm ? "gemm (cuBLASLt)" : "flash (CUDA cores)",
                us[p][0], fwd_flops / (us[p][0] * 1e6), us[p][1], bwd_flops / (us[p][1] * 1e6));
    std::fflush(stdout);
  }

  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t nq = size_t(T * H * Dk), nv = size_t(T * H * Dv);
  const double diffs[5] = {rel_diff(out_g.buf.p, out_f.buf.p, nv), rel_diff(lse_g.p, lse_f.p, size_t(H * T)),
                           rel_diff(dq_g.buf.p, dq.buf.p, nq), rel_diff(dk_g.buf.p, dk.buf.p, nq),
                           rel_diff(dv_g.buf.p, dv.buf.p, nv)};
  const double worst = *std::max_element(diffs, diffs + 5);
  std::printf("# speedup gemm / flash: forward %.2fx, backward %.2fx\n", us[0][0] / us[1][0], us[0][1] / us[1][1]);
  std::printf("# gemm vs flash, max |diff| / max |flash|: out %.1e, lse %.1e, dq %.1e, dk %.1e, dv %.1e (%s)\n",
              diffs[0], diffs[1], diffs[2], diffs[3], diffs[4], worst < tolerance ? "ok" : "MISMATCH");
  return worst < tolerance ? 0 : 1;
}

}  // namespace fp8moe::cuda
