// `fp8moe bench permute` (bench.hpp): the MoE dispatch ops on DeepSeek-V3 routing (T tokens, top-k
// of G experts drawn uniformly without repeats, hidden size D), in GB/s against the device copy
// bandwidth measured in the same run, and byte for byte against the CPU backend's ops on the whole
// outputs. Timing as in bench.cpp (bench_util.hpp): L2 flushed before every timed run, median.
//
// Bytes are counted as read + written, the least each op must move (the copy counts both too):
//   moe_layout            expert_ids read; row_slot, row_group [R], slot_row [T, k], offsets written
//   moe_permute           T * k source rows (bf16) and row_slot read; R rows (bf16) written
//   moe_permute_quantize  the same reads; R rows of e4m3 and their 1x128 scales written
//   moe_combine           T * k rows of y (bf16), slot_row and w read; out [T, D] f32 written
// R = moe_layout_rows(T * k, G, align), the rows a caller allocates without reading the counts
// back; the rows past offsets[G] are written too (zeros), as the op contracts say.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "cpu/cpu_ops.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/moe/moe_api.hpp"

namespace fp8moe::cuda {

namespace {

using namespace bench;

// Host copy of a device view.
Tensor host_copy(const TensorView& d) {
  Tensor h = Tensor::host_like(d);
  FP8MOE_CUDA_CHECK(cudaMemcpy(h.view().data, d.data, d.nbytes(), cudaMemcpyDeviceToHost));
  return h;
}

bool same_bytes(const TensorView& dev, const TensorView& host) {
  return dev.nbytes() == host.nbytes() && std::memcmp(host_copy(dev).view().data, host.data, host.nbytes()) == 0;
}

// expert_ids [T, k]: k distinct experts per token, uniform over [0, G).
Tensor uniform_routing(std::mt19937_64& rng, int64_t T, int64_t k, int64_t G) {
  Tensor ids = Tensor::host(DType::i32, {T, k});
  int32_t* id = ids.ptr<int32_t>();
  std::uniform_int_distribution<int32_t> pick(0, int32_t(G - 1));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      int32_t g;
      do g = pick(rng);
      while (std::find(id + t * k, id + t * k + j, g) != id + t * k + j);
      id[t * k + j] = g;
    }
  return ids;
}

}  // namespace

