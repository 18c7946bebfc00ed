// The host reference of one rank's low-latency dispatch (parallel/runtime/ep_reference.hpp) in
// the masked layout the grouped GEMM reads, for the tests that feed it to the CPU masked GEMM.
#pragma once
#include <algorithm>
#include <cstring>
#include <vector>

#include "fp8moe/quantize.hpp"
#include "parallel/runtime/ep_reference.hpp"

namespace fp8moe::testing {

struct MaskedRows {
  QuantizedTensor a;  // [E_l * M, D] e4m3, 1x128 scales: expert e's rows at e * M + [0, n_e), the rest 0 with scale 1
  Tensor counts;      // [E_l] i32 host
};

inline MaskedRows masked_rows(const std::vector<ep::LowLatencyExpert>& experts, int64_t M, int64_t D) {
  const int64_t El = int64_t(experts.size()), R = El * M, G = D / 128;
  MaskedRows m{make_quantized_host(R, D, DType::e4m3, ScaleKind::tile_1x128), Tensor::host(DType::i32, {El})};
  std::memset(m.a.values.ptr<uint8_t>(), 0, size_t(R * D));
  const int64_t ld = m.a.scales.size(1);
  std::fill(m.a.scales.ptr<float>(), m.a.scales.ptr<float>() + G * ld, 1.0f);
  for (int64_t e = 0; e < El; ++e) {
    const ep::LowLatencyExpert& ref = experts[size_t(e)];
    const int64_t n = int64_t(ref.src_slot.size());
    m.counts.ptr<int32_t>()[e] = int32_t(n);
    std::memcpy(m.a.values.ptr<uint8_t>() + e * M * D, ref.x.data(), ref.x.size());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < G; ++g) m.a.scales.ptr<float>()[g * ld + e * M + i] = ref.scales[size_t(i * G + g)];
  }
  return m;
}

}  // namespace fp8moe::testing
