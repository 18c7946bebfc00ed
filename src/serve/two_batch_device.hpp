// Device memory and kernels shared by the two-micro-batch layer steps (two_batch.hpp for decode,
// two_batch_prefill.hpp for prefill): buffers, FP8 tensors, seeded weights, and the experts'
// SwiGLU + e4m3 on the rows a layout uses.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_checks.hpp"
#include "fp8moe/quantize.hpp"
#include "serve/two_batch.hpp"

namespace fp8moe::serve::detail {

// n bytes on the current device, zeroed.
struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t n) : bytes(n) {
    FP8MOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16)));
    FP8MOE_CUDA_CHECK(cudaMemset(p, 0, std::max<size_t>(n, 16)));
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  TensorView view(DType t, int64_t r, int64_t c, int64_t row0 = 0) const {
    return TensorView(static_cast<char*>(p) + row0 * c * int64_t(dtype_size(t)), t, {r, c}, Device::cuda);
  }
  TensorView vec(DType t, int64_t n) const { return TensorView(p, t, {n}, Device::cuda); }
};

// An FP8 tensor on the device, e4m3 values with `kind` scales.
struct QBuf {
  int64_t rows, cols;
  ScaleKind kind;
  Buf values, scales;
  QBuf(int64_t r, int64_t c, ScaleKind k)
      : rows(r), cols(c), kind(k), values(size_t(r * c)),
        scales(size_t(scale_shape(k, r, c)[0] * scale_shape(k, r, c)[1]) * 4) {}
  QuantizedView view() const {
    const auto ss = scale_shape(kind, rows, cols);
    return {values.view(DType::e4m3, rows, cols), scales.view(DType::f32, ss[0], ss[1]), kind};
  }
  // Rows [r0, r0 + n) of a 128x128-scaled tensor (r0 a multiple of 128).
  QuantizedView block_rows(int64_t r0, int64_t n) const;
  QuantizedTensor host() const;
};

// A [rows, cols] weight of N(0, 1 / cols) draws quantized 128x128.
std::unique_ptr<QBuf> random_weight(int64_t rows, int64_t cols, uint64_t seed);

template <class T>
void upload(const Buf& b, const std::vector<T>& h) {
  FP8MOE_CUDA_CHECK(cudaMemcpy(b.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <class T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> h(n);
  FP8MOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// q, s = SwiGLU(g, u) [R, F] f32 quantized to e4m3 with 1x128 fp32 scales (quantize_1x128's
// rounding; scales [F / 128, scale_ld(R)]) on the rows a layout uses only, which are few of R:
//   masked      (row_group null) row r of group r / rows_per_group, used below counts[group];
//   contiguous  (row_group [R]) row r used where row_group[r] >= 0.
// The other rows are left as they are (no later step reads them).
void swiglu_quantize_rows(const float* g, const float* u, int64_t R, int64_t F, const int32_t* counts,
                          int64_t rows_per_group, const int32_t* row_group, uint8_t* q, float* s, cudaStream_t st);

// The device-recorded checks (device_checks.hpp) for a run's launches: the index checks and the
// norms' NaN/Inf checks are recorded on the device instead of one host synchronization each, which
// would hold every later launch of every rank behind that stream. Leaving the scope restores the
// mode, which raises what was recorded (after a device synchronization).
struct DeferredChecks {
  bool was = cuda::checks_deferred();
  DeferredChecks() { cuda::set_checks_deferred(true); }
  ~DeferredChecks() noexcept(false) { cuda::set_checks_deferred(was); }
  DeferredChecks(const DeferredChecks&) = delete;
  DeferredChecks& operator=(const DeferredChecks&) = delete;
};

// A micro-batch's MoE input on the host: mq's rows [T, D] and their scales token-major [T, D / 128],
// with the routing it was dispatched with.
TwoBatchLayer::MoeInput moe_input_of(const QBuf& mq, const std::vector<int32_t>& idx, const std::vector<float>& w);

}  // namespace fp8moe::serve::detail
