// Quantization kernels of the CUDA backend, bit-exact with the CPU quantizers (quantize.hpp):
// s = amax / max_finite (IEEE division) or the smallest power of two >= that, s = 1 for an
// all-zero tile, s >= FLT_MIN, q = encode(x / s) with __fdiv_rn and saturating RNE conversion
// (the arithmetic itself: quantize_device.cuh).
//
//   quantize_1x128    x [R, C] f32|bf16 -> q [R, C], s [ceil(C/128), ld(R)]  (one pass, 16-byte loads)
//   quantize_128x128  w [R, C]          -> q [R, C], s [ceil(R/128), ceil(C/128)]
//   quantize_128x1    x [T, C]          -> q [C, T], s [ceil(T/128), ld(C)]  (transpose through smem)
//   requantize_128x1  q [T, C] 1x128    -> q [C, T] 1x128 along T            (dequantize, transpose, requantize)
//   transpose_128x128 q [G*R, C] 128x128 -> q [G*C, R] 128x128, per group     (bytes and block scales moved)
//   dequantize        q [R, C] any kind -> [R, C] f32|bf16
// Output dtypes: e4m3, e5m2 (e5m6 has no device conversion here and is refused).
#include "cuda_check.hpp"
#include "device_checks.hpp"
#include "fp8moe/codecs.hpp"
#include "kernel_api.hpp"
#include "quantize_device.cuh"

