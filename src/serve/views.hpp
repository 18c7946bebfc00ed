// Non-owning views the engine and the cache take of contiguous tensors: rows [r0, r0 + n) and
// strided matrices in it (another shape of the same storage: fp8moe/tensor.hpp's reshape).
#pragma once
#include <initializer_list>

#include "fp8moe/error.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::serve {

inline TensorView rows(const TensorView& t, int64_t r0, int64_t n) {
  FP8MOE_CHECK(t.ndim >= 1 && r0 >= 0 && r0 + n <= t.size(0), "rows [" << r0 << ", " << r0 + n << ") outside " << t.str());
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + r0 * t.strides[0] * int64_t(dtype_size(t.dtype));
  v.shape[0] = n;
  return v;
}

// G matrices [R, C] of t's storage (contiguous): matrix g at element offset + g * batch_stride,
// its rows row_stride apart (Backend::gemm_strided_batched's operands).
inline TensorView matrices(const TensorView& t, int64_t offset, int64_t G, int64_t R, int64_t C, int64_t batch_stride,
                           int64_t row_stride) {
  FP8MOE_CHECK(t.is_contiguous() && offset >= 0 && C <= row_stride &&
                   offset + (G - 1) * batch_stride + (R - 1) * row_stride + C <= t.numel(),
               "matrices: " << G << " x [" << R << ", " << C << "] at " << offset << " outside " << t.str());
  TensorView v(static_cast<char*>(t.data) + offset * int64_t(dtype_size(t.dtype)), t.dtype, {G, R, C}, t.device);
  v.strides = {batch_stride, row_stride, 1, 0};
  return v;
}

}  // namespace fp8moe::serve
