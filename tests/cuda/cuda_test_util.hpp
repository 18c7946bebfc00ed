// Helpers of the CUDA tests: the GPU skip guard, host <-> device copies of (quantized) tensors.
// Every GPU test starts with FP8MOE_REQUIRE_GPU() and is reported as skipped without a GPU.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "cuda/cuda_backend.hpp"
#include "cuda/kernel_api.hpp"
#include "fp8moe/backend.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/minifloat_encode.hpp"
#include "testing.hpp"

#define FP8MOE_REQUIRE_GPU()                                                         \
  do {                                                                               \
    if (!::fp8moe::cuda_device_available()) GTEST_SKIP() << "no CUDA device";        \
  } while (0)

#define FP8MOE_REQUIRE_SM90()                                                        \
  do {                                                                               \
    FP8MOE_REQUIRE_GPU();                                                            \
    if (!::fp8moe::cuda::sm90_available()) GTEST_SKIP() << "needs a Hopper (sm_90) GPU"; \
  } while (0)

namespace fp8moe::testing {

// A device copy of a 1-D or 2-D host tensor.
inline Tensor to_device(Backend& be, const Tensor& h) {
  Tensor d = h.view().ndim == 1 ? be.zeros(h.dtype(), {h.size(0)}) : be.zeros(h.dtype(), {h.size(0), h.size(1)});
  be.copy(d.view(), h.view());
  return d;
}

inline QuantizedTensor to_device(Backend& be, const QuantizedTensor& h) {
  return {to_device(be, h.values), to_device(be, h.scales), h.kind};
}

inline QuantizedTensor to_host(Backend& be, const QuantizedTensor& d) {
  return {be.to_host(d.values), be.to_host(d.scales), d.kind};
}

// Quantized tensor with small-integer values in [-6, 6] and scales in {1/2, 1, 2}: with K <= 1024
// every partial sum needs at most 20 significant bits, so FP32 and the Tensor Cores are exact.
inline QuantizedTensor small_int_quantized(std::mt19937_64& rng, int64_t R, int64_t C, ScaleKind kind) {
  QuantizedTensor q = make_quantized_host(R, C, DType::e4m3, kind);
  std::uniform_int_distribution<int> v(-6, 6), e(-1, 1);
  auto* vals = q.values.ptr<uint8_t>();
  for (int64_t i = 0; i < R * C; ++i) vals[i] = e4m3_encode(float(v(rng)));
  auto* s = q.scales.ptr<float>();
  for (int64_t i = 0; i < q.scales.numel(); ++i) s[i] = std::ldexp(1.0f, e(rng));
  return q;
}

// [R, C] e4m3 values in {-1, 0, 1} (host): sums of their products are integers, exact wherever they
// fit the accumulator's mantissa.
inline Tensor ternary_e4m3(std::mt19937_64& rng, int64_t R, int64_t C) {
  Tensor t = Tensor::host(DType::e4m3, {R, C});
  std::uniform_int_distribution<int> v(-1, 1);
  for (int64_t i = 0; i < R * C; ++i) t.ptr<uint8_t>()[i] = e4m3_encode(float(v(rng)));
  return t;
}

// Tests of sm_90a kernels: skipped without a Hopper GPU; be_ is the CUDA backend.
class Sm90Test : public ::testing::Test {
 protected:
  void SetUp() override {
    FP8MOE_REQUIRE_SM90();
    be_ = make_cuda_backend();
  }
  std::unique_ptr<Backend> be_;
};

inline bool bytes_equal(const Tensor& x, const Tensor& y) {
  return x.view().nbytes() == y.view().nbytes() && std::memcmp(x.view().data, y.view().data, x.view().nbytes()) == 0;
}

// First index where two host tensors differ bytewise (element index), -1 if equal.
inline int64_t first_mismatch(const Tensor& x, const Tensor& y) {
  const size_t es = dtype_size(x.dtype());
  const auto* a = static_cast<const uint8_t*>(x.view().data);
  const auto* b = static_cast<const uint8_t*>(y.view().data);
  if (x.dtype() == DType::e5m6) {  // packed: compare the 12-bit codes
    for (int64_t i = 0; i < x.numel(); ++i)
      if (e5m6_load(a, i) != e5m6_load(b, i)) return i;
    return -1;
  }
  for (int64_t i = 0; i < x.numel(); ++i)
    if (std::memcmp(a + i * es, b + i * es, es) != 0) return i;
  return -1;
}

}  // namespace fp8moe::testing
