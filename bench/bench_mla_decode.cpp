// `fp8moe bench mla-decode` (bench.hpp): the absorbed MLA decode attention over the paged latent
// cache (src/cuda/attention/mla_decode.cu) at DeepSeek-V3's shape, B sequences of `context` tokens
// each in blocks scattered over the pool. Each row gives the bytes of cache the call must read
// (every sequence's rows in the cache's stored form) over its time, against the device copy
// bandwidth measured in the same run (a 1 GiB device-to-device copy, read + write counted), and the
// Tensor Core work (2 (rkv + dr) + 2 rkv flops per head and token) per second: with many heads per
// latent the call is bound by the MMAs, not the bytes (ridge: flops per cache byte).
// L2 is flushed clean before every timed launch (the cache comes from DRAM, as in a decode step).
// Correctness: each cache form's first case, and every case of a forced split count (--splits), against
// the CUDA-core path (FP32), rel error < 1e-2.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "cuda/attention/mla_decode.hpp"
#include "cuda/kernel_api.hpp"
#include "fp8moe/similarity.hpp"

namespace fp8moe::cuda {

using namespace bench;

namespace {

// One layer's cache of `blocks` blocks in the stored form, random contents.
struct BenchCache {
  std::optional<DeviceBuffer> rows, latent, scale, rope;
  MlaCacheView view;
  int64_t bytes_per_token = 0;
};

void make_cache(BenchCache& c, bool fp8, int64_t slots, int64_t rkv, int64_t dr, uint64_t seed) {
  const int64_t W = rkv + dr, G = rkv / kQuantGroup;
  if (!fp8) {
    c.rows.emplace(size_t(slots * W) * 2);
    fill_normal_bf16(c.rows->p, slots * W, seed);
    c.view.rows = TensorView(c.rows->p, DType::bf16, {slots, W}, Device::cuda);
    c.bytes_per_token = W * 2;
    return;
  }
  c.latent.emplace(size_t(slots * rkv));
  c.scale.emplace(size_t(slots * G) * 4);
  c.rope.emplace(size_t(slots * dr) * 2);
  {  // E4M3 codes of N(0, 1) values (the quantizer's own scales are dropped: one scale for all)
    DeviceBuffer tmp(size_t(slots * rkv) * 2);
    fill_normal_bf16(tmp.p, slots * rkv, seed);
    DeviceBuffer tmp_scales(size_t(G * scale_ld(slots)) * 4);
    const QuantizedView qv{TensorView(c.latent->p, DType::e4m3, {slots, rkv}, Device::cuda),
                           TensorView(tmp_scales.p, DType::f32, {G, scale_ld(slots)}, Device::cuda),
                           ScaleKind::tile_1x128};
    quantize_1x128_cuda(TensorView(tmp.p, DType::bf16, {slots, rkv}, Device::cuda), qv, ScaleMode::fp32, nullptr, false);
    FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const std::vector<float> s(size_t(slots * G), 4.0f / 448.0f);
  FP8MOE_CUDA_CHECK(cudaMemcpy(c.scale->p, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
  fill_normal_bf16(c.rope->p, slots * dr, seed + 1);
  c.view.latent = TensorView(c.latent->p, DType::e4m3, {slots, rkv}, Device::cuda);
  c.view.scale = TensorView(c.scale->p, DType::f32, {slots, G}, Device::cuda);
  c.view.rope = TensorView(c.rope->p, DType::bf16, {slots, dr}, Device::cuda);
  c.bytes_per_token = rkv + 4 * G + 2 * dr;
}

}  // namespace

int run_mla_decode_bench(const MlaDecodeBenchOptions& opt) {
  FP8MOE_CHECK(opt.iters >= 1 && opt.warmup >= 0, "bench mla-decode: --iters must be >= 1 and --warmup >= 0");
  FP8MOE_CHECK(opt.heads >= 1 && opt.rkv % 128 == 0 && opt.dr % 8 == 0 && opt.dr > 0,
               "bench mla-decode: needs heads >= 1, rkv % 128 == 0, dr % 8 == 0, got " << opt.heads << ", " << opt.rkv
                                                                                      << ", " << opt.dr);
  for (const int64_t sp : opt.splits)
    FP8MOE_CHECK(sp >= 0 && (sp == 0 || !opt.by_length),
                 "bench mla-decode: --splits takes counts >= 0 (0: the plan's), and a forced count needs fit_batch "
                 "(not --by-length), got " << sp);
  for (const std::string& c : opt.caches)
    FP8MOE_CHECK(c == "bf16" || c == "fp8", "bench mla-decode: --cache takes bf16 and fp8, got '" << c << "'");
  const cudaDeviceProp& prop = device_props();
  Timer timer;
  const Flush flush = Flush::clean;
  const size_t copy_bytes = size_t(1) << 30;
  double copy_gbs = 0;
  {
    DeviceBuffer src(copy_bytes), dst(copy_bytes);
    FP8MOE_CUDA_CHECK(cudaMemset(src.p, 1, copy_bytes));
    const double t_copy = timer.median_us(
        [&] { FP8MOE_CUDA_CHECK(cudaMemcpyAsync(dst.p, src.p, copy_bytes, cudaMemcpyDeviceToDevice, nullptr)); }, 2, 5,
        flush);
    copy_gbs = 2.0 * double(copy_bytes) / t_copy * 1e-3;
  }
  const int64_t H = opt.heads, rkv = opt.rkv, dr = opt.dr, W = rkv + dr;
  std::printf("# bench mla-decode on %s (%d SMs): H=%lld rkv=%lld dr=%lld, one query token per sequence, %s splits, "
              "median of %d (warm-up %d), L2 flushed clean; device copy %.0f GB/s (1 GiB, read + write)\n",
              prop.name, prop.multiProcessorCount, (long long)H, (long long)rkv, (long long)dr,
              opt.by_length ? "by_length" : "fit_batch", opt.iters, opt.warmup, copy_gbs);
  std::printf("# cache MB: the rows the call reads (stored form); GB/s and of copy: those bytes over the time; "
              "TFLOP/s: 2 H (2 rkv + dr) flops per token; flop/B: the same per cache byte\n");
  std::printf("| cache | B | context | path | splits x head tiles | us | cache MB | GB/s | of copy | TFLOP/s | flop/B |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  uint64_t seed = opt.seed ? opt.seed : std::random_device{}();
  std::mt19937_64 rng(seed);
  int status = 0;
  std::vector<double> r_copy;
  for (const std::string& cache_name : opt.caches) {
    const bool fp8 = cache_name == "fp8";
    bool checked = !opt.check;
    for (const int64_t B : opt.batch)
      for (const int64_t ctx : opt.context) {
        const int64_t nb = (ctx + kMlaBlockTokens - 1) / kMlaBlockTokens, blocks = B * nb + 1,
                      slots = blocks * kMlaBlockTokens;
        BenchCache cache;
        make_cache(cache, fp8, slots, rkv, dr, ++seed);
        std::vector<int32_t> order(static_cast<size_t>(blocks));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<int32_t> lengths(static_cast<size_t>(B), int32_t(ctx));
        DeviceBuffer table(size_t(B * nb) * 4), len(size_t(B) * 4), q(size_t(B * H * W) * 4), o(size_t(B * H * rkv) * 4),
            o_ref(size_t(B * H * rkv) * 4);
        FP8MOE_CUDA_CHECK(cudaMemcpy(table.p, order.data(), size_t(B * nb) * 4, cudaMemcpyHostToDevice));
        FP8MOE_CUDA_CHECK(cudaMemcpy(len.p, lengths.data(), size_t(B) * 4, cudaMemcpyHostToDevice));
        {  // q ~ N(0, 1) in f32
          std::normal_distribution<float> nd;
          std::vector<float> qh(static_cast<size_t>(B * H * W));
          for (float& x : qh) x = nd(rng);
          FP8MOE_CUDA_CHECK(cudaMemcpy(q.p, qh.data(), qh.size() * 4, cudaMemcpyHostToDevice));
        }
        const TensorView qv(q.p, DType::f32, {B * H, W}, Device::cuda), ov(o.p, DType::f32, {B * H, rkv}, Device::cuda),
            orv(o_ref.p, DType::f32, {B * H, rkv}, Device::cuda), tv(table.p, DType::i32, {B, nb}, Device::cuda),
            lv(len.p, DType::i32, {B}, Device::cuda);
        const double scale = 1.0 / std::sqrt(double(192));
        const MlaDecodeShape shape = check_mla_decode(qv, cache.view, tv, lv, ov, Device::cuda);
        const MlaDecodeSplits rule = opt.by_length ? MlaDecodeSplits::by_length : MlaDecodeSplits::fit_batch;
        for (const int64_t forced : opt.splits) {
          const MlaDecodePlan plan = mla_decode_plan(shape, qv, cache.view, MlaDecodePath::automatic, forced, rule);
          auto call = [&] {
            mla_decode_attention_cuda(qv, cache.view, tv, lv, scale, ov, nullptr, MlaDecodePath::automatic, forced, rule);
          };
          call();
          FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
          std::string note;
          if (!checked || (forced > 0 && opt.check)) {  // a forced count is checked every time
            mla_decode_attention_cuda(qv, cache.view, tv, lv, scale, orv, nullptr, MlaDecodePath::cuda_core);
            FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
            const double err =
                rel_error(d_to_doubles(o.p, B * H, rkv, true), d_to_doubles(o_ref.p, B * H, rkv, true));
            char buf[96];
            std::snprintf(buf, sizeof buf, " (rel err vs CUDA-core path %.1e)", err);
            note = buf;
            if (!(err < 1e-2)) status = 1;
            checked = true;
          }
          const double us = timer.median_us(call, opt.warmup, opt.iters, flush);
          const double bytes = double(B * ctx) * double(cache.bytes_per_token);
          const double gbs = bytes / us * 1e-3, flops = 2.0 * double(B * ctx) * double(H) * double(2 * rkv + dr);
          r_copy.push_back(gbs / copy_gbs);
          std::printf("| %s | %lld | %lld | %s | %lld x %lld%s | %.1f | %.1f | %.0f | %.1f%% | %.0f | %.0f |%s\n",
                      cache_name.c_str(), (long long)B, (long long)ctx,
                      plan.path == MlaDecodePath::tensor_core ? "tensor_core" : "cuda_core", (long long)plan.splits,
                      (long long)plan.head_tiles, forced ? " (forced)" : "", us, bytes * 1e-6, gbs,
                      100.0 * gbs / copy_gbs, flops / us * 1e-6, flops / bytes, note.c_str());
          std::fflush(stdout);
        }
      }
  }
  std::printf("# geomean cache bandwidth of copy %.1f%%; seed %llu\n", 100.0 * geomean(r_copy),
              (unsigned long long)seed);
  if (status) std::printf("# FAILED: the tensor-core path disagrees with the CUDA-core path\n");
  return status;
}

}  // namespace fp8moe::cuda
