// Quantization kernels of the CUDA backend, bit-exact with the CPU quantizers (quantize.hpp):
// s = amax / max_finite (IEEE division) or the smallest power of two >= that, s = 1 for an
// all-zero tile, s >= FLT_MIN, r = 1 / s once per tile (__frcp_rn), q = encode(x * r) with one
// __fmul_rn per element and saturating RNE conversion (the arithmetic itself: quantize_device.cuh).
// NaN/Inf inputs are detected on each tile's NaN-propagating amax.
//
//   quantize_1x128    x [R, C] f32|bf16 -> q [R, C], s [ceil(C/128), ld(R)]  (one pass, 4 lanes per tile)
//   quantize_128x128  w [R, C]          -> q [R, C], s [ceil(R/128), ceil(C/128)]
//   quantize_128x1    x [T, C]          -> q [C, T], s [ceil(T/128), ld(C)]  (128x128 tiles through smem)
//   quantize_1x128_and_128x1 x [T, C]  -> the outputs of quantize_1x128 and quantize_128x1 from one read
//                                         of x (the 128x1 kernel's tiles also write the rows)
//   requantize_128x1  q [T, C] 1x128    -> q [C, T] 1x128 along T            (dequantize, transpose, requantize;
//                                                                               persistent CTAs, TMA in and out)
//   transpose_128x128 q [G*R, C] 128x128 -> q [G*C, R] 128x128, per group     (bytes and block scales moved)
//   dequantize        q [R, C] any kind -> [R, C] f32|bf16
// Output dtypes: e4m3, e5m2 (e5m6 has no device conversion here and is refused).
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_checks.hpp"
#include "fp8moe/codecs.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/gemm/kernels/ptx.cuh"
#include "cuda/quant/quantize_device.cuh"
#include "cuda/gemm/tensor_map.hpp"

#include <algorithm>
#include <mutex>

namespace fp8moe::cuda {

namespace {

__device__ int g_nonfinite;  // set when a quantizer input holds NaN/Inf

__device__ __forceinline__ void flag_nonfinite() { atomicExch(&g_nonfinite, 1); }

// Sets the padding scale entries [g, R..ld) of a 1x128 scale tensor [G, ld] to 1.
__global__ void fill_scale_padding_kernel(float* scales, int64_t G, int64_t R, int64_t ld) {
  const int64_t pad = ld - R;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < G * pad; i += int64_t(gridDim.x) * blockDim.x)
    scales[(i / pad) * ld + R + i % pad] = 1.0f;
}

// ---- 1x128 ----
// Tiles as tile_coords_1x128 (quantize_device.cuh): a warp takes one 128-column tile of 8 rows,
// four lanes per row-tile, each lane 32 values from NV independent 16-byte loads.
// x [R, C], q [R, C], s [G, ld] (G = ceil(C/128)).
// NOTES: per element one unpack, one amax, one product and half a paired conversion (an IEEE
// division and a NaN test per element would take most of the issue slots and hold the kernel at
// ~70% of copy); 64 bytes of loads in flight per lane; a warp's 8 scale writes fill one sector.
// So the kernel is bound by memory: 93% of copy from bf16.
template <class Tin, bool kE5M2, bool kVec>
__global__ void __launch_bounds__(256, 5) quantize_1x128_kernel(const Tin* __restrict__ x, uint8_t* __restrict__ q,
                                                             float* __restrict__ s, int64_t R, int64_t C, int64_t ld,
                                                             int wg, int64_t gx, float max_finite, bool pow2,
                                                             bool check) {
  const TileCoords tc = tile_coords_1x128(wg, gx);
  const int64_t G = (C + 127) / 128;
  if (tc.g >= G) return;  // whole warps
  const bool row_ok = tc.r < R;
  const int limit = row_ok ? int(C - tc.g * 128 < 128 ? C - tc.g * 128 : 128) : 0;
  const int64_t base = (row_ok ? tc.r : 0) * C + tc.g * 128;
  uint4 raw[Tile1x128<Tin>::NV];
  load_tile_1x128<Tin, kVec>(x + base, limit, tc.t, raw);
  const float amax = tile_amax_1x128<Tin>(raw, AsIs{});
  if (!row_ok) return;
  if (tc.t == 0) {
    if (check && !is_finite_amax(amax)) flag_nonfinite();
  }
  const float sc = scale_of(amax, max_finite, pow2);
  if (tc.t == 0) s[tc.g * ld + tc.r] = sc;
  store_tile_1x128<Tin, kE5M2, kVec>(q + base, limit, tc.t, raw, AsIs{}, inv_scale(sc));
}

// ---- 128x128 ----
// One CTA of 256 threads per 128x128 block; each thread keeps its 64 values in registers in their
// input encoding (32 registers, not 64, leaving room for more resident CTAs and loads in flight).
// w [R, C], q [R, C], s [ceil(R/128), ceil(C/128)].
// NOTES: the arithmetic is that of the 1x128 kernel (reciprocal once per block, one product and
// half a paired conversion per element, NaN/Inf tested on the block's amax), which leaves this
// kernel bound by its loads (95% of copy).
template <class Tin, bool kE5M2, bool kVec>
__global__ void __launch_bounds__(256, sizeof(Tin) == 2 ? 3 : 2) quantize_128x128_kernel(const Tin* __restrict__ w, uint8_t* __restrict__ q,
                                                               float* __restrict__ s, int64_t R, int64_t C,
                                                               float max_finite, bool pow2, bool check) {
  constexpr int VEC = 16 / sizeof(Tin);
  constexpr int CHUNKS = 128 / VEC;         // vectors per block row
  constexpr int ROWS_PER_PASS = 256 / CHUNKS;
  constexpr int PASSES = 128 / ROWS_PER_PASS;
  const int64_t r0 = int64_t(blockIdx.y) * 128, c0 = int64_t(blockIdx.x) * 128;
  const int cc = threadIdx.x % CHUNKS, rr = threadIdx.x / CHUNKS;
  const int64_t c = c0 + cc * VEC;

  uint4 raw[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int64_t r = r0 + rr + p * ROWS_PER_PASS;
    raw[p] = make_uint4(0, 0, 0, 0);
    Tin* e = reinterpret_cast<Tin*>(&raw[p]);
    if (kVec && r < R && c < C) {
      raw[p] = *reinterpret_cast<const uint4*>(w + r * C + c);
    } else if (!kVec) {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (r < R && c + i < C) e[i] = w[r * C + c + i];
    }
  }
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < PASSES; ++p)
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
      const float2 v = pair16<Tin>(raw[p], i);
      amax = amax_nan(amax_nan(amax, v.x), v.y);
    }
  __shared__ float red[8];
  amax = lanes_amax<32>(amax);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = red[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) amax = amax_nan(amax, red[i]);
  const float sc = scale_of(amax, max_finite, pow2);
  if (threadIdx.x == 0) {
    s[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = sc;
    if (check && !is_finite_amax(amax)) flag_nonfinite();
  }
  const float inv = inv_scale(sc);

#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int64_t r = r0 + rr + p * ROWS_PER_PASS;
    uint32_t out[VEC / 4];
    quantize_vec16<Tin, kE5M2>(raw[p], AsIs{}, inv, out);
    if (kVec && r < R && c < C) {
      store_words(q + r * C + c, out);
    } else if (!kVec && r < R) {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (c + i < C) q[r * C + c + i] = uint8_t(out[i / 4] >> (8 * (i % 4)));
    }
  }
}