namespace fp8moe::cuda {

namespace {

__device__ int g_nonfinite;  // set when a quantizer input holds NaN/Inf

__device__ __forceinline__ void flag_if_nonfinite(float v) {
  if (!isfinite(v)) atomicExch(&g_nonfinite, 1);
}

// Sets the padding scale entries [g, R..ld) of a 1x128 scale tensor [G, ld] to 1.
__global__ void fill_scale_padding_kernel(float* scales, int64_t G, int64_t R, int64_t ld) {
  const int64_t pad = ld - R;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < G * pad; i += int64_t(gridDim.x) * blockDim.x)
    scales[(i / pad) * ld + R + i % pad] = 1.0f;
}

// ---- 1x128 ----
// One group of 128 columns of one row per (128 / (2 VEC)) threads; each thread loads two adjacent
// 16-byte vectors (VEC elements each) up front.
// NOTES: two vectors per thread double the bytes in flight per SM (one vector reached ~64% of
// copy bandwidth on H200; a variant striding 4 groups apart per thread was slower still).
// x [R, C], q [R, C], s [G, ld] (G = ceil(C/128)).
template <class Tin, bool kE5M2, bool kVec>
__global__ void __launch_bounds__(256) quantize_1x128_kernel(const Tin* __restrict__ x, uint8_t* __restrict__ q,
                                                             float* __restrict__ s, int64_t R, int64_t C, int64_t ld,
                                                             float max_finite, bool pow2, bool check) {
  constexpr int VEC = 16 / sizeof(Tin);
  constexpr int EPT = 2 * VEC;     // elements per thread
  constexpr int TPG = 128 / EPT;   // threads per group: 8 (bf16) or 16 (f32)
  const int64_t G = (C + 127) / 128;
  const int64_t gid = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / TPG;
  const int lane_g = threadIdx.x % TPG;
  const bool active = gid < R * G;
  const int64_t r = active ? gid / G : 0, g = active ? gid % G : 0;
  const int64_t c0 = g * 128 + lane_g * EPT;

  float v[EPT];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t c = c0 + h * VEC;
    if (active && kVec && c < C) {
      // NOTES: kVec means C % VEC == 0 and 16-byte aligned rows, so a vector starting inside C ends inside.
      const uint4 raw = *reinterpret_cast<const uint4*>(x + r * C + c);
      const Tin* e = reinterpret_cast<const Tin*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[h * VEC + i] = to_f32(e[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[h * VEC + i] = (active && c + i < C) ? to_f32(x[r * C + c + i]) : 0.0f;
    }
  }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    if (check) flag_if_nonfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int o = TPG / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!active) return;
  const float sc = scale_of(amax, max_finite, pow2);
  if (lane_g == 0) s[g * ld + r] = sc;

  alignas(16) uint8_t out[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) out[i] = encode<kE5M2>(__fdiv_rn(v[i], sc));
  if (kVec && c0 + EPT <= C) {
    if constexpr (EPT == 16) {
      *reinterpret_cast<uint4*>(q + r * C + c0) = *reinterpret_cast<const uint4*>(out);
    } else {
      *reinterpret_cast<uint2*>(q + r * C + c0) = *reinterpret_cast<const uint2*>(out);
    }
  } else {
#pragma unroll
    for (int i = 0; i < EPT; ++i)
      if (c0 + i < C) q[r * C + c0 + i] = out[i];
  }
}

// ---- 128x128 ----
// One CTA of 256 threads per 128x128 block; each thread keeps 64 values in registers.
// w [R, C], q [R, C], s [ceil(R/128), ceil(C/128)].
template <class Tin, bool kE5M2, bool kVec>
__global__ void __launch_bounds__(256, 3) quantize_128x128_kernel(const Tin* __restrict__ w, uint8_t* __restrict__ q,
                                                               float* __restrict__ s, int64_t R, int64_t C,
                                                               float max_finite, bool pow2, bool check) {
  constexpr int VEC = 16 / sizeof(Tin);
  constexpr int CHUNKS = 128 / VEC;         // vectors per block row
  constexpr int ROWS_PER_PASS = 256 / CHUNKS;
  constexpr int PASSES = 128 / ROWS_PER_PASS;
  const int64_t r0 = int64_t(blockIdx.y) * 128, c0 = int64_t(blockIdx.x) * 128;
  const int cc = threadIdx.x % CHUNKS, rr = threadIdx.x / CHUNKS;
  const int64_t c = c0 + cc * VEC;

  // NOTES: the block's values stay in registers in their input encoding (32 registers, not 64),
  // which leaves room for more resident CTAs and so more loads in flight.
  uint4 raw[PASSES];
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int64_t r = r0 + rr + p * ROWS_PER_PASS;
    raw[p] = make_uint4(0, 0, 0, 0);
    Tin* e = reinterpret_cast<Tin*>(&raw[p]);
    if (kVec && r < R && c < C) {
      raw[p] = *reinterpret_cast<const uint4*>(w + r * C + c);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (r < R && c + i < C) e[i] = w[r * C + c + i];
    }
  }
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const Tin* e = reinterpret_cast<const Tin*>(&raw[p]);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float v = to_f32(e[i]);
      if (check) flag_if_nonfinite(v);
      amax = fmaxf(amax, fabsf(v));
    }
  }
  __shared__ float red[8];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = red[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) amax = fmaxf(amax, red[i]);
  const float sc = scale_of(amax, max_finite, pow2);
  if (threadIdx.x == 0) s[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = sc;

#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int64_t r = r0 + rr + p * ROWS_PER_PASS;
    uint8_t out[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = encode<kE5M2>(__fdiv_rn(to_f32(reinterpret_cast<const Tin*>(&raw[p])[i]), sc));
    if (kVec && r < R && c < C) {
      if constexpr (VEC == 8) {
        *reinterpret_cast<uint2*>(q + r * C + c) = *reinterpret_cast<const uint2*>(out);
      } else {
        *reinterpret_cast<uint32_t*>(q + r * C + c) = *reinterpret_cast<const uint32_t*>(out);
      }
    } else if (r < R) {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (c + i < C) q[r * C + c + i] = out[i];
    }
  }
}

// ---- 128x1 (transposing) ----
// CTA tile: 128 tokens x 64 channels, 256 threads. Phase 1 loads the tile (as f32) into shared
// memory; phase 2 gives each thread one channel and 32 tokens: amax over the 4 threads of a
// channel, then 32 output bytes written contiguously to q [C, T].
// Input either a plain tensor x [T, C] (Tin = f32|bf16) or, for requantize, FP8 q_in [T, C] with
// 1x128 scales s_in [ceil(C/128), ld(T)] (Tin = uint8_t).
constexpr int kTT = 128, kTC = 64;

