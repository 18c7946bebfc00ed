// Device arithmetic of the quantizers (quantize.hpp), shared by every kernel that writes FP8 tiles
// (quantize.cu, the fused MoE permutation in moe_dispatch.cu) so that all of them round exactly as
// the CPU reference: s = amax / max_finite (IEEE division) or the smallest power of two >= that,
// s = 1 for an all-zero tile, s >= FLT_MIN; r = 1 / s (IEEE, once per tile); q = encode(x * r)
// (one IEEE product per element), saturating round-to-nearest-even.
//
// NOTES: the per-element work is what bounds these kernels (an IEEE division per element cost more
// instruction issue than the memory system leaves per byte), hence the reciprocal once per tile,
// paired conversions (encode2/encode4) and a NaN-propagating amax (amax_nan), which lets a kernel
// test its tile's amax once instead of every element for NaN/Inf.
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

// The reciprocal scale, 1 / s rounded to nearest (the CPU's 1.0f / s). s in [FLT_MIN, FLT_MAX / 448]
// keeps it a finite normal number; for power-of-two s it is exact.
__device__ __forceinline__ float inv_scale(float s) { return __frcp_rn(s); }

// max(a, |v|), NaN if either is NaN (max.NaN): a tile's amax is NaN or Inf exactly when the tile
// holds a NaN or an Inf.
__device__ __forceinline__ float amax_nan(float a, float v) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(fabsf(v)));
  return m;
}

// amax over the lanes lane ^ o for o < kLanes (kLanes a power of two, lanes aligned to it), NaN
// propagating as amax_nan. Every lane of the warp must take part.
template <int kLanes>
__device__ __forceinline__ float lanes_amax(float a) {
#pragma unroll
  for (int o = 1; o < kLanes; o *= 2) a = amax_nan(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

__device__ __forceinline__ bool is_finite_amax(float amax) { return amax <= FLT_MAX; }

template <bool kE5M2>
__device__ __forceinline__ uint8_t encode(float v) {
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3));
}

// encode(lo) | encode(hi) << 8 with one paired conversion (the same rounding per element).
template <bool kE5M2>
__device__ __forceinline__ uint16_t encode2(float lo, float hi) {
  return uint16_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3));
}

// The four bytes encode(v[i] * r), little-endian (v[0] in the low byte).
template <bool kE5M2>
__device__ __forceinline__ uint32_t quantize4(const float* v, float r) {
  const uint32_t lo = encode2<kE5M2>(__fmul_rn(v[0], r), __fmul_rn(v[1], r));
  const uint32_t hi = encode2<kE5M2>(__fmul_rn(v[2], r), __fmul_rn(v[3], r));
  return lo | (hi << 16);
}

// A lane's four consecutive columns c0..c0+3 of a row of C f32 values (the fused model-op
// quantizers: one lane per four columns of a 128-column tile): how many lie inside the row, their
// values (0 past the row; one 16-byte load when kVec and all four are inside) and the store of
// their four codes (one 4-byte store when kVec and all four are inside).
__device__ __forceinline__ int cols4(int64_t C, int64_t c0) { return int(C - c0 < 0 ? 0 : C - c0 < 4 ? C - c0 : 4); }
template <bool kVec>
__device__ __forceinline__ void load_cols4(const float* __restrict__ p, int n, float (&v)[4]) {
  if (kVec && n == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    return;
  }
  for (int k = 0; k < 4; ++k) v[k] = k < n ? p[k] : 0.0f;
}
template <bool kVec>
__device__ __forceinline__ void store_codes4(uint8_t* __restrict__ q, int n, uint32_t code) {
  if (kVec && n == 4) *reinterpret_cast<uint32_t*>(q) = code;
  else for (int k = 0; k < n; ++k) q[k] = uint8_t(code >> (8 * k));
}

template <bool kE5M2>
__device__ __forceinline__ float decode(uint8_t q) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(q), kE5M2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

// Word n (0..3, a constant after unrolling) of a 16-byte vector.
__device__ __forceinline__ uint32_t word16(const uint4& raw, int n) {
  return n == 0 ? raw.x : n == 1 ? raw.y : n == 2 ? raw.z : raw.w;
}

// Values 2i and 2i + 1 of a 16-byte vector of f32 or bf16 values (bf16 -> f32 is a shift: exact).
template <class T>
__device__ __forceinline__ float2 pair16(const uint4& raw, int i) {
  if constexpr (sizeof(T) == 4) {
    return make_float2(__uint_as_float(word16(raw, 2 * i)), __uint_as_float(word16(raw, 2 * i + 1)));
  } else {
    const uint32_t w = word16(raw, i);
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  }
}