// ---- 128x1 (transposing) ----
// One CTA of 256 threads per 128 tokens x 128 channels of x [T, C] (one output scale group per
// channel); out q [C, T] rows of 128 bytes, s [ceil(T/128), ld(C)].
// Input either a plain tensor (Tin = f32|bf16) or, for requantize's fallback (values not 16-byte
// aligned or C % 16 != 0; the vector path is requantize_128x1_kernel below), FP8 values [T, C] with
// 1x128 scales s_in [ceil(C/128), ld(T)] (Tin = uint8_t; value = decode(q) * s_in, the FP32
// product of the CPU dequantizer).
//   1. each thread loads TPT token rows x VEC channels as 16-byte vectors (kept in registers in the
//      input encoding): each warp-wide load covers whole 128..512-byte row pieces;
//   2. per-channel amax: over the thread's tokens, the warp's lanes of the same channels (shuffles),
//      the 8 warps (shared memory); 128 threads compute the scales and reciprocals;
//   3. each thread encodes its TPT tokens of each of its channels into one TPT-byte unit and writes
//      it to the transposed byte tile [128 channels][128 tokens] in shared memory;
//   4. the tile is written out as 128-byte rows of q with 16-byte stores.
// With kRows (quantize_1x128_and_128x1; f32|bf16 input, vector path) the same tile also yields the
// row-major 1x128 output of its 128 tokens (RowsOut): in phase 2 each thread's amax of each of its
// tokens over its VEC channels, reduced over the CHUNKS lanes holding the token block (rows_amax),
// gives the token's scale and reciprocal (shared memory, like the channels'); in phase 3 each
// thread encodes its VEC channels of each of its tokens and stores them, VEC bytes, straight to
// q_rows [T, C] (a token block's CHUNKS lanes write 128 contiguous bytes). NaN/Inf needs no test
// of the token amaxes: every element is in a channel amax, which is tested. Per element this adds
// an amax, a product and half a paired conversion to the 128x1 work, and the reads stay one: the
// kernel takes about the 128x1 kernel's time plus the rows' bytes (90-98% of copy, 1.5x and 1.7x
// faster than the two separate kernels), with 71 registers (bf16: three CTAs per SM) and 97
// (f32: two). rows_amax's halving steps must all unroll: as a loop nest nvcc leaves the 16-row
// step rolled, and the kernel then holds 93-111 registers and loses 5-12 points of copy bandwidth.
// NOTES: the byte tile is XOR-swizzled by units (unit u of channel row c at u ^ swz(c)) so that the
// unit writes of phase 3 (8, 16 or 4 bytes per lane) and the 16-byte row reads of phase 4 are both
// free of bank conflicts; bf16 swizzles at 8-byte granularity, so a 16-byte read may find its two
// halves swapped (undone in registers). Full 128-byte rows out (a 64-channel tile would write
// 32-byte pieces), twice the work per CTA, and the per-element arithmetic of the 1x128 kernel:
// 91% of copy from bf16.
template <class Tin>
struct T128x1 {
  static constexpr int VEC = 16 / sizeof(Tin);  // channels per vector: 8 (bf16), 4 (f32), 16 (fp8)
  static constexpr int CHUNKS = 128 / VEC;      // vectors per token row: 16, 32, 8
  static constexpr int TB = 256 / CHUNKS;       // token blocks: 16, 8, 32
  static constexpr int TPT = 128 / TB;          // tokens per thread = bytes per unit: 8, 16, 4
  static constexpr int NU = 128 / TPT;          // units per channel row: 16, 8, 32
  static constexpr int K = 16 / TPT;            // units per 16 bytes: 2, 1, 4
  static constexpr int SWZ = sizeof(Tin) == 1 ? 4 : 1;
  static constexpr int WPC = TPT / 4;           // 32-bit words per unit: 2, 4, 1
  // Swizzle of channel row c: spreads one warp's phase-3 unit writes over all banks.
  __device__ static int swz(int c) { return ((c / VEC) * SWZ) % NU; }
};