template <class Tin, bool kInE5M2, bool kE5M2, bool kVecIn, bool kVecOut>
__global__ void __launch_bounds__(256) quantize_128x1_kernel(const Tin* __restrict__ x, const float* __restrict__ s_in,
                                                             int64_t ld_in, uint8_t* __restrict__ q,
                                                             float* __restrict__ s, int64_t T, int64_t C, int64_t ld,
                                                             float max_finite, bool pow2, bool check) {
  // NOTES: the tile keeps the input's own encoding (bf16: 16 KB instead of 32 KB as f32), so more
  // CTAs fit per SM; values are decoded when read in phase 2.
  __shared__ __align__(16) Tin tile[kTT][kTC];  // [128 tokens, 64 channels], input dtype
  __shared__ float s_tok[kTT];                   // requantize: input scale of each token
  __shared__ float red[4][kTC];
  constexpr bool kFp8In = sizeof(Tin) == 1;
  constexpr int VEC = 16 / sizeof(Tin);
  constexpr int CHUNKS = kTC / VEC;  // vectors per tile row
  const int64_t t0 = int64_t(blockIdx.y) * kTT, c0 = int64_t(blockIdx.x) * kTC;
  auto dec = [](Tin e) {
    if constexpr (kFp8In) return decode<kInE5M2>(e);
    else return to_f32(e);
  };

  if constexpr (kFp8In) {
    // 64-channel tiles never straddle a 128-channel scale group.
    if (threadIdx.x < kTT) {
      const int64_t t = t0 + threadIdx.x;
      s_tok[threadIdx.x] = t < T ? s_in[(c0 / 128) * ld_in + t] : 0.0f;
    }
  }
  for (int i = threadIdx.x; i < kTT * CHUNKS; i += 256) {
    const int tt = i / CHUNKS, cc = (i % CHUNKS) * VEC;
    const int64_t t = t0 + tt, c = c0 + cc;
    uint4 raw = make_uint4(0, 0, 0, 0);
    Tin* e = reinterpret_cast<Tin*>(&raw);
    if (kVecIn && t < T && c < C) {
      raw = *reinterpret_cast<const uint4*>(x + t * C + c);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (t < T && c + j < C) e[j] = x[t * C + c + j];
    }
    if (check) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) flag_if_nonfinite(dec(e[j]));
    }
    *reinterpret_cast<uint4*>(&tile[tt][cc]) = raw;
  }
  __syncthreads();

  const int cl = threadIdx.x % kTC, qd = threadIdx.x / kTC;  // channel, quarter of the tokens
  float v[32];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    v[j] = dec(tile[qd * 32 + j][cl]);
    if constexpr (kFp8In) v[j] = v[j] * s_tok[qd * 32 + j];  // FP32 product, as the CPU dequantizer
    amax = fmaxf(amax, fabsf(v[j]));
  }
  red[qd][cl] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(red[0][cl], red[1][cl]), fmaxf(red[2][cl], red[3][cl]));
  const int64_t c = c0 + cl;
  if (c >= C) return;
  const float sc = scale_of(amax, max_finite, pow2);
  if (qd == 0) s[int64_t(blockIdx.y) * ld + c] = sc;

  alignas(16) uint8_t out[32];
#pragma unroll
  for (int j = 0; j < 32; ++j) out[j] = encode<kE5M2>(__fdiv_rn(v[j], sc));
  const int64_t t = t0 + qd * 32;
  uint8_t* dst = q + c * T + t;
  if (kVecOut && t + 32 <= T) {
    reinterpret_cast<uint4*>(dst)[0] = reinterpret_cast<const uint4*>(out)[0];
    reinterpret_cast<uint4*>(dst)[1] = reinterpret_cast<const uint4*>(out)[1];
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j)
      if (t + j < T) dst[j] = out[j];
  }
}

// ---- dequantize ----
template <bool kE5M2, class Tout>
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ s, int64_t ld_s,
                                  bool block_128x128, Tout* __restrict__ out, int64_t R, int64_t C) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < R * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    const float sc = block_128x128 ? s[(r / 128) * ld_s + c / 128] : s[(c / 128) * ld_s + r];
    const float v = decode<kE5M2>(q[i]) * sc;
    if constexpr (sizeof(Tout) == 4) out[i] = v;
    else out[i] = __float2bfloat16_rn(v);
  }
}

// ---- host helpers ----
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_device(const TensorView& t, const char* arg) {
  FP8MOE_CHECK(t.device == Device::cuda, arg << ": expected a GPU tensor, got " << t.str());
  FP8MOE_CHECK(t.is_contiguous(), arg << ": expected a contiguous tensor, got " << t.str());
}

