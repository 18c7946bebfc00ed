// E5M6 on the GPU: 1x128 quantization (the report's cache of the attention-out Linear input, with
// power-of-two scales) and its dequantization, on packed codes (two in three bytes, dtype.hpp). No
// hardware conversion exists for this format, so the kernel runs the integer encoder that the CPU
// codecs use (minifloat_encode.hpp), and packs as e5m6_pack2 does: the same bytes by construction.
#include <cfloat>

#include <cuda_bf16.h>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_checks.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/minifloat_encode.hpp"
#include "cuda/kernel_api.hpp"

namespace fp8moe::cuda {

namespace {

constexpr float kE5M6Max = 65024.0f;

// Four consecutive elements of x from element i: one 16-byte (f32) or 8-byte (bf16) load when
// `vec` (row length and base pointer aligned for it), else four scalar loads with the tail masked.
template <class T>
__device__ __forceinline__ void load4(const T* __restrict__ x, int64_t i, int64_t n_valid, bool vec, float (&v)[4]) {
  if (vec && n_valid >= 4) {
    if constexpr (sizeof(T) == 4) {
      const float4 f = *reinterpret_cast<const float4*>(x + i);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(x + i);
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    }
    return;
  }
  for (int k = 0; k < 4; ++k) {
    if (k >= n_valid) v[k] = 0.0f;
    else if constexpr (sizeof(T) == 4) v[k] = x[i + k];
    else v[k] = __bfloat162float(x[i + k]);
  }
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

// x [R, C] f32|bf16 -> q [R, C] e5m6 (packed, 1.5 bytes each), scales [ceil(C/128), ld] f32
// (M-major). One warp per (row, 128-column group), four consecutive elements per lane; C even, so
// a lane's elements are two whole pairs (no byte shared with another lane). `vec`: C % 4 == 0 and
// x aligned, so each lane moves its four elements with one load and three 2-byte stores (six bytes
// at a multiple of six).
// NOTES: the integer encoder bounds it, not memory (45% of copy from f32); four items per warp
// with their loads issued first are slower, not faster.
template <class T>
__global__ void quantize_e5m6_kernel(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scales,
                                     int64_t R, int64_t C, int64_t ld, bool pow2, bool vec, int* __restrict__ nonfinite) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t G = (C + 127) / 128;
  if (warp >= R * G) return;
  const int64_t r = warp / G, g = warp % G;
  const int64_t c0 = g * 128 + lane * 4, n_valid = C - c0;
  float v[4];
  load4(x, r * C + c0, n_valid, vec, v);
  float amax = 0;
  bool finite = true;
  for (int i = 0; i < 4; ++i) {
    finite = finite && isfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  if (!finite) atomicExch(nonfinite, 1);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  const float s = scale_from_amax(amax, pow2);
  const float inv = __frcp_rn(s);  // the reciprocal scale of quantize.hpp: q = encode(x * (1 / s))
  uint16_t code[4];
  for (int i = 0; i < 4; ++i)
    code[i] = uint16_t(minifloat_encode_bits(__float_as_uint(__fmul_rn(v[i], inv)), 5, 6, 15, true, true));
  const int64_t i0 = r * C + c0;  // even: C and c0 are
  if (vec && n_valid >= 4) {
    // The four codes as one 48-bit little-endian word: two 24-bit pairs (e5m6_pack2's bytes).
    const uint64_t w = uint64_t(code[0]) | uint64_t(code[1]) << 12 | uint64_t(code[2]) << 24 | uint64_t(code[3]) << 36;
    uint16_t* p = reinterpret_cast<uint16_t*>(q + i0 / 2 * 3);
    p[0] = uint16_t(w), p[1] = uint16_t(w >> 16), p[2] = uint16_t(w >> 32);
  } else {
    for (int k = 0; k < 4 && k < n_valid; k += 2) e5m6_pack2(code[k], code[k + 1], q + (i0 + k) / 2 * 3);
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

// Code k (0..7) of eight packed codes held as three little-endian words (96 bits, 12 per code).
__device__ __forceinline__ uint16_t e5m6_code8(const uint32_t (&w)[3], int k) {
  const int bit = 12 * k, word = bit / 32, off = bit % 32;
  const uint32_t lo = w[word] >> off;
  const uint32_t v = off > 20 ? lo | (w[word + 1] << (32 - off)) : lo;  // straddles two words
  return uint16_t(v & 0xFFF);
}

// out [R, C] = decode(q) * scale, eight consecutive elements of a row per thread (C % 8 == 0: the
// eight codes are twelve bytes at a multiple of twelve, three 4-byte loads; two 16-byte (f32) or
// one 16-byte (bf16) store), else one per thread.
template <class T, bool kVec>
__global__ void dequantize_e5m6_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales, int64_t ld,
                                       T* __restrict__ out, int64_t R, int64_t C) {
  constexpr int kN = kVec ? 8 : 1;
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kN;
  if (i >= R * C) return;
  const int64_t r = i / C, c = i % C;
  const float s = scales[(c / 128) * ld + r];  // the kN elements share one 128-column group
  float v[kN];
  if constexpr (kVec) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(q + i / 2 * 3);
    const uint32_t w[3] = {p[0], p[1], p[2]};
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = e5m6_value(e5m6_code8(w, k)) * s;
    if constexpr (sizeof(T) == 4) {
      reinterpret_cast<float4*>(out + i)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(out + i)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      uint32_t o[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
        o[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
      *reinterpret_cast<uint4*>(out + i) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  } else {
    v[0] = e5m6_value(e5m6_load(q, i)) * s;
    if constexpr (sizeof(T) == 4) out[i] = v[0];
    else out[i] = __float2bfloat16_rn(v[0]);
  }
}

template <class T>
void launch_dequantize_e5m6(const QuantizedView& in, T* out, int64_t R, int64_t C, int64_t ld, cudaStream_t stream) {
  const uint8_t* q = in.values.ptr<const uint8_t>();
  const float* s = in.scales.ptr<const float>();
  const bool vec = C % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t threads = vec ? R * C / 8 : R * C;
  const unsigned grid = unsigned((threads + 255) / 256);
  if (vec) dequantize_e5m6_kernel<T, true><<<grid, 256, 0, stream>>>(q, s, ld, out, R, C);
  else dequantize_e5m6_kernel<T, false><<<grid, 256, 0, stream>>>(q, s, ld, out, R, C);
  FP8MOE_CUDA_CHECK_LAUNCH("dequantize_e5m6_kernel");
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
  // NOTES: with an odd row length a packed pair spans two rows, whose warps would race on the byte
  // they share; the model's attention-out input has H * v_head_dim columns, even.
  FP8MOE_CHECK(C % 2 == 0, "out.values: packed E5M6 on the GPU needs an even number of columns, got " << out.values.str());
  int* flag = nullptr;
  FP8MOE_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&flag), g_e5m6_nonfinite));
  clear_flag(flag, stream);
  const int64_t threads = R * G * 32;
  const unsigned grid = unsigned((threads + 255) / 256);
  const bool vec = C % 4 == 0 && reinterpret_cast<uintptr_t>(x.data) % (4 * dtype_size(x.dtype)) == 0 &&
                   reinterpret_cast<uintptr_t>(out.values.data) % 2 == 0;
  if (R * G > 0) {
    const bool pow2 = mode == ScaleMode::pow2;
    if (x.dtype == DType::f32)
      quantize_e5m6_kernel<<<grid, 256, 0, stream>>>(x.ptr<const float>(), out.values.ptr<uint8_t>(),
                                                     out.scales.ptr<float>(), R, C, ld, pow2, vec, flag);
    else
      quantize_e5m6_kernel<<<grid, 256, 0, stream>>>(x.ptr<const __nv_bfloat16>(), out.values.ptr<uint8_t>(),
                                                     out.scales.ptr<float>(), R, C, ld, pow2, vec, flag);
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
  if (out.dtype == DType::f32) launch_dequantize_e5m6(in, out.ptr<float>(), R, C, ld, stream);
  else launch_dequantize_e5m6(in, out.ptr<__nv_bfloat16>(), R, C, ld, stream);
}

}  // namespace fp8moe::cuda
