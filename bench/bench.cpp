// `fp8moe bench gemm` / `fp8moe bench quant` (bench.hpp): our kernels against cuBLASLt on the
// DeepSeek-V3 shapes, measured side by side in one run.
//
// Timing: every timed launch follows a 512 MiB memset that flushes L2 and gives the host time to
// enqueue the launch, so the event pair around it measures GPU time only; median of `iters`. Ours,
// cuBLASLt's FP8 GEMM and the tiles timed beside ours take turns launch by launch, each round in
// a new random order (Timer::interleaved).
// Correctness (GEMM): D of sampled rows against two FP64 host references: the unquantized BF16
// inputs (calc_diff, recipe error) and the dequantized FP8 inputs (relative error, kernel error);
// plus calc_diff against cuBLASLt's D on every element. Quantizers: byte-exact comparison with
// the CPU quantizers on the whole tensor.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/similarity.hpp"
#include "fp8moe/codecs.hpp"
#include "cuda/kernel_api.hpp"

namespace fp8moe::cuda {

using namespace bench;

std::vector<GemmCase> parse_gemm_shapes(const std::string& list) {
  std::vector<GemmCase> v;
  size_t pos = 0;
  while (pos <= list.size()) {
    const size_t end = std::min(list.find(',', pos), list.size());
    const std::string item = list.substr(pos, end - pos);
    const size_t colon = item.find(':');
    GemmCase c{colon == std::string::npos ? "" : item.substr(0, colon), 0, 0, 0};
    long long m = 0, n = 0, k = 0;
    char tail = 0;
    const bool parsed = colon != std::string::npos &&
                        std::sscanf(item.c_str() + colon + 1, "%lldx%lldx%lld%c", &m, &n, &k, &tail) == 3;
    FP8MOE_CHECK(parsed && m > 0 && n > 0 && k > 0 &&
                     (c.kind == "fprop" || c.kind == "fprop32" || c.kind == "fprop32+" || c.kind == "wgrad"),
                 "bench gemm --shapes: '" << item << "' is not kind:MxNxK with kind fprop | fprop32 | fprop32+ | wgrad");
    c.M = m, c.N = n, c.K = k;
    v.push_back(c);
    pos = end + 1;
  }
  return v;
}

namespace {

using namespace bench;

std::vector<GemmCase> gemm_cases(const std::string& set) {
  const int64_t nk[6][2] = {{2112, 7168}, {24576, 1536}, {32768, 512}, {7168, 16384}, {4096, 7168}, {7168, 2048}};
  std::vector<GemmCase> v;
  const bool all = set == "all";
  for (int64_t m : {64, 128, 4096}) {
    const bool want = all || set == "fprop" || (set == "m4096" && m == 4096) || (set == "small" && m != 4096);
    if (!want) continue;
    for (auto& p : nk) v.push_back({"fprop", m, p[0], p[1]});
  }
  if (all || set == "wgrad")
    for (auto& p : nk) v.push_back({"wgrad", p[0], p[1], 4096});  // dW [N_out, K_in] over 4096 tokens
  if (all || set == "tails") {
    v.push_back({"fprop", 1000, 2104, 7168});
    v.push_back({"fprop", 77, 1544, 640});
    v.push_back({"fprop", 4096, 7168 + 72, 2048});
    v.push_back({"wgrad", 1000, 520, 4224});
  }
  return v;
}

// The emulated Tensor Core accumulation (gemm_fp8_emulated.cu) at the fp8-no-promotion recipe's
// setting (14 bits, never promoted): its time, and calc_diff against our kernel's D (Tensor Core
// accumulation promoted every 128) as a sanity check (< 1e-3, no NaN). Returns false on a failure.
bool emulated_rows(const GemmBenchOptions& opt, uint64_t seed, Timer& timer) {
  const GemmCase cases[] = {{"fprop", 4096, 2112, 7168}, {"fprop", 4096, 7168, 2048}, {"fprop", 8192, 768, 768},
                            {"fprop", 8192, 3072, 768},  {"wgrad", 768, 3072, 8192}};
  GemmOptions emu;
  emu.accum = {AccumMode::tensor_core, 14, 0};
  std::printf("# emulated Tensor Core accumulation (accum tensor_core, 14 bits, N_c = 0: never promoted); "
              "vs_ours: calc_diff against our kernel's D (promotion every 128)\n");
  std::printf("| kind | M | N | K | emulated us | emulated TFLOPS | ours/emulated time | vs_ours |\n|---|---|---|---|---|---|---|---|\n");
  bool all_ok = true;
  int case_id = 100;
  for (const GemmCase& gc : cases) {
    ++case_id;
    const int64_t M = gc.M, N = gc.N, K = gc.K;
    const bool wgrad = gc.b_1x128();
    const DType ddt = wgrad ? DType::f32 : DType::bf16;
    const size_t dbytes = size_t(M * N) * dtype_size(ddt);
    DeviceBuffer a16(size_t(M * K) * 2), b16(size_t(N * K) * 2);
    fill_normal_bf16(a16.p, M * K, seed + 2 * uint64_t(case_id));
    fill_normal_bf16(b16.p, N * K, seed + 2 * uint64_t(case_id) + 1);
    DeviceQuantized aq(M, K, ScaleKind::tile_1x128), bq(N, K, wgrad ? ScaleKind::tile_1x128 : ScaleKind::block_128x128);
    quantize_1x128_cuda(dview(a16.p, DType::bf16, M, K), aq.view, ScaleMode::fp32, nullptr, false);
    if (wgrad) quantize_1x128_cuda(dview(b16.p, DType::bf16, N, K), bq.view, ScaleMode::fp32, nullptr, false);
    else quantize_128x128_cuda(dview(b16.p, DType::bf16, N, K), bq.view, ScaleMode::fp32, nullptr, false);
    DeviceBuffer d_emu(dbytes), d_ours(dbytes);
    const TensorView dv_emu = dview(d_emu.p, ddt, M, N), dv_ours = dview(d_ours.p, ddt, M, N);
    const double t_emu = timer.median_us([&] { gemm_fp8_emulated(aq.view, bq.view, dv_emu, emu, nullptr); },
                                         std::min(opt.warmup, 1), std::min(opt.iters, 5));
    const double t_ours = timer.median_us([&] { gemm_fp8_sm90(aq.view, bq.view, dv_ours, false, nullptr); }, opt.warmup,
                                          opt.iters);
    FP8MOE_CUDA_CHECK(cudaMemset(d_emu.p, 0xFF, dbytes));
    gemm_fp8_emulated(aq.view, bq.view, dv_emu, emu, nullptr);
    gemm_fp8_sm90(aq.view, bq.view, dv_ours, false, nullptr);
    FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<double> e = d_to_doubles(d_emu.p, M, N, wgrad), o = d_to_doubles(d_ours.p, M, N, wgrad);
    const double cd = calc_diff(e, o);
    const bool ok = !has_nan(e) && cd < 1e-3;
    all_ok = all_ok && ok;
    const double tflops = 2.0 * double(M) * double(N) * double(K) / (t_emu * 1e-6) / 1e12;
    std::printf("| %s | %lld | %lld | %lld | %.0f | %.2f | %.4f | %.2e |%s\n", gc.kind.c_str(), (long long)M, (long long)N,
                (long long)K, t_emu, tflops, t_ours / t_emu, cd, ok ? "" : " FAIL");
    std::fflush(stdout);
  }
  return all_ok;
}

}  // namespace

int run_gemm_bench(const GemmBenchOptions& opt) {
  const cudaDeviceProp& prop = device_props();
  FP8MOE_CHECK(sm90_available(), "bench gemm: needs a Hopper GPU (sm_90), found " << prop.name);
  uint64_t seed = opt.seed ? opt.seed : (uint64_t(std::random_device{}()) << 32 | std::random_device{}());
  Timer timer;
  timer.clocks = opt.clocks || opt.ceiling;
  std::printf("# fp8moe bench gemm on %s (%d SMs), seed %llu, median of %d (warm-up %d, L2 flushed: %s)\n", prop.name,
              prop.multiProcessorCount, (unsigned long long)seed, opt.iters, opt.warmup,
              timer.default_mode == Flush::clean ? "clean" : "dirty");
  if (opt.set == "emulated") {
    const bool ok = emulated_rows(opt, seed, timer);
    std::printf("# correctness: %s\n", ok ? "all passed" : "FAILURES (see FAIL rows)");
    return ok ? 0 : 1;
  }
  std::printf("# fprop: A 1x128 x B 128x128 -> bf16 (fprop32: -> f32, fprop32+: f32 D += );  wgrad: A 1x128 x B 1x128 "
              "-> f32, D += A*B^T;  tile BMxBN "
              "(/direct: epilogue without TMA-store staging; /mc2: B multicast over 2-CTA clusters; /pipe: pipelined "
              "mainloop; /f32: FP32 staging for f32 D; /sN: N K slices summed by a second kernel; /tN: the last wave's tiles in N K slices)\n");
  std::printf("# calc_diff: vs FP64 product of the unquantized bf16 inputs (%d sampled rows); kerr: rel. error vs FP64 "
              "product of the dequantized FP8 inputs (rounded to bf16 for bf16 D); vs_lt: calc_diff ours vs cuBLASLt (all of D)\n",
              opt.check_rows);
  std::printf("# alt us: another tile timed beside the choice (256x128 -> 128x128; 128x128/f32 -> 128x192/f32; /sN, /tN (K slices) -> the choice without slices; 128x128 -> "
              "B multicast over 2-CTA clusters, max active clusters: fprop %d, fprop/direct %d, wgrad %d of %d SM pairs)\n",
              gemm_fp8_sm90_max_active_clusters({128, 128, true, 2}, false),
              gemm_fp8_sm90_max_active_clusters({128, 128, false, 2}, false),
              gemm_fp8_sm90_max_active_clusters({128, 128, true, 2}, true), prop.multiProcessorCount / 2);
  std::printf("| kind | M | N | K | tile | ours us | ours TFLOPS | cuBLASLt-FP8 TFLOPS | cuBLASLt-BF16 TFLOPS | ours/cuBLASLt | calc_diff | kerr | vs_lt | alt us |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);

  const std::vector<GemmCase> cases = opt.shapes.empty() ? gemm_cases(opt.set) : parse_gemm_shapes(opt.shapes);
  bool all_ok = true;
  const std::vector<GemmTile> extra = extra_tiles_from_env();
  std::vector<std::vector<double>> extra_speedup(extra.size());  // chosen time / extra time, M=4096 fprop
  std::vector<double> r_m4096, r_small, r_wgrad, r_all, r_m4096_clk;
  // --ceiling, [bare, promoted]: cuBLASLt time / ceiling time (M = 4096 fprop; wgrad), ceiling / ours.
  std::vector<double> r_ceil_lt[2], r_ceil_ours[2], r_ceil_wg_lt[2];
  int case_id = 0;
  for (const GemmCase& gc : cases) {
    ++case_id;
    const int64_t M = gc.M, N = gc.N, K = gc.K;
    const bool wgrad = gc.b_1x128(), acc = gc.accumulate();
    const ScaleKind bkind = wgrad ? ScaleKind::tile_1x128 : ScaleKind::block_128x128;
    const DType ddt = gc.f32() ? DType::f32 : DType::bf16;
    const size_t dbytes = size_t(M * N) * dtype_size(ddt);

    DeviceBuffer a16(size_t(M * K) * 2), b16(size_t(N * K) * 2);
    fill_normal_bf16(a16.p, M * K, seed + 2 * uint64_t(case_id));
    fill_normal_bf16(b16.p, N * K, seed + 2 * uint64_t(case_id) + 1);
    DeviceQuantized aq(M, K, ScaleKind::tile_1x128), bq(N, K, bkind);
    quantize_1x128_cuda(dview(a16.p, DType::bf16, M, K), aq.view, ScaleMode::fp32, nullptr, false);
    if (wgrad)
      quantize_1x128_cuda(dview(b16.p, DType::bf16, N, K), bq.view, ScaleMode::fp32, nullptr, false);
    else
      quantize_128x128_cuda(dview(b16.p, DType::bf16, N, K), bq.view, ScaleMode::fp32, nullptr, false);
    DeviceBuffer d_ours(dbytes), d_lt(dbytes), d_bf(dbytes);
    const TensorView dv_ours = dview(d_ours.p, ddt, M, N), dv_lt = dview(d_lt.p, ddt, M, N),
                     dv_bf = dview(d_bf.p, ddt, M, N);
    const GemmTile tile = gemm_fp8_sm90_tile(M, N, K, wgrad, gc.f32());

    // Correctness runs first: poisoned outputs (NaN), zeroed where the GEMM accumulates.
    FP8MOE_CUDA_CHECK(cudaMemset(d_ours.p, acc ? 0x00 : 0xFF, dbytes));
    FP8MOE_CUDA_CHECK(cudaMemset(d_lt.p, acc ? 0x00 : 0xFF, dbytes));
    std::string err_ours, err_lt, err_bf;
    try {
      gemm_fp8_sm90(aq.view, bq.view, dv_ours, acc, nullptr);
      FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    } catch (const std::exception& e) {
      err_ours = e.what();
    }
    try {
      gemm_fp8_cublaslt(aq.view, bq.view, dv_lt, acc, nullptr);
      FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    } catch (const std::exception& e) {
      err_lt = e.what();
    }

    // An alternative for large tiles, timed beside the choice: 256x128 -> 128x128 (epilogue by K;
    // f32 D: the pipelined FP32-staged one), 128x128 -> its 2-CTA multicast variant (not picked by
    // default; f32 D: the FP32-staged 128x192, which the heuristic avoids for its 3 stages).
    GemmTile alt = tile;
    bool has_alt = false;
    if (tile.split_k > 1 || tile.tail_split > 1) {
      alt = choose_gemm_tile(M, N, K, wgrad, prop.multiProcessorCount, false, gc.f32(), /*split=*/false);
      has_alt = true;
    } else if (tile.block_m == 256) {
      alt = gc.f32() && !wgrad ? GemmTile{128, 128, true, 1, true, true} : GemmTile{128, 128, !(K >= 4096), 1};
      has_alt = true;
    } else if (tile.block_m == 128 && tile.block_n == 128 && tile.f32_staging) {
      alt = {128, 192, true, 1, false, true};
      has_alt = true;
    } else if (tile.block_m == 128 && tile.block_n == 128) {
      alt.multicast = 2;
      alt.pipelined = false;  // multicast is compiled for the plain mainloop
      has_alt = true;
    }
    // The alternative and the extra tiles (FP8MOE_BENCH_TILES) that run for this kind; each extra's
    // D bit for bit against the chosen tile's from the correctness run above (same inputs,
    // zeroed/poisoned D).
    has_alt = has_alt && err_ours.empty();
    const DeviceBuffer d_x(has_alt || !extra.empty() ? dbytes : 0);
    const TensorView dv_x = dview(d_x.p, ddt, M, N);
    std::vector<size_t> extra_ok;  // indices into `extra`
    std::vector<bool> extra_same;
    if (has_alt) {
      try {
        gemm_fp8_sm90(aq.view, bq.view, dv_x, acc, nullptr, &alt);
        FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
      } catch (const std::exception&) {
        has_alt = false;
      }
    }
    if (err_ours.empty() && !extra.empty()) {
      const auto want = to_host<uint8_t>(d_ours.p, dbytes);
      for (size_t e = 0; e < extra.size(); ++e) {
        try {
          FP8MOE_CUDA_CHECK(cudaMemset(d_x.p, acc ? 0x00 : 0xFF, dbytes));
          gemm_fp8_sm90(aq.view, bq.view, dv_x, acc, nullptr, &extra[e]);
          FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
        } catch (const std::exception&) {
          continue;  // not compiled for this kind
        }
        extra_ok.push_back(e);
        extra_same.push_back(to_host<uint8_t>(d_x.p, dbytes) == want);
      }
    }

    // Ours, cuBLASLt's FP8 GEMM, the alternative and the extra tiles take turns launch by launch
    // (Timer::interleaved): all are timed under the same clock.
    double t_ours = NAN, t_lt = NAN, t_bf = NAN, t_mc = NAN, ghz_ours = NAN, ghz_lt = NAN;
    std::vector<double> t_extra(extra_ok.size(), NAN);
    // --ceiling: the Tensor Cores' ceiling for this shape's FLOPs, bare and with our tile's promotion.
    Ceilings ceilings(wgrad, 2.0 * double(M) * double(N) * double(K));
    {
      std::vector<std::function<void()>> fns;
      std::vector<std::pair<double*, double*>> dst;  // time, clock
      if (err_ours.empty()) {
        fns.push_back([&] { gemm_fp8_sm90(aq.view, bq.view, dv_ours, acc, nullptr); });
        dst.push_back({&t_ours, &ghz_ours});
      }
      if (err_lt.empty()) {
        fns.push_back([&] { gemm_fp8_cublaslt(aq.view, bq.view, dv_lt, acc, nullptr); });
        dst.push_back({&t_lt, &ghz_lt});
      }
      if (has_alt) {
        fns.push_back([&] { gemm_fp8_sm90(aq.view, bq.view, dv_x, acc, nullptr, &alt); });
        dst.push_back({&t_mc, nullptr});
      }
      for (size_t i = 0; i < extra_ok.size(); ++i) {
        fns.push_back([&, i] { gemm_fp8_sm90(aq.view, bq.view, dv_x, acc, nullptr, &extra[extra_ok[i]]); });
        dst.push_back({&t_extra[i], nullptr});
      }
      if (opt.ceiling) {
        const auto launches = ceilings.launches(aq.view, bq.view);
        const auto results = ceilings.results();
        for (size_t i = 0; i < launches.size(); ++i) {
          fns.push_back(launches[i]);
          dst.push_back({&results[i]->us, &results[i]->ghz});
        }
      }
      const std::vector<Timing> t = timer.interleaved(fns, opt.warmup, opt.iters);
      for (size_t i = 0; i < t.size(); ++i) {
        *dst[i].first = t[i].us;
        if (dst[i].second) *dst[i].second = t[i].ghz;
      }
    }
    char alt_s[64] = "-";
    if (has_alt) std::snprintf(alt_s, sizeof alt_s, "%s %.1f", tile_name(alt).c_str(), t_mc);
    std::vector<std::string> extra_rows;
    for (size_t i = 0; i < extra_ok.size(); ++i) {
      const GemmTile& xt = extra[extra_ok[i]];
      const double tx = t_extra[i];
      // K slices sum in another order (which tiles are sliced depends on the tile shape).
      const bool sliced = xt.tail_split > 1 || tile.tail_split > 1 || xt.split_k > 1 || tile.split_k > 1;
      char row[160];
      std::snprintf(row, sizeof row, "#   tile %s: %.1f us, %.0f TFLOPS, %.3fx the chosen tile, D %s", tile_name(xt).c_str(),
                    tx, 2.0 * double(M) * double(N) * double(K) / (tx * 1e-6) / 1e12, t_ours / tx,
                    extra_same[i] ? "bit-identical" : sliced ? "differs (K slices)" : "DIFFERS");
      extra_rows.push_back(row);
      if (!extra_same[i] && !sliced) all_ok = false;
      if (!wgrad && M == 4096) extra_speedup[extra_ok[i]].push_back(t_ours / tx);
    }
    try {
      t_bf = timer.median_us(
          [&] { gemm_bf16_cublaslt(dview(a16.p, DType::bf16, M, K), dview(b16.p, DType::bf16, N, K), dv_bf, acc, nullptr); },
          opt.warmup, opt.iters);
    } catch (const std::exception& e) {
      err_bf = e.what();
    }

    double cd = NAN, kerr = NAN, vs_lt = NAN;
    bool ok = err_ours.empty();
    if (opt.check && err_ours.empty()) {
      // Re-run the correctness outputs: the timing loops above accumulated into D.
      FP8MOE_CUDA_CHECK(cudaMemset(d_ours.p, acc ? 0x00 : 0xFF, dbytes));
      gemm_fp8_sm90(aq.view, bq.view, dv_ours, acc, nullptr);
      if (err_lt.empty()) {
        FP8MOE_CUDA_CHECK(cudaMemset(d_lt.p, acc ? 0x00 : 0xFF, dbytes));
        gemm_fp8_cublaslt(aq.view, bq.view, dv_lt, acc, nullptr);
      }
      FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<double> ours = d_to_doubles(d_ours.p, M, N, gc.f32());
      if (err_lt.empty()) vs_lt = calc_diff(ours, d_to_doubles(d_lt.p, M, N, gc.f32()));

      // FP64 references on sampled rows.
      const int R = int(std::min<int64_t>(opt.check_rows, M));
      std::vector<int64_t> rows(static_cast<size_t>(R));
      for (int i = 0; i < R; ++i) rows[size_t(i)] = R == 1 ? 0 : int64_t(i) * (M - 1) / (R - 1);
      const auto a16h = to_host<uint16_t>(a16.p, size_t(M * K));
      const auto b16h = to_host<uint16_t>(b16.p, size_t(N * K));
      const auto aqh = to_host<uint8_t>(aq.values.p, size_t(M * K));
      const auto bqh = to_host<uint8_t>(bq.values.p, size_t(N * K));
      const auto ash = to_host<float>(aq.scales.p, aq.scales.bytes / 4);
      const auto bsh = to_host<float>(bq.scales.p, bq.scales.bytes / 4);
      const int64_t lda_s = aq.view.scales.size(1), ldb_s = bq.view.scales.size(1);
      float lut[256];
      for (int i = 0; i < 256; ++i) lut[i] = e4m3_decode(uint8_t(i));
      std::vector<double> ref_unq(size_t(R * N)), ref_deq(size_t(R * N)), got(size_t(R * N));
      const int64_t G = K / 128;
#pragma omp parallel for schedule(dynamic, 16)
      for (int64_t n = 0; n < N; ++n) {
        for (int i = 0; i < R; ++i) {
          const int64_t m = rows[size_t(i)];
          double su = 0, sd = 0;
          for (int64_t g = 0; g < G; ++g) {
            double gu = 0, gd = 0;
            for (int64_t k = g * 128; k < (g + 1) * 128; ++k) {
              gu += double(bf16_bits_to_float(a16h[size_t(m * K + k)]) * bf16_bits_to_float(b16h[size_t(n * K + k)]));
              gd += double(lut[aqh[size_t(m * K + k)]] * lut[bqh[size_t(n * K + k)]]);
            }
            const double sa = ash[size_t(g * lda_s + m)];
            const double sb = wgrad ? bsh[size_t(g * ldb_s + n)] : bsh[size_t((n / 128) * ldb_s + g)];
            su += gu;
            sd += gd * sa * sb;
          }
          ref_unq[size_t(i * N + n)] = su;
          // bf16 D: compare with the reference rounded the same way, so kerr shows kernel error
          // (Tensor Core accumulation) rather than the output format's rounding.
          ref_deq[size_t(i * N + n)] = gc.f32() ? sd : double(bf16_round(float(sd)));
          got[size_t(i * N + n)] = ours[size_t(m * N + n)];
        }
      }
      cd = calc_diff(got, ref_unq);
      kerr = rel_error(got, ref_deq);
      ok = !has_nan(ours) && cd < 1e-3 && kerr < (gc.f32() ? 1e-3 : 2e-3);
    }
    all_ok = all_ok && ok;

    const double flops = 2.0 * double(M) * double(N) * double(K);
    auto tf = [&](double us) { return std::isnan(us) ? NAN : flops / (us * 1e-6) / 1e12; };
    const double ratio = t_lt / t_ours;
    const std::string tile_s = tile_name(tile);
    std::printf("| %s | %lld | %lld | %lld | %s | %.1f | %.0f | %.0f | %.0f | %.3f | %.2e | %.2e | %.2e | %s |%s\n", gc.kind.c_str(),
                (long long)M, (long long)N, (long long)K, tile_s.c_str(), t_ours, tf(t_ours), tf(t_lt), tf(t_bf), ratio, cd, kerr,
                vs_lt, alt_s, ok ? "" : " FAIL");
    for (const std::string& r : extra_rows) std::printf("%s\n", r.c_str());
    if (err_lt.empty()) std::printf("#   cuBLASLt FP8: %s\n", gemm_fp8_cublaslt_algorithm(aq.view, bq.view, dv_lt, acc).c_str());
    // Cycles rather than seconds: (t_lt * f_lt) / (t_ours * f_ours).
    const double ratio_clk = ratio * ghz_lt / ghz_ours;
    if (opt.clocks)
      std::printf("#   SM clock: ours %.3f GHz, cuBLASLt FP8 %.3f GHz; ours/cuBLASLt per clock cycle %.3f\n", ghz_ours, ghz_lt,
                  ratio_clk);
    if (opt.ceiling) {
      std::printf("%s\n", ceilings.line(t_ours, t_lt, "cuBLASLt FP8").c_str());
      for (int c = 0; c < 2; ++c)
        if (wgrad) {
          r_ceil_wg_lt[c].push_back(t_lt / ceilings.us(c));
        } else if (M == 4096) {
          r_ceil_lt[c].push_back(t_lt / ceilings.us(c));
          r_ceil_ours[c].push_back(ceilings.us(c) / t_ours);
        }
    }
    if (!err_ours.empty()) std::printf("#   ours: %s\n", err_ours.c_str());
    if (!err_lt.empty()) std::printf("#   cuBLASLt FP8: %s\n", err_lt.c_str());
    if (!err_bf.empty()) std::printf("#   cuBLASLt BF16: %s\n", err_bf.c_str());
    std::fflush(stdout);
    if (opt.clocks && !wgrad && M == 4096 && std::isfinite(ratio_clk) && ratio_clk > 0) r_m4096_clk.push_back(ratio_clk);
    if (std::isfinite(ratio) && ratio > 0) {
      r_all.push_back(ratio);
      if (wgrad) r_wgrad.push_back(ratio);
      else if (M == 4096) r_m4096.push_back(ratio);
      else if (M <= 128) r_small.push_back(ratio);
    }
  }
  std::printf("# geomean ours/cuBLASLt-FP8: M=4096 fprop %.3f (%zu) | M<=128 fprop %.3f (%zu) | wgrad %.3f (%zu) | all %.3f (%zu)\n",
              geomean(r_m4096), r_m4096.size(), geomean(r_small), r_small.size(), geomean(r_wgrad), r_wgrad.size(), geomean(r_all),
              r_all.size());
  if (opt.clocks)
    std::printf("# geomean ours/cuBLASLt-FP8 per SM clock cycle: M=4096 fprop %.3f (%zu)\n", geomean(r_m4096_clk),
                r_m4096_clk.size());
  if (opt.ceiling)
    std::printf("# geomean cuBLASLt-FP8 time / Tensor Core ceiling time (the most a kernel at the ceiling could be ahead of"
                " cuBLASLt): M=4096 fprop bare %.3f, promoted %.3f (%zu) | wgrad bare %.3f, promoted %.3f (%zu); ours at"
                " %.1f%% / %.1f%% of the ceilings (M=4096 fprop)\n",
                geomean(r_ceil_lt[0]), geomean(r_ceil_lt[1]), r_ceil_lt[0].size(), geomean(r_ceil_wg_lt[0]),
                geomean(r_ceil_wg_lt[1]), r_ceil_wg_lt[0].size(), 100 * geomean(r_ceil_ours[0]),
                100 * geomean(r_ceil_ours[1]));
  for (size_t e = 0; e < extra.size(); ++e)
    if (!extra_speedup[e].empty())
      std::printf("# geomean tile %s / chosen tile, M=4096 fprop: %.3fx (%zu)\n", tile_name(extra[e]).c_str(),
                  geomean(extra_speedup[e]), extra_speedup[e].size());
  if (opt.set == "all") all_ok = emulated_rows(opt, seed, timer) && all_ok;
  std::printf("# correctness: %s\n", all_ok ? "all passed" : "FAILURES (see FAIL rows)");
  return all_ok ? 0 : 1;
}

int run_quant_bench(const QuantBenchOptions& opt) {
  const cudaDeviceProp& prop = device_props();
  const int64_t T = opt.tokens, C = opt.channels;
  const uint64_t seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  std::printf("# fp8moe bench quant on %s, x [%lld, %lld] bf16 (%.0f MiB), seed %llu, median of %d, L2 flushed (dirty and clean)\n", prop.name,
              (long long)T, (long long)C, double(T * C * 2) / (1 << 20), (unsigned long long)seed, opt.iters);
  Timer timer;
  DeviceBuffer x(size_t(T * C) * 2);
  fill_normal_bf16(x.p, T * C, seed);
  const TensorView xv = dview(x.p, DType::bf16, T, C);

  // Copy bandwidth over the same byte count as the largest case (read + write counted).
  DeviceBuffer cpy(size_t(T * C) * 2);
  // Each case timed after both L2 flushes (bench_util.hpp): dirty, then clean.
  auto time2 = [&](const std::function<void()>& fn) {
    return std::pair{timer.median_us(fn, opt.warmup, opt.iters, Flush::dirty),
                     timer.median_us(fn, opt.warmup, opt.iters, Flush::clean)};
  };
  const auto [t_copy, t_copy_clean] = time2(
      [&] { FP8MOE_CUDA_CHECK(cudaMemcpyAsync(cpy.p, x.p, size_t(T * C) * 2, cudaMemcpyDeviceToDevice, nullptr)); });
  const double copy_bytes = 2.0 * double(T * C) * 2;
  const double copy_gbs = copy_bytes / (t_copy * 1e-6) / 1e9, copy_gbs_clean = copy_bytes / (t_copy_clean * 1e-6) / 1e9;
  std::printf("| case | shape | MiB moved | us | GB/s | %% of copy | us, clean L2 | %% of copy, clean L2 | bit-exact vs CPU |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| device copy (D2D) | %lldx%lld bf16 | %.0f | %.1f | %.0f | 100%% | %.1f | 100%% | - |\n", (long long)T,
              (long long)C, copy_bytes / (1 << 20), t_copy, copy_gbs, t_copy_clean);

  // Host copies for the exactness checks.
  std::vector<uint16_t> xh = to_host<uint16_t>(x.p, size_t(T * C));
  Tensor xh_t = Tensor::host(DType::bf16, {T, C});
  std::memcpy(xh_t.view().data, xh.data(), xh.size() * 2);

  bool all_exact = true;
  auto compare = [&](const DeviceQuantized& dq, const QuantizedTensor& ref) {
    auto v = to_host<uint8_t>(dq.values.p, size_t(dq.view.values.numel()));
    auto s = to_host<float>(dq.scales.p, size_t(dq.view.scales.numel()));
    const bool ok = std::memcmp(v.data(), ref.values.view().data, v.size()) == 0 &&
                    std::memcmp(s.data(), ref.scales.view().data, s.size() * 4) == 0;
    all_exact = all_exact && ok;
    return ok;
  };
  auto row = [&](const char* name, const char* shape, double bytes, std::pair<double, double> us, const char* exact) {
    const double gbs = bytes / (us.first * 1e-6) / 1e9, gbs_clean = bytes / (us.second * 1e-6) / 1e9;
    std::printf("| %s | %s | %.0f | %.1f | %.0f | %.1f%% | %.1f | %.1f%% | %s |\n", name, shape, bytes / (1 << 20), us.first,
                gbs, 100.0 * gbs / copy_gbs, us.second, 100.0 * gbs_clean / copy_gbs_clean, exact);
    std::fflush(stdout);
  };
  char shape[64];
  const double scale_bytes_tc = double((C + 127) / 128 * scale_ld(T)) * 4;

  for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2}) {
    DeviceQuantized q(T, C, ScaleKind::tile_1x128);
    const auto us = time2([&] { quantize_1x128_cuda(xv, q.view, mode, nullptr, false); });
    QuantizedTensor ref = make_quantized_host(T, C, DType::e4m3, ScaleKind::tile_1x128);
    fp8moe::quantize_1x128(xh_t.view(), ref.view(), mode);
    std::snprintf(shape, sizeof shape, "%lldx%lld bf16->e4m3", (long long)T, (long long)C);
    row(mode == ScaleMode::pow2 ? "quantize_1x128 pow2" : "quantize_1x128", shape, double(T * C) * 3 + scale_bytes_tc, us,
        compare(q, ref) ? "yes" : "NO");
  }
  {
    DeviceQuantized q(C, T, ScaleKind::tile_1x128);
    const auto us = time2([&] { quantize_128x1_cuda(xv, q.view, ScaleMode::fp32, nullptr, false); });
    QuantizedTensor ref = make_quantized_host(C, T, DType::e4m3, ScaleKind::tile_1x128);
    fp8moe::quantize_128x1(xh_t.view(), ref.view(), ScaleMode::fp32);
    std::snprintf(shape, sizeof shape, "%lldx%lld bf16->[C,T] e4m3", (long long)T, (long long)C);
    row("quantize_128x1", shape, double(T * C) * 3 + double((T + 127) / 128 * scale_ld(C)) * 4, us, compare(q, ref) ? "yes" : "NO");
  }
  {
    DeviceQuantized in(T, C, ScaleKind::tile_1x128), q(C, T, ScaleKind::tile_1x128);
    quantize_1x128_cuda(xv, in.view, ScaleMode::fp32, nullptr, false);
    const auto us = time2([&] { requantize_128x1_cuda(in.view, q.view, ScaleMode::fp32, nullptr); });
    QuantizedTensor in_h = make_quantized_host(T, C, DType::e4m3, ScaleKind::tile_1x128);
    FP8MOE_CUDA_CHECK(cudaMemcpy(in_h.values.view().data, in.values.p, in.values.bytes, cudaMemcpyDeviceToHost));
    FP8MOE_CUDA_CHECK(cudaMemcpy(in_h.scales.view().data, in.scales.p, in.scales.bytes, cudaMemcpyDeviceToHost));
    QuantizedTensor ref = make_quantized_host(C, T, DType::e4m3, ScaleKind::tile_1x128);
    fp8moe::requantize_128x1(in_h.view(), ref.view(), ScaleMode::fp32);
    std::snprintf(shape, sizeof shape, "%lldx%lld e4m3->[C,T] e4m3", (long long)T, (long long)C);
    row("requantize_128x1", shape, double(T * C) * 2 + scale_bytes_tc + double((T + 127) / 128 * scale_ld(C)) * 4, us,
        compare(q, ref) ? "yes" : "NO");
    // Its bound: the same TMA tiles moved without arithmetic (and without the scales), in its own
    // tiling and in the fastest tiling measured (docs/PERF-log.md, "The requantizer's memory bound").
    for (const TileCopyShape tc : {TileCopyShape{128, 6, 2}, TileCopyShape{256, 6, 1}}) {
      if (T % tc.tokens != 0 || C % 128 != 0) continue;
      const auto us_tc = time2([&] { tma_tile_copy(in.values.p, q.values.p, T, C, tc, nullptr); });
      char name[96];
      std::snprintf(name, sizeof name, "TMA tile copy, %dx128 tiles, %d stages, %d CTA/SM", tc.tokens, tc.stages,
                    tc.ctas_per_sm);
      row(name, shape, double(T * C) * 2, us_tc, "-");
    }
  }
  {
    DeviceQuantized q(T, C, ScaleKind::block_128x128);
    const auto us = time2([&] { quantize_128x128_cuda(xv, q.view, ScaleMode::fp32, nullptr, false); });
    QuantizedTensor ref = make_quantized_host(T, C, DType::e4m3, ScaleKind::block_128x128);
    fp8moe::quantize_128x128(xh_t.view(), ref.view(), ScaleMode::fp32);
    std::snprintf(shape, sizeof shape, "%lldx%lld bf16->e4m3", (long long)T, (long long)C);
    row("quantize_128x128", shape, double(T * C) * 3, us, compare(q, ref) ? "yes" : "NO");
  }
  // The Linear backward's dy in both layouts from one read, from bf16 and from f32 (the model's
  // dy), against the two quantizers it replaces: x read once, both outputs and their scales written.
  Tensor xf_h = Tensor::host(DType::f32, {T, C});
  for (int64_t i = 0; i < T * C; ++i) xf_h.ptr<float>()[i] = load_float(xh_t.view(), i);
  DeviceBuffer xf(size_t(T * C) * 4);
  FP8MOE_CUDA_CHECK(cudaMemcpy(xf.p, xf_h.view().data, xf.bytes, cudaMemcpyHostToDevice));
  {
    // The attention-out Linear's cache (the model's case: f32 in, power-of-two scales), and its
    // dequantization back to f32 for the attention backward.
    DeviceBuffer v56(dtype_bytes(DType::e5m6, T * C)), s56(size_t(scale_shape(ScaleKind::tile_1x128, T, C)[0] *
                                                    scale_shape(ScaleKind::tile_1x128, T, C)[1]) * 4);
    const auto ss = scale_shape(ScaleKind::tile_1x128, T, C);
    const QuantizedView q56{dview(v56.p, DType::e5m6, T, C), dview(s56.p, DType::f32, ss[0], ss[1]),
                            ScaleKind::tile_1x128};
    const TensorView in = dview(xf.p, DType::f32, T, C);
    const auto us_q = time2([&] { quantize_1x128_e5m6_cuda(in, q56, ScaleMode::pow2, nullptr); });
    QuantizedTensor ref = make_quantized_host(T, C, DType::e5m6, ScaleKind::tile_1x128);
    fp8moe::quantize_1x128(xf_h.view(), ref.view(), ScaleMode::pow2);
    const auto v = to_host<uint8_t>(v56.p, v56.bytes);
    const auto sc = to_host<float>(s56.p, size_t(ss[0] * ss[1]));
    const bool ok_q = std::memcmp(v.data(), ref.values.view().data, v.size()) == 0 &&
                      std::memcmp(sc.data(), ref.scales.view().data, sc.size() * 4) == 0;
    std::snprintf(shape, sizeof shape, "%lldx%lld f32->e5m6", (long long)T, (long long)C);
    row("quantize_1x128 e5m6 pow2", shape, double(T * C) * 5.5 + scale_bytes_tc, us_q, ok_q ? "yes" : "NO");
    DeviceBuffer out(size_t(T * C) * 4);
    const TensorView ov = dview(out.p, DType::f32, T, C);
    const auto us_d = time2([&] { dequantize_e5m6_cuda(q56, ov, nullptr); });
    Tensor ref_d = Tensor::host(DType::f32, {T, C});
    fp8moe::dequantize(ref.view(), ref_d.view());
    const auto d = to_host<float>(out.p, size_t(T * C));
    const bool ok_d = std::memcmp(d.data(), ref_d.view().data, d.size() * 4) == 0;
    std::snprintf(shape, sizeof shape, "%lldx%lld e5m6->f32", (long long)T, (long long)C);
    row("dequantize e5m6", shape, double(T * C) * 5.5 + scale_bytes_tc, us_d, ok_d ? "yes" : "NO");
    all_exact = all_exact && ok_q && ok_d;
  }
  std::vector<std::string> versus;
  for (const Tensor* in_h : {&xh_t, &xf_h}) {
    const DType dt = in_h->dtype();
    const TensorView in = dt == DType::f32 ? dview(xf.p, dt, T, C) : xv;
    DeviceQuantized rows(T, C, ScaleKind::tile_1x128), cols(C, T, ScaleKind::tile_1x128);
    // The two separate kernels, for the comparison line only (dirty flush, as its numbers).
    const double us_rows = timer.median_us([&] { quantize_1x128_cuda(in, rows.view, ScaleMode::fp32, nullptr, false); },
                                           opt.warmup, opt.iters, Flush::dirty);
    const double us_cols = timer.median_us([&] { quantize_128x1_cuda(in, cols.view, ScaleMode::fp32, nullptr, false); },
                                           opt.warmup, opt.iters, Flush::dirty);
    const auto us = time2(  // last: its outputs are the ones checked
        [&] { quantize_1x128_and_128x1_cuda(in, rows.view, cols.view, ScaleMode::fp32, nullptr, false); });
    QuantizedTensor ref_rows = make_quantized_host(T, C, DType::e4m3, ScaleKind::tile_1x128),
                    ref_cols = make_quantized_host(C, T, DType::e4m3, ScaleKind::tile_1x128);
    fp8moe::quantize_1x128(in_h->view(), ref_rows.view(), ScaleMode::fp32);
    fp8moe::quantize_128x1(in_h->view(), ref_cols.view(), ScaleMode::fp32);
    const bool exact_rows = compare(rows, ref_rows), exact_cols = compare(cols, ref_cols);
    std::snprintf(shape, sizeof shape, "%lldx%lld %s->e4m3 + [C,T] e4m3", (long long)T, (long long)C,
                  std::string(dtype_name(dt)).c_str());
    const double bytes = double(T * C) * double(dtype_size(dt) + 2) + scale_bytes_tc +
                         double((T + 127) / 128 * scale_ld(C)) * 4;
    row("quantize_1x128_and_128x1", shape, bytes, us, exact_rows && exact_cols ? "yes" : "NO");
    char line[256];
    std::snprintf(line, sizeof line,
                  "# quantize_1x128_and_128x1 from %s: %.1f us against quantize_1x128 + quantize_128x1 %.1f + %.1f = "
                  "%.1f us (%.2fx)",
                  std::string(dtype_name(dt)).c_str(), us.first, us_rows, us_cols, us_rows + us_cols,
                  (us_rows + us_cols) / us.first);
    versus.push_back(line);
  }
  for (const std::string& l : versus) std::printf("%s\n", l.c_str());
  std::printf("# bit-exact: %s\n", all_exact ? "all cases" : "MISMATCH");
  return all_exact ? 0 : 1;
}

}  // namespace fp8moe::cuda