void check_out_dtype(const QuantizedView& out, const char* arg) {
  FP8MOE_CHECK(out.values.dtype == DType::e4m3 || out.values.dtype == DType::e5m2,
               arg << ": the CUDA quantizers write e4m3 or e5m2, got " << dtype_name(out.values.dtype));
}

int* nonfinite_flag() {
  static int* flag = [] {
    int* p = nullptr;
    FP8MOE_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&p), g_nonfinite));
    return p;
  }();
  return flag;
}

void reset_flag(cudaStream_t stream, bool check) {
  if (check) clear_flag(nonfinite_flag(), stream);
}

void raise_if_flagged(cudaStream_t stream, bool check, const char* arg) {
  if (check)
    raise_if_flag_set(nonfinite_flag(), stream, arg, "non-finite value (NaN/Inf input is refused by the quantizers)");
}

void fill_padding(const TensorView& scales, int64_t R, cudaStream_t stream) {
  const int64_t G = scales.size(0), ld = scales.size(1);
  if (ld == R || G == 0) return;
  fill_scale_padding_kernel<<<int(std::min<int64_t>((G * (ld - R) + 255) / 256, 1024)), 256, 0, stream>>>(
      scales.ptr<float>(), G, R, ld);
  FP8MOE_CUDA_CHECK_LAUNCH("fill_scale_padding_kernel");
}

int grid_1d(int64_t n, int threads) { return int(std::min<int64_t>((n + threads - 1) / threads, 1 << 20)); }

// One 128x128 block per CTA (grid: column block, row block, group): 16-byte row loads into shared
// memory, 16-byte row stores of the transposed block. The shared rows are 132 bytes apart, so the
// 16 bytes one thread gathers down a column fall in 16 different banks.
constexpr int kTStride = 128 + 4;
__global__ void __launch_bounds__(256) transpose_128x128_kernel(const uint8_t* __restrict__ x, const float* __restrict__ sx,
                                                               uint8_t* __restrict__ y, float* __restrict__ sy,
                                                               int64_t R, int64_t C) {
  __shared__ __align__(16) uint8_t tile[128 * kTStride];
  const int64_t cb = blockIdx.x, rb = blockIdx.y, g = blockIdx.z;
  const int64_t RB = R / 128, CB = C / 128;
  const uint8_t* src = x + (g * R + rb * 128) * C + cb * 128;
  for (int i = threadIdx.x; i < 128 * 8; i += 256) {  // row i / 8, 16-byte chunk i % 8
    const int r = i >> 3, k = (i & 7) * 16;
    const uint4 v = *reinterpret_cast<const uint4*>(src + int64_t(r) * C + k);
    uint32_t* t = reinterpret_cast<uint32_t*>(tile + r * kTStride + k);  // 4-byte aligned (kTStride % 4 == 0)
    t[0] = v.x;
    t[1] = v.y;
    t[2] = v.z;
    t[3] = v.w;
  }
  __syncthreads();
  uint8_t* dst = y + (g * C + cb * 128) * R + rb * 128;
  for (int i = threadIdx.x; i < 128 * 8; i += 256) {  // output row j = i / 8 (input column), 16 rows from r0
    const int j = i >> 3, r0 = (i & 7) * 16;
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t v = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) v |= uint32_t(tile[(r0 + q * 4 + b) * kTStride + j]) << (8 * b);
      w[q] = v;
    }
    *reinterpret_cast<uint4*>(dst + int64_t(j) * R + r0) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (threadIdx.x == 0) sy[(g * CB + cb) * RB + rb] = sx[(g * RB + rb) * CB + cb];
}

}  // namespace