// The kRows output: x's 1x128 quantization, q [T, C] and s [ceil(C/128), ld] (quantize_1x128's).
struct RowsOut {
  uint8_t* q = nullptr;
  float* s = nullptr;
  int64_t ld = 0;
};

template <class Tin, bool kInE5M2, bool kE5M2, bool kVecIn, bool kVecOut, bool kRows>
__global__ void __launch_bounds__(256) quantize_128x1_kernel(const Tin* __restrict__ x, const float* __restrict__ s_in,
                                                             int64_t ld_in, uint8_t* __restrict__ q,
                                                             float* __restrict__ s, int64_t T, int64_t C, int64_t ld,
                                                             RowsOut rows, float max_finite, bool pow2, bool check) {
  using L = T128x1<Tin>;
  constexpr bool kFp8In = sizeof(Tin) == 1;
  static_assert(!kRows || (kVecIn && !kFp8In), "the 1x128 output needs f32|bf16 input on the vector path");
  __shared__ __align__(16) uint8_t tile[128 * 128];  // [channel][token] bytes, swizzled units
  __shared__ __align__(16) float red[8][128];
  __shared__ __align__(16) float inv_s[128];
  __shared__ __align__(16) float inv_rows[kRows ? 128 : 4];  // kRows: 1 / scale of the tile's tokens
  const int64_t t0 = int64_t(blockIdx.y) * 128, c0 = int64_t(blockIdx.x) * 128;
  const int chunk = threadIdx.x % L::CHUNKS, tb = threadIdx.x / L::CHUNKS;
  const int64_t c = c0 + chunk * L::VEC;

  // 1. loads
  uint4 raw[L::TPT];
  float s_tok[kFp8In ? L::TPT : 1];
#pragma unroll
  for (int k = 0; k < L::TPT; ++k) {
    const int64_t t = t0 + tb * L::TPT + k;
    raw[k] = make_uint4(0, 0, 0, 0);
    if (kVecIn) {
      if (t < T && c < C) raw[k] = *reinterpret_cast<const uint4*>(x + t * C + c);
    } else {
      Tin* e = reinterpret_cast<Tin*>(&raw[k]);
#pragma unroll
      for (int j = 0; j < L::VEC; ++j)
        if (t < T && c + j < C) e[j] = x[t * C + c + j];
    }
    if constexpr (kFp8In) s_tok[k] = t < T ? s_in[(c0 / 128) * ld_in + t] : 0.0f;
  }
  // Channels 2i and 2i + 1 of token k (requantize: times the token's scale, the FP32 product).
  auto pair = [&](int k, int i) {
    if constexpr (kFp8In) {
      const float2 p = pair16_fp8<kInE5M2>(raw[k], i);
      return make_float2(__fmul_rn(p.x, s_tok[k]), __fmul_rn(p.y, s_tok[k]));
    } else {
      return pair16<Tin>(raw[k], i);
    }
  };

  // 2. per-channel amax and scales (kRows: per-token too)
  float pa[L::VEC];
  float ta[L::TPT];  // kRows: the thread's amax of each of its tokens
#pragma unroll
  for (int j = 0; j < L::VEC; ++j) pa[j] = 0.0f;
#pragma unroll
  for (int k = 0; k < L::TPT; ++k) ta[k] = 0.0f;
#pragma unroll
  for (int k = 0; k < L::TPT; ++k)
#pragma unroll
    for (int i = 0; i < L::VEC / 2; ++i) {
      const float2 p = pair(k, i);
      pa[2 * i] = amax_nan(pa[2 * i], p.x);
      pa[2 * i + 1] = amax_nan(pa[2 * i + 1], p.y);
      if constexpr (kRows) ta[k] = amax_nan(amax_nan(ta[k], p.x), p.y);
    }
  if constexpr (kRows) {
    // The token block's CHUNKS lanes (aligned in the warp) hold its tokens' 128 channels; lane
    // chunk < TPT ends up with token tb * TPT + chunk.
    const float amax = rows_amax<L::TPT, L::CHUNKS>(ta);
    if (chunk < L::TPT) {
      const int tl = tb * L::TPT + chunk;
      const float sc = scale_of(amax, max_finite, pow2);
      inv_rows[tl] = inv_scale(sc);
      if (t0 + tl < T) rows.s[(c0 / 128) * rows.ld + t0 + tl] = sc;
    }
  }
#pragma unroll
  for (int o = L::CHUNKS; o < 32; o *= 2)
#pragma unroll
    for (int j = 0; j < L::VEC; ++j) pa[j] = amax_nan(pa[j], __shfl_xor_sync(0xffffffffu, pa[j], o));
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 < L::CHUNKS) {
#pragma unroll
    for (int j = 0; j < L::VEC; j += 4)
      *reinterpret_cast<float4*>(&red[warp][chunk * L::VEC + j]) = make_float4(pa[j], pa[j + 1], pa[j + 2], pa[j + 3]);
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    float amax = red[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < 8; ++w) amax = amax_nan(amax, red[w][threadIdx.x]);
    if (check && !is_finite_amax(amax)) flag_nonfinite();
    const float sc = scale_of(amax, max_finite, pow2);
    inv_s[threadIdx.x] = inv_scale(sc);
    if (c0 + threadIdx.x < C) s[int64_t(blockIdx.y) * ld + c0 + threadIdx.x] = sc;
  }
  __syncthreads();

  // 3a. (kRows) each of the thread's tokens: its VEC channels to q_rows [T, C], one store.
  if constexpr (kRows) {
#pragma unroll
    for (int k4 = 0; k4 < L::TPT; k4 += 4) {
      const float4 r4 = *reinterpret_cast<const float4*>(&inv_rows[tb * L::TPT + k4]);
      const float r[4] = {r4.x, r4.y, r4.z, r4.w};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int64_t t = t0 + tb * L::TPT + k4 + kk;
        uint32_t w[L::VEC / 4];
        quantize_vec16<Tin, kE5M2>(raw[k4 + kk], AsIs{}, r[kk], w);
        if (t < T && c < C) store_words(rows.q + t * C + c, w);
      }
    }
  }

  // 3b. encode into the transposed byte tile, two channels at a time: channel 2i + e gets the unit
  // of bytes encode(value(token k) * r), k < TPT, in words[e] (token k in byte k % 4 of word k / 4).