// The two FP8 values of a 16-bit pair (v[0] in the low byte), decoded with one paired conversion
// (FP8 -> f16 -> f32: exact).
template <bool kE5M2>
__device__ __forceinline__ float2 decode2(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair & 0xFFFFu), kE5M2 ? __NV_E5M2 : __NV_E4M3);
  return __half22float2(__half2(h));
}

// Values 2i and 2i + 1 of a 16-byte vector of FP8 values, decoded as a pair.
template <bool kE5M2>
__device__ __forceinline__ float2 pair16_fp8(const uint4& raw, int i) {
  return decode2<kE5M2>(word16(raw, i / 2) >> (16 * (i % 2)));
}

// The bytes encode(f(value) * r) of the 16 / sizeof(Tin) values of one 16-byte vector of f32 or
// bf16 values, as little-endian words (one or two).
template <class Tin, bool kE5M2, class F>
__device__ __forceinline__ void quantize_vec16(const uint4& raw, F f, float r, uint32_t (&w)[4 / sizeof(Tin)]) {
#pragma unroll
  for (int i = 0; i < int(4 / sizeof(Tin)); ++i) {
    const float2 a = f(pair16<Tin>(raw, 2 * i)), b = f(pair16<Tin>(raw, 2 * i + 1));
    const float v[4] = {a.x, a.y, b.x, b.y};
    w[i] = quantize4<kE5M2>(v, r);
  }
}

// One or two words to dst as one store (dst aligned to their size).
template <int N>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[N]) {
  static_assert(N == 1 || N == 2);
  if constexpr (N == 2) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else *reinterpret_cast<uint32_t*>(dst) = w[0];
}

// One halving step of rows_amax (o rows traded), then the next: a template, so that every step's
// loop unrolls (as a loop nest, nvcc left steps rolled: the one-pass 128x1 kernel took 22-36% more
// registers and ran 7-14% longer, and a kernel holding more values spilled v to local memory).
template <int o, int kRows>
__device__ __forceinline__ void rows_amax_step(float (&v)[kRows]) {
  const bool hi = threadIdx.x & o;  // of the 2o rows held, keep [o, 2o) (hi) or [0, o) in v[0, o)
#pragma unroll
  for (int i = 0; i < o; ++i) {
    const float give = hi ? v[i] : v[i + o], keep = hi ? v[i + o] : v[i];
    v[i] = amax_nan(keep, __shfl_xor_sync(0xffffffffu, give, o));
  }
  if constexpr (o > 1) rows_amax_step<o / 2, kRows>(v);
}