void quantize_1x128_cuda(const TensorView& x, const QuantizedView& out, ScaleMode mode, cudaStream_t stream,
                         bool check_finite) {
  check_tensor(x, "x", {DType::f32, DType::bf16}, 2);
  check_quantized(out, "out", ScaleKind::tile_1x128);
  check_shape(out.values, "out.values", {x.size(0), x.size(1)});
  check_device(x, "x");
  check_device(out.values, "out.values");
  check_device(out.scales, "out.scales");
  check_out_dtype(out, "out");
  const int64_t R = x.size(0), C = x.size(1), ld = out.scales.size(1);
  if (R == 0 || C == 0) return;
  const float mf = float(max_finite(out.values.dtype));
  const bool pow2 = mode == ScaleMode::pow2, e5m2 = out.values.dtype == DType::e5m2;
  const int vec = x.dtype == DType::bf16 ? 8 : 4;
  // Vector path: 16-byte input rows, and output rows aligned for the 8/16-byte stores.
  const bool vec_ok = C % (2 * vec) == 0 && aligned16(x.data) && aligned16(out.values.data);
  const int64_t threads_total = R * ((C + 127) / 128) * (128 / (2 * vec));
  const int grid = int((threads_total + 255) / 256);
  FP8MOE_CHECK(threads_total / 256 < (int64_t(1) << 31), "quantize_1x128: tensor too large");
  reset_flag(stream, check_finite);
  auto go = [&](auto tin, auto e5, auto vk) {
    using Tin = decltype(tin);
    quantize_1x128_kernel<Tin, decltype(e5)::value, decltype(vk)::value><<<grid, 256, 0, stream>>>(
        static_cast<const Tin*>(x.data), out.values.ptr<uint8_t>(), out.scales.ptr<float>(), R, C, ld, mf, pow2,
        check_finite);
  };
  using T_ = std::true_type;
  using F_ = std::false_type;
  if (x.dtype == DType::bf16) {
    if (e5m2) vec_ok ? go(__nv_bfloat16{}, T_{}, T_{}) : go(__nv_bfloat16{}, T_{}, F_{});
    else vec_ok ? go(__nv_bfloat16{}, F_{}, T_{}) : go(__nv_bfloat16{}, F_{}, F_{});
  } else {
    if (e5m2) vec_ok ? go(float{}, T_{}, T_{}) : go(float{}, T_{}, F_{});
    else vec_ok ? go(float{}, F_{}, T_{}) : go(float{}, F_{}, F_{});
  }
  FP8MOE_CUDA_CHECK_LAUNCH("quantize_1x128_kernel");
  fill_padding(out.scales, R, stream);
  raise_if_flagged(stream, check_finite, "x");
}

void quantize_128x128_cuda(const TensorView& w, const QuantizedView& out, ScaleMode mode, cudaStream_t stream,
                           bool check_finite) {
  check_tensor(w, "w", {DType::f32, DType::bf16}, 2);
  check_quantized(out, "out", ScaleKind::block_128x128);
  check_shape(out.values, "out.values", {w.size(0), w.size(1)});
  check_device(w, "w");
  check_device(out.values, "out.values");
  check_device(out.scales, "out.scales");
  check_out_dtype(out, "out");
  const int64_t R = w.size(0), C = w.size(1);
  if (R == 0 || C == 0) return;
  FP8MOE_CHECK((R + 127) / 128 < 65536, "quantize_128x128: too many row blocks (" << R << " rows)");
  const float mf = float(max_finite(out.values.dtype));
  const bool pow2 = mode == ScaleMode::pow2, e5m2 = out.values.dtype == DType::e5m2;
  const int vec = w.dtype == DType::bf16 ? 8 : 4;
  const bool vec_ok = C % vec == 0 && aligned16(w.data) && aligned16(out.values.data) && (C * int64_t(dtype_size(w.dtype))) % 16 == 0;
  const dim3 grid(unsigned((C + 127) / 128), unsigned((R + 127) / 128));
  reset_flag(stream, check_finite);
  auto go = [&](auto tin, auto e5, auto vk) {
    using Tin = decltype(tin);
    quantize_128x128_kernel<Tin, decltype(e5)::value, decltype(vk)::value><<<grid, 256, 0, stream>>>(
        static_cast<const Tin*>(w.data), out.values.ptr<uint8_t>(), out.scales.ptr<float>(), R, C, mf, pow2,
        check_finite);
  };
  using T_ = std::true_type;
  using F_ = std::false_type;
  if (w.dtype == DType::bf16) {
    if (e5m2) vec_ok ? go(__nv_bfloat16{}, T_{}, T_{}) : go(__nv_bfloat16{}, T_{}, F_{});
    else vec_ok ? go(__nv_bfloat16{}, F_{}, T_{}) : go(__nv_bfloat16{}, F_{}, F_{});
  } else {
    if (e5m2) vec_ok ? go(float{}, T_{}, T_{}) : go(float{}, T_{}, F_{});
    else vec_ok ? go(float{}, F_{}, T_{}) : go(float{}, F_{}, F_{});
  }
  FP8MOE_CUDA_CHECK_LAUNCH("quantize_128x128_kernel");
  raise_if_flagged(stream, check_finite, "w");
}

