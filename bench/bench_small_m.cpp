// `fp8moe bench small-m` (bench.hpp): the FP8 GEMM at decode sizes, D [M, N] f32 = A [M, K] B [N, K]^T
// for M = 1..64 tokens on DeepSeek-V3's weight shapes. Such a GEMM only streams B (N * K bytes and
// its 128x128 scales), so each row gives B's bytes per second against the device copy bandwidth
// measured in the same run (a 1 GiB device-to-device copy, read + written counted, L2 flushed the
// same way), beside our WGMMA kernel at the tile its heuristic picks and cuBLASLt's FP8 GEMM, and
// the launches of FP8MOE_SMALL_M_CONFIGS (bench.hpp) in a second table.
// The functions take turns launch by launch after a clean L2 flush (Timer::interleaved,
// Flush::clean: B comes from DRAM, as it does in a decode step whose weights far exceed L2).
// Correctness: the few-rows kernel against the WGMMA kernel's D (rel error, < 1e-3).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "cuda/kernel_api.hpp"
#include "fp8moe/similarity.hpp"

namespace fp8moe::cuda {

using namespace bench;

namespace {

// FP8MOE_SMALL_M_CONFIGS: "s4/r2/c2/p6,r4" -> configurations (fields left out: 0, chosen).
std::vector<SmallMConfig> configs_from_env() {
  std::vector<SmallMConfig> out;
  const char* e = std::getenv("FP8MOE_SMALL_M_CONFIGS");
  if (!e) return out;
  std::stringstream list(e);
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item.empty()) continue;
    SmallMConfig c;
    std::stringstream fields(item);
    std::string f;
    while (std::getline(fields, f, '/')) {
      FP8MOE_CHECK(f.size() >= 2 && f.find_first_not_of("0123456789", 1) == std::string::npos,
                   "FP8MOE_SMALL_M_CONFIGS: expected fields like s4, r2, c2, p6, got '" << f << "' in '" << item
                                                                                          << "'");
      const int v = std::stoi(f.substr(1));
      if (f[0] == 's') c.k_split = v;
      else if (f[0] == 'r') c.row_warps = v;
      else if (f[0] == 'c') c.ctas_per_sm = v;
      else if (f[0] == 'p') c.stages = v;
      else FP8MOE_CHECK(false, "FP8MOE_SMALL_M_CONFIGS: unknown field '" << f << "' (s, r, c, p)");
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace

int run_small_m_bench(const SmallMBenchOptions& opt) {
  FP8MOE_CHECK(opt.iters >= 1 && opt.warmup >= 0, "bench small-m: --iters must be >= 1 and --warmup >= 0");
  for (int64_t m : opt.rows)
    FP8MOE_CHECK(m >= 1 && m <= kSmallMMaxRows, "bench small-m: --m values must be in [1, " << kSmallMMaxRows << "], got " << m);
  Timer timer;
  const Flush flush = Flush::clean;
  // The copy bandwidth, flushed like the GEMMs.
  const size_t copy_bytes = size_t(1) << 30;
  DeviceBuffer src(copy_bytes), dst(copy_bytes);
  FP8MOE_CUDA_CHECK(cudaMemset(src.p, 1, copy_bytes));
  const double t_copy = timer.median_us(
      [&] { FP8MOE_CUDA_CHECK(cudaMemcpyAsync(dst.p, src.p, copy_bytes, cudaMemcpyDeviceToDevice, nullptr)); },
      2, 5, flush);
  const double copy_gbs = 2.0 * double(copy_bytes) / t_copy * 1e-3;
  std::printf("# bench small-m: D [M, N] f32 = A [M, K] B [N, K]^T, FP8 (A 1x128, B 128x128 scales); L2 flushed clean "
              "before each launch; device copy %.0f GB/s (1 GiB, read + write)\n",
              copy_gbs);
  std::printf("# B GB/s: bytes of B and its scales over the time; of copy: that against the copy bandwidth; "
              "read us: a plain read of as many bytes (the read sweep), flushed and timed in turn with the GEMMs, "
              "and of read: its time over ours (the limit at this size: a launch's start and ramp do not shrink "
              "with the bytes); launch: the few-rows kernel's k_split / row_warps / ctas_per_sm / stages; ours/X: "
              "X's time over ours\n");
  std::printf("| M | N | K | ours us | B GB/s | of copy | read us | of read | launch | WGMMA tile | WGMMA us | "
              "cuBLASLt us | ours/WGMMA | ours/cuBLASLt | rel err vs WGMMA |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const std::vector<SmallMConfig> tries = configs_from_env();
  std::string tries_table;
  std::vector<double> r_wg, r_lt, r_copy, r_read;
  uint64_t seed = 20261202;
  for (const auto& nk : opt.shapes) {
    const int64_t N = nk.first, K = nk.second;
    DeviceBuffer b16(size_t(N * K) * 2);
    fill_normal_bf16(b16.p, N * K, ++seed);
    DeviceQuantized bq(N, K, ScaleKind::block_128x128);
    quantize_128x128_cuda(dview(b16.p, DType::bf16, N, K), bq.view, ScaleMode::fp32, nullptr, false);
    const double b_bytes = double(N * K) + double(bq.scales.bytes);
    const DeviceBuffer same_bytes(size_t(b_bytes) / 16 * 16 + 16);
    FP8MOE_CUDA_CHECK(cudaMemset(same_bytes.p, 0, same_bytes.bytes));
    for (const int64_t M : opt.rows) {
      DeviceBuffer a16(size_t(M * K) * 2);
      fill_normal_bf16(a16.p, M * K, ++seed);
      DeviceQuantized aq(M, K, ScaleKind::tile_1x128);
      quantize_1x128_cuda(dview(a16.p, DType::bf16, M, K), aq.view, ScaleMode::fp32, nullptr, false);
      const size_t dbytes = size_t(M * N) * 4;
      DeviceBuffer d_ours(dbytes), d_wg(dbytes), d_lt(dbytes), d_x(dbytes);
      const TensorView dv_ours = dview(d_ours.p, DType::f32, M, N), dv_wg = dview(d_wg.p, DType::f32, M, N),
                       dv_lt = dview(d_lt.p, DType::f32, M, N), dv_x = dview(d_x.p, DType::f32, M, N);
      const GemmTile tile = gemm_fp8_sm90_tile(M, N, K, false, true);
      gemm_fp8_small_m(aq.view, bq.view, dv_ours, false, nullptr);
      gemm_fp8_sm90(aq.view, bq.view, dv_wg, false, nullptr, &tile);
      bool lt_ok = true;
      try {
        gemm_fp8_cublaslt(aq.view, bq.view, dv_lt, false, nullptr);
        FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
      } catch (const std::exception&) {
        lt_ok = false;
      }
      FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
      const double err = rel_error(d_to_doubles(d_ours.p, M, N, true), d_to_doubles(d_wg.p, M, N, true));
      std::vector<std::function<void()>> fns = {
          [&] { gemm_fp8_small_m(aq.view, bq.view, dv_ours, false, nullptr); },
          [&] { gemm_fp8_sm90(aq.view, bq.view, dv_wg, false, nullptr, &tile); },
          [&] { l2_read_sweep(same_bytes, nullptr); }};
      if (lt_ok) fns.push_back([&] { gemm_fp8_cublaslt(aq.view, bq.view, dv_lt, false, nullptr); });
      // The tried launches that fit this shape (the others print "n/a").
      std::vector<std::string> tried_names;
      std::vector<size_t> tried_fn;
      for (const SmallMConfig& c : tries) {
        try {
          const SmallMConfig r = gemm_fp8_small_m_config(M, N, K, c);
          tried_names.push_back(small_m_config_name(r));
          tried_fn.push_back(fns.size());
          fns.push_back([&, c] { gemm_fp8_small_m(aq.view, bq.view, dv_x, false, nullptr, c); });
        } catch (const Error&) {  // the launch does not fit this shape
          tried_names.push_back("n/a");
          tried_fn.push_back(0);
        }
      }
      const std::vector<Timing> t = timer.interleaved(fns, opt.warmup, opt.iters, flush);
      const double t_ours = t[0].us, t_wg = t[1].us, t_read = t[2].us, t_lt = lt_ok ? t[3].us : NAN;
      const double gbs = b_bytes / t_ours * 1e-3;
      r_wg.push_back(t_wg / t_ours);
      if (lt_ok) r_lt.push_back(t_lt / t_ours);
      r_copy.push_back(gbs / copy_gbs);
      const std::string chosen = small_m_config_name(gemm_fp8_small_m_config(M, N, K));
      r_read.push_back(t_read / t_ours);
      std::printf("| %lld | %lld | %lld | %.2f | %.0f | %.1f%% | %.2f | %.1f%% | %s | %s | %.2f | %.2f | %.2fx | %.2fx "
                  "| %.1e |\n",
                  (long long)M, (long long)N, (long long)K, t_ours, gbs, 100.0 * gbs / copy_gbs, t_read,
                  100.0 * t_read / t_ours, chosen.c_str(),
                  tile_name(tile).c_str(), t_wg, t_lt, t_wg / t_ours, t_lt / t_ours, err);
      if (!tries.empty()) {
        char cell[96];
        std::snprintf(cell, sizeof cell, "| %lld | %lld | %lld | %.2f |", (long long)M, (long long)N, (long long)K,
                      t_ours);
        tries_table += cell;
        for (size_t i = 0; i < tries.size(); ++i) {
          if (tried_fn[i] == 0) std::snprintf(cell, sizeof cell, " n/a |");
          else std::snprintf(cell, sizeof cell, " %.2f (%s) |", t[tried_fn[i]].us, tried_names[i].c_str());
          tries_table += cell;
        }
        tries_table += "\n";
      }
      std::fflush(stdout);
      if (!(err < 1e-3)) {
        std::printf("# FAILED: M=%lld N=%lld K=%lld differs from the WGMMA kernel by %.2e\n", (long long)M,
                    (long long)N, (long long)K, err);
        return 1;
      }
    }
  }
  std::printf("# geomean: WGMMA time / ours %.2fx, cuBLASLt time / ours %.2fx, B bandwidth of copy %.1f%%, "
              "of a same-size read %.1f%%\n",
              geomean(r_wg), geomean(r_lt), 100.0 * geomean(r_copy), 100.0 * geomean(r_read));
  if (!tries.empty()) {
    std::printf("\n# FP8MOE_SMALL_M_CONFIGS: the tried launches' us (resolved launch), timed with the rows above; "
                "n/a: does not fit\n| M | N | K | chosen us |");
    std::string rule = "|---|---|---|---|";
    for (const SmallMConfig& c : tries) {
      std::printf(" %s |", small_m_config_name(c).c_str());
      rule += "---|";
    }
    std::printf("\n%s\n%s", rule.c_str(), tries_table.c_str());
  }
  return 0;
}

}  // namespace fp8moe::cuda