#pragma unroll
  for (int i = 0; i < L::VEC / 2; ++i) {
    const float2 r = *reinterpret_cast<const float2*>(&inv_s[chunk * L::VEC + 2 * i]);
    uint32_t words[2][L::WPC];
#pragma unroll
    for (int k = 0; k < L::TPT; k += 2) {
      const float2 p0 = pair(k, i), p1 = pair(k + 1, i);
      const uint32_t e0 = encode2<kE5M2>(__fmul_rn(p0.x, r.x), __fmul_rn(p1.x, r.x));
      const uint32_t e1 = encode2<kE5M2>(__fmul_rn(p0.y, r.y), __fmul_rn(p1.y, r.y));
      if (k % 4 == 0) {
        words[0][k / 4] = e0;
        words[1][k / 4] = e1;
      } else {
        words[0][k / 4] |= e0 << 16;
        words[1][k / 4] |= e1 << 16;
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int cl = chunk * L::VEC + 2 * i + e;
      uint8_t* dst = tile + cl * 128 + (tb ^ L::swz(cl)) * L::TPT;
      const uint32_t* w = words[e];
      if constexpr (L::WPC == 1) *reinterpret_cast<uint32_t*>(dst) = w[0];
      else if constexpr (L::WPC == 2) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
      else *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  __syncthreads();

  // 4. 128-byte rows of q [C, T]
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int i = threadIdx.x + 256 * m;
    const int cl = i / 8, k16 = i % 8;
    const int64_t cc = c0 + cl, t = t0 + k16 * 16;
    if (cc >= C || t >= T) continue;
    const int x_swz = L::swz(cl);
    uint4 v = *reinterpret_cast<const uint4*>(tile + cl * 128 + (k16 ^ (x_swz / L::K)) * 16);
    if constexpr (L::K == 2) {
      if (x_swz % 2) v = make_uint4(v.z, v.w, v.x, v.y);
    }
    uint8_t* dst = q + cc * T + t;
    if (kVecOut) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int b = 0; b < 16; ++b)
        if (t + b < T) dst[b] = uint8_t(w[b / 4] >> (8 * (b % 4)));
    }
  }
}

