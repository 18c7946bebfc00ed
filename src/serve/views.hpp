// Non-owning views the engine and the cache take of contiguous tensors: rows [r0, r0 + n) and
// another shape of the same storage.
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

inline TensorView reshape(const TensorView& t, std::initializer_list<int64_t> shape) {
  TensorView v(t.data, t.dtype, shape, t.device);
  FP8MOE_CHECK(v.numel() == t.numel() && t.is_contiguous(), "reshape: " << t.str() << " to " << v.str());
  return v;
}

}  // namespace fp8moe::serve
