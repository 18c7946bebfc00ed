// Shared pieces of the kernel benchmarks (bench.cpp, bench_grouped.cpp, bench_moe_dispatch.cpp):
// device buffers and views, the timer (warm-up, then each timed launch after a 512 MiB memset that
// flushes L2 and gives the host time to enqueue it; median of iters), device -> host copies, extra
// tiles from FP8MOE_BENCH_TILES, geometric means.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/quantize.hpp"
#include "cuda/gemm/gemm_heuristics.hpp"

namespace fp8moe::cuda::bench {

// ---- device buffers and random data ----
struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n) FP8MOE_CUDA_CHECK(cudaMalloc(&p, n));
  }
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

inline TensorView dview(void* p, DType t, int64_t r, int64_t c) { return TensorView(p, t, {r, c}, Device::cuda); }

struct DeviceQuantized {
  DeviceBuffer values, scales;
  QuantizedView view;
  DeviceQuantized(int64_t rows, int64_t cols, ScaleKind kind)
      : values(size_t(rows * cols)),
        scales(size_t(scale_shape(kind, rows, cols)[0] * scale_shape(kind, rows, cols)[1]) * 4) {
    const auto ss = scale_shape(kind, rows, cols);
    view = {dview(values.p, DType::e4m3, rows, cols), dview(scales.p, DType::f32, ss[0], ss[1]), kind};
  }
};

// ---- options ----
// The items of a comma-separated list ("2,4,8" -> {"2", "4", "8"}); `what` names the option in
// the error for an empty list.
inline std::vector<std::string> comma_list(const std::string& s, const char* what) {
  std::vector<std::string> v;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t end = std::min(s.find(',', pos), s.size());
    if (end > pos) v.push_back(s.substr(pos, end - pos));
    pos = end + 1;
  }
  FP8MOE_CHECK(!v.empty(), what << ": '" << s << "' names nothing");
  return v;
}

// ---- timing ----
// The median of a run's times (NaN for none).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? NAN : v[v.size() / 2];
}

// L2 before each timed launch: `dirty` (a 512 MiB memset: the last ~50 MiB of it stay in L2 as
// dirty lines, written back while the timed kernel runs, as after any kernel that wrote its output)
// or `clean` (the memset, then a read-only sweep of another 512 MiB: L2 holds clean lines only, and
// the timed kernel pays for its own traffic alone).
enum class Flush { dirty, clean };
// Reads all of `b` but its last 16 bytes (where the sweep's never-taken store points).
void l2_read_sweep(const DeviceBuffer& b, cudaStream_t stream);

// The requantizer's TMA traffic alone (bench_tile_copy.cu): x [T, C] bytes copied in tiles of
// `tokens` x 128 to the transposed places of q [C, T], unchanged, as `bench quant`'s bound for
// requantize_128x1.
struct TileCopyShape {
  int tokens = 128;      // rows per tile: 128 or 256
  int stages = 4;        // ring stages, 2..8
  int ctas_per_sm = 2;
};
void tma_tile_copy(const void* x, void* q, int64_t T, int64_t C, const TileCopyShape& shape, cudaStream_t stream);

// A copy of bytes (a multiple of 16) by `blocks` blocks of `threads` threads (bench_block_copy.cu).
void block_copy(const void* src, void* dst, size_t bytes, int blocks, int threads, cudaStream_t stream);

// SM clock probe (bench_clock.cu): a stamp per block of a one-block-per-SM launch.
struct ClockStamp {
  uint32_t sm;
  unsigned long long ns, cycles;
};
int clock_stamp_blocks();
void clock_stamp(ClockStamp* slot, cudaStream_t stream);  // clock_stamp_blocks() stamps into `slot`
// The median over SMs of cycles / nanoseconds between two probes (NaN when no SM is in both).
double clock_ghz(const ClockStamp* before, const ClockStamp* after, int blocks);

// A timed function's median time and, with Timer::clocks, the median SM clock during its launches.
struct Timing {
  double us = NAN;
  double ghz = NAN;
};