// ---- requantize 128x1 (FP8 input; TMA path) ----
// Persistent CTAs (two per SM, eight warps) walk the 128-token x 128-channel tiles of x [T, C]
// (tile id = token block * CB + channel block, CTA b taking b, b + grid, ...). Thread 0 loads each
// tile's 16 KiB of bytes and its 128 token scales by TMA into a ring of kRqStages stages,
// kRqStages - 2 tiles ahead (out-of-bounds tokens and channels zero-filled); per tile the warps
//   1. decode their bytes (warp w: tokens 16w..16w+15; lane l: one 32-bit word per token, the
//      channels 4l..4l+3) times the token's scale, keep the 64 FP32 products in registers with the
//      per-channel amax over the warp's 16 tokens;
//   2. meet in shared memory for the channels' amax; 128 threads compute scales and reciprocals;
//   3. encode each of their 4 channels' 16 tokens into one 16-byte unit of a transposed byte tile
//      [128 channels][128 tokens] in the TMA's 128-byte swizzle (unit u of row c at u ^ (c % 8)),
//      written in place over the tile's own input bytes, which every warp has read by step 2;
//   4. thread 0 stores the tile to q [C, T] by TMA (clipped at T and C) from the stage, while the
//      next tiles are decoded.
// A stage is reloaded at the start of the tile two after the one that used it: every warp has
// passed that tile's barriers (no "empty" barrier is needed) and thread 0 waits until its store
// has read the stage (all but the last bulk group).
// NOTES: each lane permutes the four bytes of its words (slot j holds channel 4l + (j ^ x), x =
// (l / 2) % 4, one PRMT a word) so that the eight lanes of a quarter warp write their phase-3 units
// to eight distinct 16-byte columns of the swizzled tile (without it: 4-way bank conflicts); the
// amaxes and reciprocals are exchanged back to channel order in registers (8 selects), so their
// shared-memory accesses stay vector-wide and conflict-free. Bit-exact with the 128x1 kernel: same
// products, same scale arithmetic.
// NOTES: the transposed tile traffic bounds this kernel, not its instructions: the same TMA loads
// and stores with no arithmetic reach 86-87% of copy, the kernel 82% (docs/PERF-log.md, "The
// requantizer's memory bound"). Hence the in-place output tile, which leaves room for 6 stages (4
// with two separate output buffers, about 1% slower), and TMA for both directions (cp.async stages
// with stores from registers, ~730 instructions per thread and tile, were 7% slower). Not faster
// (docs/PERF-log.md, "Quantization"): a separate producer warp with empty barriers,
// 16 warps (64 registers), the store gated by an mbarrier instead of a CTA barrier, column-major
// or chunked walks, a 128-byte-swizzled input tile, 8% fewer instructions (no division per tile),
// and even contiguous (wrong) stores gained only ~2%.
constexpr int kRqStages = 6;
constexpr int kRqIn = 128 * 128;         // input bytes of a stage, then the output tile in their place
constexpr int kRqStage = kRqIn + 1024;   // + the tile's 128 token scales, padded to the swizzle's 1024-byte period
constexpr int kRqWarps = 8, kRqThreads = kRqWarps * 32;
constexpr int kRqSmem = 1024 + kRqStages * kRqStage + kRqWarps * 128 * 4 + 128 * 4 + kRqStages * 8;

// Tile walk of a persistent CTA: channel block cb, token block tb, advanced by gridDim.x tiles
// = step.tb token blocks and step.cb channel blocks (computed on the host: no division per tile).
struct RqWalk {
  int64_t cb, tb;
  __device__ void advance(const RqWalk& step, int64_t CB) {
    cb += step.cb;
    tb += step.tb;
    if (cb >= CB) {
      cb -= CB;
      ++tb;
    }
  }
};