// Row amaxes of a group of kLanes lanes (aligned, a power of two) that each hold partial amaxes
// v[k] (>= 0 or NaN) of the same kRows rows (a power of two <= kLanes): lane l gets the group's
// amax of row l % kRows, NaN propagating as amax_nan. Recursive halving (each step a lane keeps
// half of the rows it still holds and trades the other half with its partner) takes kRows - 1 +
// log2(kLanes / kRows) shuffles, where kRows separate lanes_amax would take kRows * log2(kLanes).
// v is overwritten. Every lane of the warp must take part.
template <int kRows, int kLanes>
__device__ __forceinline__ float rows_amax(float (&v)[kRows]) {
  static_assert(kRows >= 1 && kRows <= kLanes && kLanes <= 32 && (kRows & (kRows - 1)) == 0 &&
                (kLanes & (kLanes - 1)) == 0);
  if constexpr (kRows > 1) rows_amax_step<kRows / 2, kRows>(v);
  float a = v[0];
#pragma unroll
  for (int o = kRows; o < kLanes; o *= 2) a = amax_nan(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

// ---- 1x128 tiles, four lanes per tile ----
// Lanes 4k..4k+3 of a warp share one tile of 128 values; lane t holds the 16-byte input vectors
// h * 4 + t (h < NV) of it, so each warp-wide load covers 64 contiguous input bytes of each tile it
// touches (and each store 32 or 16 contiguous output bytes): whole sectors, and NV independent
// 16-byte loads in flight per lane before any use. The values stay in registers in the input
// encoding (16 registers) and are converted where used; a tile's amax takes two shuffles.
template <class Tin>
struct Tile1x128 {
  static constexpr int VEC = 16 / sizeof(Tin);  // values per 16-byte vector: 8 (bf16), 4 (f32)
  static constexpr int NV = 128 / (4 * VEC);    // vectors per lane: 4, 8
};

// Lane t's vectors of the tile src[0, 128), columns >= limit (<= 128) read as 0 (limit 0: nothing
// read). kVec: src 16-byte aligned and limit a multiple of VEC.
template <class Tin, bool kVec>
__device__ __forceinline__ void load_tile_1x128(const Tin* __restrict__ src, int limit, int t,
                                                uint4 (&raw)[Tile1x128<Tin>::NV]) {
  using L = Tile1x128<Tin>;
#pragma unroll
  for (int h = 0; h < L::NV; ++h) {
    const int c = (h * 4 + t) * L::VEC;
    raw[h] = make_uint4(0, 0, 0, 0);
    if constexpr (kVec) {
      if (c < limit) raw[h] = *reinterpret_cast<const uint4*>(src + c);
    } else {
      Tin* e = reinterpret_cast<Tin*>(&raw[h]);
#pragma unroll
      for (int i = 0; i < L::VEC; ++i)
        if (c + i < limit) e[i] = src[c + i];
    }
  }
}

// NaN-propagating amax of lane t's values f(pair16(raw[h], i)) over its tile's four lanes.
template <class Tin, class F>
__device__ __forceinline__ float tile_amax_1x128(const uint4 (&raw)[Tile1x128<Tin>::NV], F f) {
  using L = Tile1x128<Tin>;
  float amax = 0.0f;
#pragma unroll
  for (int h = 0; h < L::NV; ++h)
#pragma unroll
    for (int i = 0; i < L::VEC / 2; ++i) {
      const float2 p = f(pair16<Tin>(raw[h], i));
      amax = amax_nan(amax_nan(amax, p.x), p.y);
    }
  return lanes_amax<4>(amax);
}

// Stores encode(f(value) * r) of lane t's values to the tile dst[0, 128), columns < limit. kVec:
// dst aligned to VEC bytes and limit a multiple of VEC.
template <class Tin, bool kE5M2, bool kVec, class F>
__device__ __forceinline__ void store_tile_1x128(uint8_t* __restrict__ dst, int limit, int t,
                                                 const uint4 (&raw)[Tile1x128<Tin>::NV], F f, float r) {
  using L = Tile1x128<Tin>;
#pragma unroll
  for (int h = 0; h < L::NV; ++h) {
    const int c = (h * 4 + t) * L::VEC;
    uint32_t w[L::VEC / 4];
    quantize_vec16<Tin, kE5M2>(raw[h], f, r, w);
    if constexpr (kVec) {
      if (c >= limit) continue;
      store_words(dst + c, w);
    } else {
#pragma unroll
      for (int i = 0; i < L::VEC; ++i)
        if (c + i < limit) dst[c + i] = uint8_t(w[i / 4] >> (8 * (i % 4)));
    }
  }
}

// The identity transform of tile_amax_1x128 / store_tile_1x128.
struct AsIs {
  __device__ float2 operator()(float2 p) const { return p; }
};

// Tile of a 256-thread CTA (8 warps) over a [rows, G] grid of 1x128 tiles: warp w takes tile
// column g = bx * wg + w % wg and rows ry * 8 + lane / 4 with ry = by * (8 / wg) + w / wg, where
// block b = by * gx + bx. wg (1, 2, 4 or 8 warps along a row) is the host's choice (tiles_wg): the
// 8 rows of a warp make its scale writes 32 contiguous bytes, the wg warps along a row keep a CTA's
// loads in wg * 128-column row pieces.
struct TileCoords {
  int64_t g, r;
  int t;  // lane within the tile's four
};
__device__ __forceinline__ TileCoords tile_coords_1x128(int wg, int64_t gx) {
  const int64_t b = blockIdx.x, by = b / gx, bx = b - by * gx;
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  return {bx * wg + w % wg, (by * (8 / wg) + w / wg) * 8 + lane / 4, lane % 4};
}

// Host side of tile_coords_1x128: warps along a row for G tile columns, and the 1-D grid size.
inline int tiles_wg(int64_t G) { return G >= 8 ? 8 : G >= 4 ? 4 : G >= 2 ? 2 : 1; }
inline int64_t tiles_gx(int64_t G) { return (G + tiles_wg(G) - 1) / tiles_wg(G); }
inline int64_t tiles_blocks(int64_t rows, int64_t G) {
  const int64_t rows_per_block = 64 / tiles_wg(G);
  return tiles_gx(G) * ((rows + rows_per_block - 1) / rows_per_block);
}

}  // namespace fp8moe::cuda