// The Tensor Cores' ceiling under the power cap (bench_ceiling.cu): `blocks` 128-wide K blocks of
// FP8 WGMMAs on each of ceiling_ctas() CTAs (one per SM), on a tile of ceiling_tile_rows() x
// ceiling_tile_cols(mode) held in shared memory (one K block of rows of a [M, K] and b [N, K],
// e4m3, rows wrapped where M or N is smaller), every scale `scale`; no loads, no epilogue. bare:
// the Tensor Core accumulates across all blocks; promote_1d2d / promote_1d1d: each block promoted
// as our 128x128 tile does (per-block or per-column s_b). The CTA `d_cta` writes its f32 tile
// (row-major) to d; no CTA writes when d_cta is out of range.
enum class CeilingMode { bare, promote_1d2d, promote_1d1d };
int ceiling_ctas();
int ceiling_tile_rows();
int ceiling_tile_cols(CeilingMode mode);
double ceiling_block_flops(CeilingMode mode);  // FLOPs of one K block on every CTA
// The K blocks per CTA that issue at least `flops`.
int64_t ceiling_blocks(CeilingMode mode, double flops);
void tensor_ceiling(CeilingMode mode, const void* a, int64_t M, const void* b, int64_t N, int64_t K, int64_t blocks,
                    float scale, float* d, int d_cta, cudaStream_t stream);

// `--ceiling` of bench gemm and bench grouped: a case's two ceilings (0: bare, 1: promoted as the
// case's GEMM promotes), launched on its own e4m3 operands a [*, K] and b [*, K] and timed beside
// it, each with all of its K blocks and with one: their difference, per block, is the Tensor Cores'
// rate without the launch and the operand loads, which a real kernel pays as well; so the ceiling's
// time for the case is an upper bound on any kernel's speed at the clock of that run.
struct Ceilings {
  CeilingMode mode[2];
  int64_t blocks[2];
  double flops;                              // the case's FLOPs
  Timing t[2], t_one[2];                     // all K blocks, one K block
  Ceilings(bool b_1x128, double case_flops);
  // Launch f of launches(): (bare, all), (bare, one), (promoted, all), (promoted, one).
  std::vector<std::function<void()>> launches(const QuantizedView& a, const QuantizedView& b) const;
  std::vector<Timing*> results() { return {&t[0], &t_one[0], &t[1], &t_one[1]}; }
  double us(int c) const;                    // the ceiling's time for the case's FLOPs
  // "#   Tensor Core ceiling: ..." with ours' and the reference's (cuBLASLt's) share of each.
  std::string line(double t_ours, double t_ref, const char* ref) const;
};

struct Timer {
  DeviceBuffer flush{size_t(512) << 20};
  // With `clocks`, each timed launch is bracketed by SM clock probes (after the flush, outside the
  // timed events): under the board's power cap the clock depends on the kernel, and a ratio of
  // times divided by the ratio of clocks compares kernels cycle for cycle.
  bool clocks = false;
  std::optional<DeviceBuffer> sweep;  // Flush::clean, allocated on first use
  // The mode where a call names none: FP8MOE_BENCH_FLUSH=clean|dirty (default dirty).
  Flush default_mode = [] {
    const char* e = std::getenv("FP8MOE_BENCH_FLUSH");
    return e && std::string(e) == "clean" ? Flush::clean : Flush::dirty;
  }();
  double median_us(const std::function<void()>& fn, int warmup, int iters, std::optional<Flush> which = {}) {
    return interleaved({fn}, warmup, iters, which)[0].us;
  }
  // Times several functions side by side: warm-up and timed launches go round the functions in
  // turn (each timed launch after its own flush), so that all of them run in the same power and
  // clock state of the board, whose clock falls as it warms under sustained load: timed one after
  // the other, the first would meet a cooler board than the last (docs/PERF-log.md, "Order and
  // warm-up of the timings"). Each round of timed launches takes the functions in a new random
  // order (fixed seed), so that each follows every other about equally often: a kernel can slow
  // the launch after it through the flush (docs/PERF-log.md, "The launch after another kernel").
  std::vector<Timing> interleaved(const std::vector<std::function<void()>>& fns, int warmup, int iters,
                                  std::optional<Flush> which = {}) {
    const Flush mode = which.value_or(default_mode);
    if (mode == Flush::clean && !sweep) {
      sweep.emplace((size_t(512) << 20) + 16);
      FP8MOE_CUDA_CHECK(cudaMemset(sweep->p, 0, sweep->bytes));
    }
    const size_t F = fns.size();
    for (int i = 0; i < warmup; ++i)
      for (const auto& fn : fns) fn();
    FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    // Timed launch n (events 2n and 2n + 1) runs function fn_of[n]; round i, launches i * F to
    // i * F + F - 1, runs each function once.
    const size_t launches = size_t(iters) * F;
    std::vector<size_t> fn_of(launches);
    {
      std::vector<size_t> round(F);
      std::iota(round.begin(), round.end(), size_t(0));
      std::mt19937 rng(20261201);
      for (size_t n = 0; n < launches; n += F) {
        std::shuffle(round.begin(), round.end(), rng);
        std::copy(round.begin(), round.end(), fn_of.begin() + ptrdiff_t(n));
      }
    }
    std::vector<cudaEvent_t> ev(2 * launches);
    for (auto& e : ev) FP8MOE_CUDA_CHECK(cudaEventCreate(&e));
    const int blocks = clocks ? clock_stamp_blocks() : 0;
    DeviceBuffer stamps(2 * launches * size_t(blocks) * sizeof(ClockStamp));
    auto stamp = [&](size_t k) { clock_stamp(static_cast<ClockStamp*>(stamps.p) + k * size_t(blocks), nullptr); };
    for (size_t n = 0; n < launches; ++n) {
      FP8MOE_CUDA_CHECK(cudaMemsetAsync(flush.p, int(n & 0xFF), flush.bytes, nullptr));
      if (mode == Flush::clean) l2_read_sweep(*sweep, nullptr);
      if (clocks) stamp(2 * n);
      FP8MOE_CUDA_CHECK(cudaEventRecord(ev[2 * n], nullptr));
      fns[fn_of[n]]();
      FP8MOE_CUDA_CHECK(cudaEventRecord(ev[2 * n + 1], nullptr));
      if (clocks) stamp(2 * n + 1);
    }
    FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<ClockStamp> h;
    if (clocks) {
      h.resize(2 * launches * size_t(blocks));
      FP8MOE_CUDA_CHECK(cudaMemcpy(h.data(), stamps.p, stamps.bytes, cudaMemcpyDeviceToHost));
    }
    auto median = [](std::vector<double> v) {
      if (v.empty()) return double(NAN);
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::vector<Timing> out(F);
    for (size_t f = 0; f < F; ++f) {
      std::vector<double> us, ghz;
      for (size_t n = 0; n < launches; ++n) {
        if (fn_of[n] != f) continue;
        float ms = 0;
        FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * n], ev[2 * n + 1]));
        us.push_back(double(ms) * 1e3);
        if (clocks) {
          const double g = clock_ghz(&h[2 * n * size_t(blocks)], &h[(2 * n + 1) * size_t(blocks)], blocks);
          if (std::isfinite(g)) ghz.push_back(g);
        }
      }
      out[f] = {median(us), median(ghz)};
    }
    for (auto& e : ev) cudaEventDestroy(e);
    return out;
  }
};