template <bool kInE5M2, bool kE5M2>
__global__ void __launch_bounds__(kRqThreads, 2)
    requantize_128x1_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap s_in_map,
                            const __grid_constant__ CUtensorMap q_map, float* __restrict__ s, int64_t T, int64_t C,
                            int64_t ld, RqWalk step, float max_finite, bool pow2) {
  namespace p = ptx;
  extern __shared__ uint8_t rq_raw[];
  uint8_t* const stages = rq_raw + ((1024 - p::smem_addr(rq_raw) % 1024) % 1024);  // 128B swizzle: 1024-aligned
  float* const red = reinterpret_cast<float*>(stages + kRqStages * kRqStage);  // [warp][channel]
  float* const inv_s = red + kRqWarps * 128;
  uint64_t* const full = reinterpret_cast<uint64_t*>(inv_s + 128);  // [kRqStages]: a stage's bytes landed
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t CB = (C + 127) / 128, TB = (T + 127) / 128;
  const RqWalk first{int64_t(blockIdx.x) % CB, int64_t(blockIdx.x) / CB};
  RqWalk load = first;
  int load_stage = 0;
  // Thread 0: the TMA load of the tile at `load` into its stage, then on to the next tile.
  auto issue = [&] {
    if (load.tb < TB) {
      const int32_t cb = int32_t(load.cb), t0 = int32_t(load.tb) * 128;
      uint8_t* st = stages + load_stage * kRqStage;
      p::mbar_arrive_expect_tx(&full[load_stage], kRqIn + 128 * 4);
      p::tma_load_2d(&x_map, &full[load_stage], st, cb * 128, t0);
      p::tma_load_2d(&s_in_map, &full[load_stage], st + kRqIn, t0, cb);
      load.advance(step, CB);
      load_stage = load_stage == kRqStages - 1 ? 0 : load_stage + 1;
    }
  };
  if (tid == 0) {
    for (int i = 0; i < kRqStages; ++i) p::mbar_init(&full[i], 1);
    p::fence_barrier_init();
    p::prefetch_tmap(&x_map);
    p::prefetch_tmap(&s_in_map);
    p::prefetch_tmap(&q_map);
    for (int i = 0; i < kRqStages - 2; ++i) issue();
  }
  __syncthreads();

  // Slot j of the lane holds channel 4 * lane + (j ^ x); the same exchanges map slots to channels
  // and back: a[c] <-> a[c ^ x].
  const int x = (lane / 2) % 4;
  const uint32_t sel = uint32_t(x) | uint32_t(1 ^ x) << 4 | uint32_t(2 ^ x) << 8 | uint32_t(3 ^ x) << 12;
  auto exchange = [x](float (&a)[4]) {
    if (x & 1) {
      const float t0 = a[0], t2 = a[2];
      a[0] = a[1], a[1] = t0, a[2] = a[3], a[3] = t2;
    }
    if (x & 2) {
      const float t0 = a[0], t1 = a[1];
      a[0] = a[2], a[1] = a[3], a[2] = t0, a[3] = t1;
    }
  };
  int stage = 0;
  uint32_t parity = 0;
  for (RqWalk at = first; at.tb < TB; at.advance(step, CB)) {
    // The stage of the tile before the previous one: its store (all but the last bulk group) has read it.
    if (tid == 0) {
      p::bulk_wait_read_but_last();
      issue();
    }
    const int64_t tb = at.tb, c0 = at.cb * 128;
    p::mbar_wait(&full[stage], parity);
    uint8_t* const st = stages + stage * kRqStage;

    // 1. products and the thread's per-channel amax
    float v[16][4];
    float am[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4) {
      const float4 s4 = *reinterpret_cast<const float4*>(st + kRqIn + (warp * 16 + k4 * 4) * 4);
      const float sk[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int k = k4 * 4 + kk;
        const uint32_t w = __byte_perm(*reinterpret_cast<const uint32_t*>(st + (warp * 16 + k) * 128 + lane * 4), 0, sel);
        const float2 a = decode2<kInE5M2>(w), b = decode2<kInE5M2>(w >> 16);
        v[k][0] = __fmul_rn(a.x, sk[kk]);
        v[k][1] = __fmul_rn(a.y, sk[kk]);
        v[k][2] = __fmul_rn(b.x, sk[kk]);
        v[k][3] = __fmul_rn(b.y, sk[kk]);
#pragma unroll
        for (int j = 0; j < 4; ++j) am[j] = amax_nan(am[j], v[k][j]);
      }
    }
    if (++stage == kRqStages) stage = 0, parity ^= 1;
    exchange(am);
    *reinterpret_cast<float4*>(red + warp * 128 + lane * 4) = make_float4(am[0], am[1], am[2], am[3]);
    p::named_barrier_sync(1, kRqThreads);

    // 2. scales
    if (tid < 128) {
      float amax = red[tid];
#pragma unroll
      for (int w = 1; w < kRqWarps; ++w) amax = amax_nan(amax, red[w * 128 + tid]);
      const float sc = scale_of(amax, max_finite, pow2);
      inv_s[tid] = inv_scale(sc);
      if (c0 + tid < C) s[tb * ld + c0 + tid] = sc;
    }
    p::named_barrier_sync(1, kRqThreads);

    // 3. one 16-byte unit (tokens 16w..16w+15) per channel into the swizzled transposed tile, over the input
    const float4 r4 = *reinterpret_cast<const float4*>(inv_s + lane * 4);
    float r[4] = {r4.x, r4.y, r4.z, r4.w};
    exchange(r);
    uint8_t* const o = st;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int cl = lane * 4 + (j ^ x);
      uint32_t u[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const uint32_t lo = encode2<kE5M2>(__fmul_rn(v[4 * m][j], r[j]), __fmul_rn(v[4 * m + 1][j], r[j]));
        const uint32_t hi = encode2<kE5M2>(__fmul_rn(v[4 * m + 2][j], r[j]), __fmul_rn(v[4 * m + 3][j], r[j]));
        u[m] = lo | (hi << 16);
      }
      *reinterpret_cast<uint4*>(o + cl * 128 + (warp ^ (cl % 8)) * 16) = make_uint4(u[0], u[1], u[2], u[3]);
    }
    p::fence_proxy_async_smem();
    p::named_barrier_sync(1, kRqThreads);

    // 4. the tile to q [C, T]
    if (tid == 0) {
      p::tma_store_2d(&q_map, o, int32_t(tb * 128), int32_t(c0));
      p::bulk_commit();
    }
  }
  if (tid == 0) p::bulk_wait();
}

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
  // Vector path: 16-byte input vectors and aligned 8/4-byte output stores.
  const bool vec_ok = C % vec == 0 && aligned16(x.data) && aligned16(out.values.data);
  const int64_t G = (C + 127) / 128, blocks = tiles_blocks(R, G), gx = tiles_gx(G);
  const int wg = tiles_wg(G);
  FP8MOE_CHECK(blocks < (int64_t(1) << 31), "quantize_1x128: tensor too large");
  const int grid = int(blocks);
  reset_flag(stream, check_finite);
  auto go = [&](auto tin, auto e5, auto vk) {
    using Tin = decltype(tin);
    quantize_1x128_kernel<Tin, decltype(e5)::value, decltype(vk)::value><<<grid, 256, 0, stream>>>(
        static_cast<const Tin*>(x.data), out.values.ptr<uint8_t>(), out.scales.ptr<float>(), R, C, ld, wg, gx, mf,
        pow2, check_finite);
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

// Shared launcher of the transposing kernels: input x [T, C] (values, or FP8 values + scales);
// with `rows` (f32|bf16 input on the vector path, rows in out's dtype) x's 1x128 quantization too.
template <class Tin, bool kInE5M2>
void launch_128x1(const Tin* x, const float* s_in, int64_t ld_in, bool in_vec_ok, const QuantizedView& out,
                  const QuantizedView* rows, int64_t T, int64_t C, ScaleMode mode, cudaStream_t stream, bool check) {
  const float mf = float(max_finite(out.values.dtype));
  const bool pow2 = mode == ScaleMode::pow2, e5m2 = out.values.dtype == DType::e5m2;
  const bool out_vec_ok = T % 16 == 0 && aligned16(out.values.data);
  FP8MOE_CHECK((T + 127) / 128 < 65536, "quantize_128x1: too many token blocks (" << T << " tokens)");
  const dim3 grid(unsigned((C + 127) / 128), unsigned((T + 127) / 128));
  const int64_t ld = out.scales.size(1);
  const RowsOut ro = rows ? RowsOut{rows->values.ptr<uint8_t>(), rows->scales.ptr<float>(), rows->scales.size(1)}
                          : RowsOut{};
  auto go = [&](auto e5, auto vi, auto vo, auto kr) {
    quantize_128x1_kernel<Tin, kInE5M2, decltype(e5)::value, decltype(vi)::value, decltype(vo)::value,
                          decltype(kr)::value><<<grid, 256, 0, stream>>>(
        x, s_in, ld_in, out.values.ptr<uint8_t>(), out.scales.ptr<float>(), T, C, ld, ro, mf, pow2, check);
  };
  using T_ = std::true_type;
  using F_ = std::false_type;
  auto go2 = [&](auto e5) {
    if constexpr (sizeof(Tin) > 1) {
      if (rows) return out_vec_ok ? go(e5, T_{}, T_{}, T_{}) : go(e5, T_{}, F_{}, T_{});
    }
    if (in_vec_ok) out_vec_ok ? go(e5, T_{}, T_{}, F_{}) : go(e5, T_{}, F_{}, F_{});
    else out_vec_ok ? go(e5, F_{}, T_{}, F_{}) : go(e5, F_{}, F_{}, F_{});
  };
  e5m2 ? go2(T_{}) : go2(F_{});
  FP8MOE_CUDA_CHECK_LAUNCH("quantize_128x1_kernel");
  fill_padding(out.scales, C, stream);
  if (rows) fill_padding(rows->scales, T, stream);
}

// The requantizer's TMA path: x, q and the scales as the TMA needs them (16-byte aligned bases, row
// strides a multiple of 16 bytes: C % 16 == 0, T % 16 == 0, ld_in % 4 == 0). Persistent CTAs, as
// many as fit at once, each walking an equal share of the tiles (within one).
bool requantize_tma_ok(const QuantizedView& in, const QuantizedView& out) {
  return aligned16(in.values.data) && in.cols() % 16 == 0 && aligned16(in.scales.data) &&
         in.scales.size(1) % 4 == 0 && aligned16(out.values.data) && in.rows() % 16 == 0 &&
         in.rows() <= INT32_MAX && in.cols() <= INT32_MAX;
}

template <bool kInE5M2>
void launch_requantize(const QuantizedView& in, const QuantizedView& out, ScaleMode mode, cudaStream_t stream) {
  const int64_t T = in.rows(), C = in.cols(), ld_in = in.scales.size(1);
  const float mf = float(max_finite(out.values.dtype));
  const bool pow2 = mode == ScaleMode::pow2, e5m2 = out.values.dtype == DType::e5m2;
  const int64_t CB = (C + 127) / 128, ld = out.scales.size(1), tiles = ((T + 127) / 128) * CB;
  const CUtensorMap x_map = make_tmap_2d(in.values.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(C), uint64_t(T),
                                         uint64_t(C), 128, 128, CU_TENSOR_MAP_SWIZZLE_NONE, "requantize in.values");
  const CUtensorMap s_map = make_tmap_2d(in.scales.data, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, uint64_t(T),
                                         uint64_t(CB), uint64_t(ld_in), 128, 1,
                                         CU_TENSOR_MAP_SWIZZLE_NONE, "requantize in.scales");
  const CUtensorMap q_map = make_tmap_2d(out.values.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(T), uint64_t(C),
                                         uint64_t(T), 128, 128, CU_TENSOR_MAP_SWIZZLE_128B, "requantize out.values");
  auto go = [&](auto e5) {
    auto kernel = requantize_128x1_kernel<kInE5M2, decltype(e5)::value>;
    static int per_sm = 0;
    static std::once_flag once;
    std::call_once(once, [&] {
      FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRqSmem));
      FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kRqThreads, kRqSmem));
      per_sm = std::max(per_sm, 1);
    });
    const int64_t resident = int64_t(per_sm) * device_props().multiProcessorCount;
    const int64_t rounds = (tiles + resident - 1) / resident;
    const int grid = int((tiles + rounds - 1) / rounds);
    kernel<<<grid, kRqThreads, kRqSmem, stream>>>(x_map, s_map, q_map, out.scales.ptr<float>(), T, C, ld,
                                                  RqWalk{grid % CB, grid / CB}, mf, pow2);
  };
  e5m2 ? go(std::true_type{}) : go(std::false_type{});
  FP8MOE_CUDA_CHECK_LAUNCH("requantize_128x1_kernel");
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
    launch_128x1<__nv_bfloat16, false>(x.ptr<const __nv_bfloat16>(), nullptr, 0, in_vec_ok, out, nullptr, T, C, mode,
                                       stream, check_finite);
  else
    launch_128x1<float, false>(x.ptr<const float>(), nullptr, 0, in_vec_ok, out, nullptr, T, C, mode, stream,
                               check_finite);
  raise_if_flagged(stream, check_finite, "x");
}