namespace {

// Shared launcher of the transposing kernels: input x [T, C] (values, or FP8 values + scales).
template <class Tin, bool kInE5M2>
void launch_128x1(const Tin* x, const float* s_in, int64_t ld_in, bool in_vec_ok, const QuantizedView& out,
                  int64_t T, int64_t C, ScaleMode mode, cudaStream_t stream, bool check) {
  const float mf = float(max_finite(out.values.dtype));
  const bool pow2 = mode == ScaleMode::pow2, e5m2 = out.values.dtype == DType::e5m2;
  const bool out_vec_ok = T % 16 == 0 && aligned16(out.values.data);
  FP8MOE_CHECK((T + kTT - 1) / kTT < 65536, "quantize_128x1: too many token blocks (" << T << " tokens)");
  const dim3 grid(unsigned((C + kTC - 1) / kTC), unsigned((T + kTT - 1) / kTT));
  const int64_t ld = out.scales.size(1);
  auto go = [&](auto e5, auto vi, auto vo) {
    quantize_128x1_kernel<Tin, kInE5M2, decltype(e5)::value, decltype(vi)::value, decltype(vo)::value>
        <<<grid, 256, 0, stream>>>(x, s_in, ld_in, out.values.ptr<uint8_t>(), out.scales.ptr<float>(), T, C, ld, mf,
                                   pow2, check);
  };
  using T_ = std::true_type;
  using F_ = std::false_type;
  auto go2 = [&](auto e5) {
    if (in_vec_ok) out_vec_ok ? go(e5, T_{}, T_{}) : go(e5, T_{}, F_{});
    else out_vec_ok ? go(e5, F_{}, T_{}) : go(e5, F_{}, F_{});
  };
  e5m2 ? go2(T_{}) : go2(F_{});
  FP8MOE_CUDA_CHECK_LAUNCH("quantize_128x1_kernel");
  fill_padding(out.scales, C, stream);
}

}  // namespace

void quantize_128x1_cuda(const TensorView& x, const QuantizedView& out, ScaleMode mode, cudaStream_t stream,
                         bool check_finite) {
  check_tensor(x, "x", {DType::f32, DType::bf16}, 2);
  check_quantized(out, "out", ScaleKind::tile_1x128);
  check_shape(out.values, "out.values", {x.size(1), x.size(0)});
  check_device(x, "x");
  check_device(out.values, "out.values");
  check_device(out.scales, "out.scales");
  check_out_dtype(out, "out");
  const int64_t T = x.size(0), C = x.size(1);
  if (T == 0 || C == 0) return;
  const bool in_vec_ok = aligned16(x.data) && (C * int64_t(dtype_size(x.dtype))) % 16 == 0;
  reset_flag(stream, check_finite);
  if (x.dtype == DType::bf16)
    launch_128x1<__nv_bfloat16, false>(x.ptr<const __nv_bfloat16>(), nullptr, 0, in_vec_ok, out, T, C, mode, stream,
                                       check_finite);
  else
    launch_128x1<float, false>(x.ptr<const float>(), nullptr, 0, in_vec_ok, out, T, C, mode, stream, check_finite);
  raise_if_flagged(stream, check_finite, "x");
}