int run_permute_bench(const PermuteBenchOptions& opt) {
  const cudaDeviceProp& prop = device_props();
  const int64_t T = opt.tokens, k = opt.topk, G = opt.experts, D = opt.hidden, align = opt.align;
  FP8MOE_CHECK(T > 0 && k > 0 && k <= G && D > 0 && D % kQuantGroup == 0 && align > 0,
               "bench permute: need tokens, topk > 0, topk <= experts, hidden a multiple of 128, align > 0");
  const uint64_t seed = opt.seed ? opt.seed : (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  const int64_t n = T * k, R = moe_layout_rows(n, G, align), ld = scale_ld(R);
  std::mt19937_64 rng(seed);
  const Tensor ids_h = uniform_routing(rng, T, k, G);
  Tensor w_h = Tensor::host(DType::f32, {T, k});
  std::uniform_real_distribution<float> unit(0.01f, 1.0f);
  for (int64_t i = 0; i < n; ++i) w_h.ptr<float>()[i] = unit(rng);

  // Device tensors: inputs, the layout tables, and one output per op.
  DeviceBuffer ids(size_t(n) * 4), w(size_t(n) * 4), x(size_t(T * D) * 2), rs(size_t(R) * 4), rg(size_t(R) * 4),
      sr(size_t(n) * 4), off(size_t(G + 1) * 4), perm(size_t(R * D) * 2), out(size_t(T * D) * 4);
  DeviceQuantized q(R, D, ScaleKind::tile_1x128);
  const TensorView ids_v = dview(ids.p, DType::i32, T, k), w_v = dview(w.p, DType::f32, T, k),
                   x_v = dview(x.p, DType::bf16, T, D), sr_v = dview(sr.p, DType::i32, T, k),
                   perm_v = dview(perm.p, DType::bf16, R, D), out_v = dview(out.p, DType::f32, T, D);
  const TensorView rs_v(rs.p, DType::i32, {R}, Device::cuda), rg_v(rg.p, DType::i32, {R}, Device::cuda),
      off_v(off.p, DType::i32, {G + 1}, Device::cuda);
  FP8MOE_CUDA_CHECK(cudaMemcpy(ids.p, ids_h.view().data, ids.bytes, cudaMemcpyHostToDevice));
  FP8MOE_CUDA_CHECK(cudaMemcpy(w.p, w_h.view().data, w.bytes, cudaMemcpyHostToDevice));
  fill_normal_bf16(x.p, T * D, seed);

  auto layout = [&] { moe_layout_cuda(ids_v, align, rs_v, rg_v, sr_v, off_v, nullptr); };
  auto permute = [&] { moe_permute_cuda(x_v, rs_v, k, TensorView{}, perm_v, nullptr); };
  auto permute_quantize = [&] { moe_permute_quantize_cuda(x_v, rs_v, k, TensorView{}, q.view, ScaleMode::pow2, nullptr); };
  auto combine = [&] { moe_combine_cuda(perm_v, sr_v, w_v, out_v, false, nullptr); };
  layout();
  permute();
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const Tensor off_h = host_copy(off_v);
  const int32_t* o = off_h.ptr<int32_t>();
  int32_t lo = o[1] - o[0], hi = lo;
  for (int64_t g = 0; g < G; ++g) {
    lo = std::min(lo, o[g + 1] - o[g]);
    hi = std::max(hi, o[g + 1] - o[g]);
  }

  std::printf("# fp8moe bench permute on %s, T = %lld tokens, top-%lld of %lld experts (uniform), D = %lld, align %lld, "
              "seed %llu, median of %d, L2 flushed\n",
              prop.name, (long long)T, (long long)k, (long long)G, (long long)D, (long long)align,
              (unsigned long long)seed, opt.iters);
  std::printf("# layout: R = %lld rows allocated (moe_layout_rows), %d used; padded segments of %d..%d rows\n",
              (long long)R, o[G], lo, hi);

  Timer timer;
  // Copy bandwidth over the bytes of the gathered rows (read + written).
  const size_t copy_bytes = size_t(n * D) * 2;
  DeviceBuffer csrc(copy_bytes), cdst(copy_bytes);
  const double t_copy = timer.median_us(
      [&] { FP8MOE_CUDA_CHECK(cudaMemcpyAsync(cdst.p, csrc.p, copy_bytes, cudaMemcpyDeviceToDevice, nullptr)); },
      opt.warmup, opt.iters);
  const double copy_gbs = 2.0 * double(copy_bytes) / (t_copy * 1e3);
  std::printf("| op | moved | MiB | us | GB/s | %% of copy | bit-exact vs CPU |\n|---|---|---|---|---|---|---|\n");
  std::printf("| device copy (D2D) | %lld x %lld bf16 | %.0f | %.1f | %.0f | 100%% | - |\n", (long long)n,
              (long long)D, 2.0 * double(copy_bytes) / (1 << 20), t_copy, copy_gbs);
  std::fflush(stdout);

  const double rows_in = double(n) * double(D) * 2;  // the T * k gathered bf16 rows
  struct Case {
    const char* name;
    const char* moved;
    double bytes;
    std::function<void()> run;
  };
  const Case cases[] = {
      {"moe_layout", "ids -> 4 tables", double(n) * 8 + double(R) * 8 + double(G + 1) * 4, layout},
      {"moe_permute", "bf16 -> bf16 rows", rows_in + double(R) * 4 + double(R * D) * 2, permute},
      {"moe_permute_quantize", "bf16 -> e4m3 1x128 pow2", rows_in + double(R) * 4 + double(R * D) +
                                                                double(D / kQuantGroup * ld) * 4, permute_quantize},
      {"moe_combine", "bf16 rows -> f32 [T, D]", rows_in + double(n) * 8 + double(T * D) * 4, combine},
  };
  double us[4];
  for (int c = 0; c < 4; ++c) us[c] = timer.median_us(cases[c].run, opt.warmup, opt.iters);

  // The outputs of the last timed runs (every op is deterministic) against the CPU backend.
  const char* exact[4] = {"-", "-", "-", "-"};
  bool all_exact = true;
  if (opt.check) {
    FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    const Tensor x_h = host_copy(x_v);
    Tensor rs_h = Tensor::host(DType::i32, {R}), rg_h = Tensor::host(DType::i32, {R}),
           sr_h = Tensor::host(DType::i32, {T, k}), off_ref = Tensor::host(DType::i32, {G + 1}),
           perm_h = Tensor::host(DType::bf16, {R, D}), out_h = Tensor::host(DType::f32, {T, D});
    QuantizedTensor q_h = make_quantized_host(R, D, DType::e4m3, ScaleKind::tile_1x128);
    cpu::moe_layout(ids_h, align, rs_h, rg_h, sr_h, off_ref);
    cpu::moe_permute(x_h, rs_h, k, TensorView{}, perm_h);
    cpu::moe_permute_quantize(x_h, rs_h, k, TensorView{}, q_h, ScaleMode::pow2);
    cpu::moe_combine(perm_h, sr_h, w_h, out_h, false);
    const bool ok[4] = {same_bytes(rs_v, rs_h) && same_bytes(rg_v, rg_h) && same_bytes(sr_v, sr_h) &&
                            same_bytes(off_v, off_ref),
                        same_bytes(perm_v, perm_h),
                        same_bytes(q.view.values, q_h.values) && same_bytes(q.view.scales, q_h.scales),
                        same_bytes(out_v, out_h)};
    for (int c = 0; c < 4; ++c) {
      exact[c] = ok[c] ? "yes" : "NO";
      all_exact = all_exact && ok[c];
    }
  }
  for (int c = 0; c < 4; ++c) {
    const double gbs = cases[c].bytes / (us[c] * 1e3);
    std::printf("| %s | %s | %.0f | %.1f | %.0f | %.1f%% | %s |\n", cases[c].name, cases[c].moved,
                cases[c].bytes / (1 << 20), us[c], gbs, 100.0 * gbs / copy_gbs, exact[c]);
  }
  std::printf("# moe_permute_quantize at %.1f%% of copy bandwidth (target >= 80%%); bit-exact: %s\n",
              100.0 * cases[2].bytes / (us[2] * 1e3) / copy_gbs,
              opt.check ? (all_exact ? "all ops" : "MISMATCH") : "not checked");
  return all_exact ? 0 : 1;
}

}  // namespace fp8moe::cuda
