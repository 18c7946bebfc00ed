// Device arithmetic of the quantizers (quantize.hpp), shared by every kernel that writes FP8 tiles
// (quantize.cu, the fused MoE permutation in moe_dispatch.cu) so that all of them round exactly as
// the CPU reference: s = amax / max_finite (IEEE division) or the smallest power of two >= that,
// s = 1 for an all-zero tile, s >= FLT_MIN; q = encode(x / s), saturating round-to-nearest-even.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

namespace fp8moe::cuda {

template <class T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// Smallest power of two >= s (s > 0 finite), as ue8m0_decode(ue8m0_encode(s, round_up)); values
// below FLT_MIN end up as FLT_MIN after the clamp in scale_of.
__device__ __forceinline__ float pow2_round_up(float s) {
  const uint32_t b = __float_as_uint(s);
  const uint32_t e = (b >> 23) & 0xFF;
  if (e == 0) return FLT_MIN;
  if ((b & 0x7FFFFF) == 0) return s;
  return __uint_as_float((e + 1) << 23);
}

__device__ __forceinline__ float scale_of(float amax, float max_finite, bool pow2) {
  if (amax == 0.0f) return 1.0f;
  float s = __fdiv_rn(amax, max_finite);
  if (pow2) s = pow2_round_up(s);
  return fmaxf(s, FLT_MIN);
}

template <bool kE5M2>
__device__ __forceinline__ uint8_t encode(float v) {
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3));
}

// encode(lo) | encode(hi) << 8 with one paired conversion (the same rounding per element).
template <bool kE5M2>
__device__ __forceinline__ uint16_t encode2(float lo, float hi) {
  return uint16_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3));
}

template <bool kE5M2>
__device__ __forceinline__ float decode(uint8_t q) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(q), kE5M2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

}  // namespace fp8moe::cuda