void quantize_1x128_and_128x1_cuda(const TensorView& x, const QuantizedView& rows, const QuantizedView& cols,
                                   ScaleMode mode, cudaStream_t stream, bool check_finite) {
  check_quantize_1x128_and_128x1(x, rows, cols);
  check_device(x, "x");
  check_device(rows.values, "rows.values");
  check_device(rows.scales, "rows.scales");
  check_device(cols.values, "cols.values");
  check_device(cols.scales, "cols.scales");
  check_out_dtype(rows, "rows");
  check_out_dtype(cols, "cols");
  const int64_t T = x.size(0), C = x.size(1);
  if (T == 0 || C == 0) return;
  // NOTES: the 128x1 kernel writes the rows too where its vector path applies (x 16-byte aligned,
  // C a multiple of the 16-byte vector's values) and both outputs share one FP8 dtype; other
  // shapes and dtype pairs (C = 130, rows e5m2 and cols e4m3) take the two kernels, x read twice.
  const bool fused = aligned16(x.data) && (C * int64_t(dtype_size(x.dtype))) % 16 == 0 &&
                     aligned16(rows.values.data) && rows.values.dtype == cols.values.dtype;
  if (!fused) {
    quantize_1x128_cuda(x, rows, mode, stream, check_finite);
    quantize_128x1_cuda(x, cols, mode, stream, check_finite);
    return;
  }
  reset_flag(stream, check_finite);
  if (x.dtype == DType::bf16)
    launch_128x1<__nv_bfloat16, false>(x.ptr<const __nv_bfloat16>(), nullptr, 0, true, cols, &rows, T, C, mode,
                                       stream, check_finite);
  else
    launch_128x1<float, false>(x.ptr<const float>(), nullptr, 0, true, cols, &rows, T, C, mode, stream, check_finite);
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
  // NOTES: the input is FP8 times finite scales, so it is always finite: no NaN check needed.
  const bool e5 = in.values.dtype == DType::e5m2;
  if (requantize_tma_ok(in, out)) {
    e5 ? launch_requantize<true>(in, out, mode, stream) : launch_requantize<false>(in, out, mode, stream);
    return;
  }
  const bool in_vec_ok = aligned16(in.values.data) && C % 16 == 0;
  const auto* x = in.values.ptr<const uint8_t>();
  const auto* s = in.scales.ptr<const float>();
  const int64_t ld_in = in.scales.size(1);
  if (e5)
    launch_128x1<uint8_t, true>(x, s, ld_in, in_vec_ok, out, nullptr, T, C, mode, stream, false);
  else
    launch_128x1<uint8_t, false>(x, s, ld_in, in_vec_ok, out, nullptr, T, C, mode, stream, false);
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