template <class T>
inline std::vector<T> to_host(const void* p, size_t n) {
  std::vector<T> h(n);
  if (n) FP8MOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::vector<double> d_to_doubles(const void* dev, int64_t M, int64_t N, bool f32) {
  std::vector<double> out(size_t(M * N));
  if (f32) {
    auto h = to_host<float>(dev, size_t(M * N));
    for (size_t i = 0; i < h.size(); ++i) out[i] = h[i];
  } else {
    auto h = to_host<uint16_t>(dev, size_t(M * N));
    for (size_t i = 0; i < h.size(); ++i) out[i] = bf16_bits_to_float(h[i]);
  }
  return out;
}

inline bool has_nan(const std::vector<double>& x) {
  for (double v : x)
    if (!std::isfinite(v)) return true;
  return false;
}

// FP8MOE_BENCH_TILES="128x192,128x128/pipe,128x160/direct,128x192/f32,128x128/pipe/r8,192x128/t3,...": extra
// tiles (/rN: N blocks per rasterization group; /tN: N last-wave K slices) timed on every case
// (where compiled for its kind), each checked bit for bit against the chosen tile's D (where both
// sum the same K ranges: K slices add their partials in another order).
inline std::vector<GemmTile> extra_tiles_from_env() {
  std::vector<GemmTile> v;
  const char* env = std::getenv("FP8MOE_BENCH_TILES");
  if (!env) return v;
  std::string s(env);
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(pos, end - pos);
    pos = end + 1;
    GemmTile t{};
    if (std::sscanf(item.c_str(), "%dx%d", &t.block_m, &t.block_n) != 2) continue;
    t.tma_epilogue = item.find("/direct") == std::string::npos;
    t.pipelined = item.find("/pipe") != std::string::npos;
    t.multicast = item.find("/mc2") != std::string::npos ? 2 : 1;
    t.f32_staging = item.find("/f32") != std::string::npos;
    if (const size_t r = item.find("/r"); r != std::string::npos) t.raster_n = std::atoi(item.c_str() + r + 2);
    if (const size_t r = item.find("/t"); r != std::string::npos) t.tail_split = std::atoi(item.c_str() + r + 2);
    if (t.raster_n < 1 || t.tail_split < 1) continue;
    v.push_back(t);
  }
  return v;
}

inline double geomean(const std::vector<double>& v) {
  if (v.empty()) return double(NAN);
  double s = 0;
  for (double x : v) s += std::log(x);
  return std::exp(s / double(v.size()));
}

}  // namespace fp8moe::cuda::bench
