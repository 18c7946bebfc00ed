// Shared pieces of the kernel benchmarks (bench.cpp, bench_moe_dispatch.cpp): device buffers,
// device views, and the timer (warm-up, then each timed launch after a 512 MiB memset that flushes
// L2 and gives the host time to enqueue it, so the event pair measures GPU time; median of iters).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "cuda_check.hpp"
#include "fp8moe/quantize.hpp"

namespace fp8moe::cuda::bench {

// ---- device buffers ----
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

// ---- timing ----
struct Timer {
  DeviceBuffer flush{size_t(512) << 20};
  double median_us(const std::function<void()>& fn, int warmup, int iters) {
    for (int i = 0; i < warmup; ++i) fn();
    FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<cudaEvent_t> ev(size_t(2 * iters));
    for (auto& e : ev) FP8MOE_CUDA_CHECK(cudaEventCreate(&e));
    for (int i = 0; i < iters; ++i) {
      FP8MOE_CUDA_CHECK(cudaMemsetAsync(flush.p, i & 0xFF, flush.bytes, nullptr));
      FP8MOE_CUDA_CHECK(cudaEventRecord(ev[size_t(2 * i)], nullptr));
      fn();
      FP8MOE_CUDA_CHECK(cudaEventRecord(ev[size_t(2 * i + 1)], nullptr));
    }
    FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> us(static_cast<size_t>(iters));
    for (int i = 0; i < iters; ++i) {
      float ms = 0;
      FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[size_t(2 * i)], ev[size_t(2 * i + 1)]));
      us[size_t(i)] = double(ms) * 1e3;
    }
    for (auto& e : ev) cudaEventDestroy(e);
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }
};

template <class T>
inline std::vector<T> to_host(const void* p, size_t n) {
  std::vector<T> h(n);
  if (n) FP8MOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace fp8moe::cuda::bench