void requantize_128x1_cuda(const QuantizedView& in, const QuantizedView& out, ScaleMode mode, cudaStream_t stream) {
  check_quantized(in, "in", ScaleKind::tile_1x128);
  check_quantized(out, "out", ScaleKind::tile_1x128);
  check_shape(out.values, "out.values", {in.cols(), in.rows()});
  check_device(in.values, "in.values");
  check_device(in.scales, "in.scales");
  check_device(out.values, "out.values");
  check_device(out.scales, "out.scales");
  check_out_dtype(out, "out");
  FP8MOE_CHECK(in.values.dtype == DType::e4m3 || in.values.dtype == DType::e5m2,
               "in: the CUDA requantizer reads e4m3 or e5m2, got " << dtype_name(in.values.dtype));
  const int64_t T = in.rows(), C = in.cols();
  if (T == 0 || C == 0) return;
  const bool in_vec_ok = aligned16(in.values.data) && C % 16 == 0;
  const auto* x = in.values.ptr<const uint8_t>();
  const auto* s = in.scales.ptr<const float>();
  const int64_t ld_in = in.scales.size(1);
  // NOTES: the input is FP8 times finite scales, so it is always finite: no NaN check needed.
  if (in.values.dtype == DType::e5m2)
    launch_128x1<uint8_t, true>(x, s, ld_in, in_vec_ok, out, T, C, mode, stream, false);
  else
    launch_128x1<uint8_t, false>(x, s, ld_in, in_vec_ok, out, T, C, mode, stream, false);
}

void transpose_128x128_cuda(const QuantizedView& in, const QuantizedView& out, int64_t groups, cudaStream_t stream) {
  check_transpose_128x128(in, out, groups, "transpose_128x128");
  check_device(in.values, "in.values");
  check_device(in.scales, "in.scales");
  check_device(out.values, "out.values");
  check_device(out.scales, "out.scales");
  const int64_t R = in.rows() / groups, C = in.cols();
  if (R == 0 || C == 0) return;
  FP8MOE_CHECK(aligned16(in.values.data) && aligned16(out.values.data),
               "transpose_128x128: in and out values must be 16-byte aligned");
  FP8MOE_CHECK(C / 128 <= INT32_MAX && R / 128 <= 65535 && groups <= 65535,
               "transpose_128x128: " << in.values.str() << " in " << groups << " groups is too large for one launch");
  const dim3 grid(unsigned(C / 128), unsigned(R / 128), unsigned(groups));
  transpose_128x128_kernel<<<grid, 256, 0, stream>>>(in.values.ptr<const uint8_t>(), in.scales.ptr<const float>(),
                                                     out.values.ptr<uint8_t>(), out.scales.ptr<float>(), R, C);
  FP8MOE_CUDA_CHECK_LAUNCH("transpose_128x128_kernel");
}

void dequantize_cuda(const QuantizedView& in, const TensorView& out, cudaStream_t stream) {
  check_quantized(in, "in", in.kind);
  check_tensor(out, "out", {DType::f32, DType::bf16}, 2);
  check_shape(out, "out", {in.rows(), in.cols()});
  check_device(in.values, "in.values");
  check_device(in.scales, "in.scales");
  check_device(out, "out");
  FP8MOE_CHECK(in.values.dtype == DType::e4m3 || in.values.dtype == DType::e5m2,
               "in: the CUDA dequantizer reads e4m3 or e5m2, got " << dtype_name(in.values.dtype));
  const int64_t R = in.rows(), C = in.cols();
  if (R == 0 || C == 0) return;
  const bool blk = in.kind == ScaleKind::block_128x128, e5m2 = in.values.dtype == DType::e5m2;
  const int grid = grid_1d(R * C, 256);
  const auto* q = in.values.ptr<const uint8_t>();
  const auto* s = in.scales.ptr<const float>();
  const int64_t ld_s = in.scales.size(1);
  if (out.dtype == DType::f32) {
    if (e5m2) dequantize_kernel<true, float><<<grid, 256, 0, stream>>>(q, s, ld_s, blk, out.ptr<float>(), R, C);
    else dequantize_kernel<false, float><<<grid, 256, 0, stream>>>(q, s, ld_s, blk, out.ptr<float>(), R, C);
  } else {
    auto* o = out.ptr<__nv_bfloat16>();
    if (e5m2) dequantize_kernel<true, __nv_bfloat16><<<grid, 256, 0, stream>>>(q, s, ld_s, blk, o, R, C);
    else dequantize_kernel<false, __nv_bfloat16><<<grid, 256, 0, stream>>>(q, s, ld_s, blk, o, R, C);
  }
  FP8MOE_CUDA_CHECK_LAUNCH("dequantize_kernel");
}

}  // namespace fp8moe::cuda
