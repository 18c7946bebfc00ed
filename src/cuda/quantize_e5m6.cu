// E5M6 on the GPU: 1x128 quantization (the report's cache of the attention-out Linear input, with
// power-of-two scales) and its dequantization. No hardware conversion exists for this format, so
// the kernel runs the integer encoder that the CPU codecs use (minifloat_encode.hpp): the same bits
// by construction. One warp per (row, 128-column group), 4 elements per lane.
#include <cfloat>

#include <cuda_bf16.h>

#include "cuda_check.hpp"
#include "device_checks.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/minifloat_encode.hpp"
#include "kernel_api.hpp"

namespace fp8moe::cuda {

namespace {

constexpr float kE5M6Max = 65024.0f;

template <class T>
__device__ __forceinline__ float load(const T* p, int64_t i) {
  if constexpr (sizeof(T) == 4) return p[i];
  else return __bfloat162float(p[i]);
}

// The scale rule of quantize.hpp (compute_scale), on the device.
__device__ __forceinline__ float scale_from_amax(float amax, bool pow2) {
  if (amax == 0.0f) return 1.0f;
  float s = __fdiv_rn(amax, kE5M6Max);
  if (pow2) {
    const uint32_t b = __float_as_uint(s), e = (b >> 23) & 0xFF;
    s = e == 0 ? FLT_MIN : ((b & 0x7FFFFF) == 0 ? s : __uint_as_float((e + 1) << 23));
  }
  return fmaxf(s, FLT_MIN);
}

// x [R, C] f32|bf16 -> q [R, C] e5m6 (uint16), scales [ceil(C/128), ld] f32 (M-major).
template <class T>
__global__ void quantize_e5m6_kernel(const T* __restrict__ x, uint16_t* __restrict__ q, float* __restrict__ scales,
                                     int64_t R, int64_t C, int64_t ld, bool pow2, int* __restrict__ nonfinite) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t G = (C + 127) / 128;
  if (warp >= R * G) return;
  const int64_t r = warp / G, g = warp % G;
  float v[4];
  float amax = 0;
  for (int i = 0; i < 4; ++i) {
    const int64_t c = g * 128 + lane * 4 + i;
    v[i] = c < C ? load(x, r * C + c) : 0.0f;
    if (!isfinite(v[i])) atomicExch(nonfinite, 1);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  const float s = scale_from_amax(amax, pow2);
  const float inv = __frcp_rn(s);  // the reciprocal scale of quantize.hpp: q = encode(x * (1 / s))
  for (int i = 0; i < 4; ++i) {
    const int64_t c = g * 128 + lane * 4 + i;
    if (c < C) q[r * C + c] = uint16_t(minifloat_encode_bits(__float_as_uint(__fmul_rn(v[i], inv)), 5, 6, 15, true, true));
  }
  if (lane == 0) scales[g * ld + r] = s;
}

__global__ void fill_padding(float* scales, int64_t R, int64_t ld, int64_t G) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, pad = ld - R;
  if (i < G * pad) scales[(i / pad) * ld + R + i % pad] = 1.0f;
}

__device__ __forceinline__ float e5m6_value(uint16_t code) {
  const uint32_t field = (code >> 6) & 31, man = code & 63;
  float v = field == 0 ? ldexpf(float(man), -20) : ldexpf(float(man | 64), int(field) - 21);
  if (field == 31) v = man ? __int_as_float(0x7FC00000) : __int_as_float(0x7F800000);
  return (code & 0x800) ? -v : v;
}

template <class T>
__global__ void dequantize_e5m6_kernel(const uint16_t* __restrict__ q, const float* __restrict__ scales, int64_t ld,
                                       T* __restrict__ out, int64_t R, int64_t C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= R * C) return;
  const int64_t r = i / C, c = i % C;
  const float v = e5m6_value(q[i]) * scales[(c / 128) * ld + r];
  if constexpr (sizeof(T) == 4) out[i] = v;
  else out[i] = __float2bfloat16_rn(v);
}

__device__ int g_e5m6_nonfinite;

}  // namespace

void quantize_1x128_e5m6_cuda(const TensorView& x, const QuantizedView& out, ScaleMode mode, cudaStream_t stream) {
  FP8MOE_CHECK(x.device == Device::cuda && out.values.device == Device::cuda, "x, out: expected GPU tensors");
  FP8MOE_CHECK(x.dtype == DType::f32 || x.dtype == DType::bf16, "x: expected dtype f32|bf16, got " << x.str());
  check_tensor(x, "x", {DType::f32, DType::bf16}, 2);
  check_quantized(out, "out", ScaleKind::tile_1x128);
  check_shape(out.values, "out.values", {x.size(0), x.size(1)});
  const int64_t R = x.size(0), C = x.size(1), ld = out.scales.size(1), G = (C + 127) / 128;
  int* flag = nullptr;
  FP8MOE_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&flag), g_e5m6_nonfinite));
  clear_flag(flag, stream);
  const int64_t threads = R * G * 32;
  const unsigned grid = unsigned((threads + 255) / 256);
  if (R * G > 0) {
    if (x.dtype == DType::f32)
      quantize_e5m6_kernel<<<grid, 256, 0, stream>>>(x.ptr<const float>(), out.values.ptr<uint16_t>(),
                                                     out.scales.ptr<float>(), R, C, ld, mode == ScaleMode::pow2, flag);
    else
      quantize_e5m6_kernel<<<grid, 256, 0, stream>>>(x.ptr<const __nv_bfloat16>(), out.values.ptr<uint16_t>(),
                                                     out.scales.ptr<float>(), R, C, ld, mode == ScaleMode::pow2, flag);
    FP8MOE_CUDA_CHECK_LAUNCH("quantize_e5m6_kernel");
  }
  if (ld > R && G > 0) {
    fill_padding<<<unsigned((G * (ld - R) + 255) / 256), 256, 0, stream>>>(out.scales.ptr<float>(), R, ld, G);
    FP8MOE_CUDA_CHECK_LAUNCH("fill_padding");
  }
  raise_if_flag_set(flag, stream, "x", "non-finite value (NaN/Inf input is refused by the quantizers)");
}

void dequantize_e5m6_cuda(const QuantizedView& in, const TensorView& out, cudaStream_t stream) {
  FP8MOE_CHECK(in.kind == ScaleKind::tile_1x128, "in: e5m6 tensors carry 1x128 scales on the GPU");
  FP8MOE_CHECK(out.dtype == DType::f32 || out.dtype == DType::bf16, "out: expected dtype f32|bf16, got " << out.str());
  const int64_t R = in.rows(), C = in.cols(), ld = in.scales.size(1);
  if (R * C == 0) return;
  const unsigned grid = unsigned((R * C + 255) / 256);
  if (out.dtype == DType::f32)
    dequantize_e5m6_kernel<<<grid, 256, 0, stream>>>(in.values.ptr<const uint16_t>(), in.scales.ptr<const float>(), ld,
                                                     out.ptr<float>(), R, C);
  else
    dequantize_e5m6_kernel<<<grid, 256, 0, stream>>>(in.values.ptr<const uint16_t>(), in.scales.ptr<const float>(), ld,
                                                     out.ptr<__nv_bfloat16>(), R, C);
  FP8MOE_CUDA_CHECK_LAUNCH("dequantize_e5m6_kernel");
}

}  // namespace fp8moe::cuda
