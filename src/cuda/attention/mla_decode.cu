// The absorbed MLA decode attention over the paged latent cache (mla_decode.hpp): split-KV CTAs
// that each read a context range of one sequence once for a tile of heads, then a merge of the
// splits by log-sum-exp in split order. Scores are kept in the log2 domain (scale * log2(e)
// folded into the scale) so that every exponential is one exp2f.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/attention/mla_decode.hpp"
#include "cuda/ops/model_ops_util.cuh"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda {
namespace {

constexpr float kNegInf = -INFINITY;
// Splits: the count that brings the CTAs nearest to one wave (the tensor-core CTAs as many per SM
// as shared memory holds; the CUDA-core one is small, 8 per SM), a split at least one block, at most
// kMaxSplits. More splits than a wave's worth only add partial outputs (H x rkv f32 each) to write
// and merge.
constexpr int64_t kMaxSplits = 128;

// The split size in blocks of a context of `blocks` blocks that aims at `want` splits: whole
// blocks, at least one per split. The host's fit_batch plan and the device's by_length rule both
// take it, so that a sequence alone in a fit_batch call and the same sequence under by_length in
// any call get the same ranges.
__host__ __device__ __forceinline__ int64_t split_blocks(int64_t blocks, int64_t want) {
  want = want < 1 ? 1 : want > blocks ? blocks : want;
  want = want > kMaxSplits ? kMaxSplits : want;
  return (blocks + want - 1) / want;
}

// The tokens [begin, end) of sequence b that split `sp` covers; a length outside [0, max_blocks *
// 64] is clamped (mla_decode.hpp: such values are not errors on the device). blocks_per_split 0:
// the by_length rule, the split size from the sequence's own blocks and length_target.
struct SplitRange {
  int begin, end;
};
__device__ __forceinline__ SplitRange split_range(const int32_t* lengths, int b, int sp, int blocks_per_split,
                                                  int length_target, int max_blocks) {
  const int len = min(max(lengths[b], 0), max_blocks * int(kMlaBlockTokens));
  const int bps = blocks_per_split > 0
                      ? blocks_per_split
                      : int(split_blocks(max(1, (len + int(kMlaBlockTokens) - 1) / int(kMlaBlockTokens)), length_target));
  const int begin = sp * bps * int(kMlaBlockTokens);
  return {begin, max(begin, min(len, begin + bps * int(kMlaBlockTokens)))};
}

// First slot of token p's block, or -1 when the table's entry is outside the cache.
__device__ __forceinline__ int64_t block_slot(const int32_t* table, int b, int max_blocks, int p, int64_t slots) {
  const int64_t blk = table[int64_t(b) * max_blocks + p / int(kMlaBlockTokens)];
  return blk >= 0 && (blk + 1) * kMlaBlockTokens <= slots ? blk * kMlaBlockTokens : -1;
}

// ---- tensor-core path ----

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// d += a (16x16, row) * b (16x8, col), BF16 operands, FP32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The same with FP16 operands: the fp8 cache's path. Its e4m3 codes are exact in FP16, so the
// dequantization is one conversion and one multiply by the scale per two values (FP16 keeps more
// of the product than BF16 would), against five through FP32 for BF16 operands.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The operands of the tensor-core path: BF16 for a bf16 cache, FP16 for an fp8 one.
template <bool kFp8>
struct TcOperand {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_bf16(lo, hi); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_bf16(d, a, b0, b1);
  }
};
template <>
struct TcOperand<true> {
  using T = __half;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_f16(lo, hi); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_f16(d, a, b0, b1);
  }
};

// e4m3 x 4 (a 32-bit word, byte i the lower) -> two FP16 pairs: bytes (0, 1) and (2, 3). The codes
// are exact in FP16, one conversion per pair.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t v, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
}
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t v) {
  return pack_f16(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, __half2 b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), b);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The CTA: kMH groups of kNW warps, group i owning heads [16 i, 16 i + 16) of the CTA's tile. Per
// tile of kTok = 32 tokens (half a cache block, so its slots are consecutive) warp j of a group
// scores tokens [kTok / kNW j, kTok / kNW (j + 1)) of the tile for its 16 heads; the group shares
// its row maxima and sums through shared memory (its warps then hold the same running max and
// sum), writes the probabilities to shared memory, and warp j accumulates output columns
// [j rkv / kNW, (j + 1) rkv / kNW) over all kTok tokens (kNW: TcConfig). Rows in shared memory
// are padded by 8 operands so that the eight rows an ldmatrix reads fall in distinct 16-byte bank
// groups (row stride an odd number of 16 bytes).
//
// The fp8 cache's tiles stay in shared memory as stored (e4m3 codes, their scales, BF16 RoPE keys)
// and each warp widens the codes its MMA fragments take in registers, so that a tile crosses
// shared memory once. That needs fragments of whole words of one row, which the MMA's layout gives
// only up to a permutation of each product's inner dimension (and of the output's columns), free
// to choose because a dot product does not depend on the order of its terms:
//   QK^T  the thread's four values of a k-step (k = 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9) are the
//         latent dims 8 t4 + 4 s + [0, 4) of a 32-dim chunk (k-step s of the chunk's two): one
//         8-byte read per chunk and token. Q is stored in that order (q_column below). A K-scale
//         is one per 128 dims and token, so it multiplies each group's FP32 partial score;
//   PV    the thread's tokens of a k-step are t4 + {0, 4, 8, 12} and its column g of n-tile 4 c + i
//         is dim 32 c + 4 g + i of the warp's columns: one 4-byte read per token and chunk, the
//         four words transposed with byte permutes. P is stored in that token order (p_column);
//         the V codes are scaled by their token's scale in FP16 (or, where a warp's columns lie in
//         one group, its column of P).
// Row strides: latent rows 32 bytes past a multiple of 128 (the QK's 8-byte reads of four rows and
// the PV's 4-byte reads of four rows hit distinct banks), RoPE rows 16 bytes past one.
template <int kRkv, int kDr, int kMH>
struct TcConfig {
  static constexpr int W = kRkv + kDr, kStride = W + 8, kTok = 32, kPStride = kTok + 8;
  // Warps per 16 heads: four where a CTA has 16 heads (its small Q leaves room for three CTAs per
  // SM, and the warps they bring hide the latency of the shared-memory reads, the conversions and
  // the MMAs that feed one another); two where more heads make the MMAs bind, as the Q fragments
  // each warp reads once per tile would double.
  static constexpr int kNW = kMH == 1 ? 4 : 2, kWarpTok = kTok / kNW;
  static constexpr int kOct = kWarpTok / 8;  // token octets per warp
  static constexpr int kHeads = 16 * kMH, kThreads = 32 * kNW * kMH;
  // CTAs per SM the registers must allow: the shared memory of a 16-head CTA lets three run.
  static constexpr int kMinCtas = kMH == 1 ? 3 : 1;
  static constexpr int kVCols = kRkv / kNW, kNTiles = kVCols / 8;
  static_assert(W % 32 == 0 && kDr % 16 == 0 && kRkv % 128 == 0, "shape");
  static_assert(kOct >= 1 && kWarpTok % 8 == 0, "whole token octets per warp");
  static_assert((kStride / 8) % 2 == 1 && (kPStride / 8) % 2 == 1, "padding keeps ldmatrix conflict-free");
  static_assert(kNTiles % 4 == 0, "output n-tiles go in fours");
  static constexpr int kG = kRkv / 128;
  static constexpr int kLatStride = kRkv + 32, kRopeStride = 2 * kDr + 16;  // bytes
  // Shared memory, in bytes: Q, two buffers of operand rows (bf16) or of stored rows (fp8),
  // probabilities, the warp groups' maxima and sums.
  static constexpr size_t kQBytes = size_t(kHeads) * kStride * 2, kRowsBytes = size_t(kTok) * kStride * 2;
  static constexpr size_t kRawLat = size_t(kTok) * kLatStride, kRawScale = size_t(kTok) * kG * 4,
                          kRawRope = size_t(kTok) * kRopeStride, kRawBytes = kRawLat + kRawScale + kRawRope;
  static constexpr size_t kPBytes = size_t(kHeads) * kPStride * 2, kStatBytes = size_t(2) * kNW * kHeads * 4;
  static constexpr size_t smem(bool fp8) { return kQBytes + 2 * (fp8 ? kRawBytes : kRowsBytes) + kPBytes + kStatBytes; }
};

// The fp8 path's Q column of latent dim d (QK^T above); RoPE dims keep their place.
__device__ __forceinline__ int q_column(int d) {
  const int c = d & ~31, t4 = (d >> 3) & 3, s = (d >> 2) & 1, hi = (d >> 1) & 1, lo = d & 1;
  return c + 16 * s + 2 * t4 + lo + 8 * hi;
}
// The fp8 path's P column of token u of a 16-token k-step (PV above).
__device__ __forceinline__ int p_column(int u) {
  const int t4 = u & 3, r = u >> 2;
  return 2 * t4 + (r & 1) + 8 * (r >> 1);
}

template <int kRkv, int kDr, int kMH, bool kFp8>
__global__ void __launch_bounds__(TcConfig<kRkv, kDr, kMH>::kThreads, TcConfig<kRkv, kDr, kMH>::kMinCtas)
    mla_decode_tc_kernel(const float* __restrict__ q, const __nv_bfloat16* __restrict__ rows,
                         const uint8_t* __restrict__ lat, const float* __restrict__ lat_scale,
                         const __nv_bfloat16* __restrict__ rope, const int32_t* __restrict__ table,
                         const int32_t* __restrict__ lengths, int H, int max_blocks, int64_t slots, int head_tiles,
                         int splits, int blocks_per_split, int length_target, float scale_log2,
                         float* __restrict__ o, float* __restrict__ part, float* __restrict__ part_lse) {
  using C = TcConfig<kRkv, kDr, kMH>;
  using Op = TcOperand<kFp8>;
  using E = typename Op::T;
  constexpr int W = C::W, S = C::kStride, kTok = C::kTok, PS = C::kPStride, NT = C::kThreads, G = C::kG;
  constexpr int LS = C::kLatStride, RS = C::kRopeStride, NW = C::kNW, OCT = C::kOct;
  constexpr size_t kBufBytes = kFp8 ? C::kRawBytes : C::kRowsBytes;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sQ = reinterpret_cast<E*>(smem);
  unsigned char* sBuf = smem + C::kQBytes;  // two tile buffers
  E* sP = reinterpret_cast<E*>(sBuf + 2 * kBufBytes);
  float* sMax = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sP) + C::kPBytes);  // [NW][kHeads]
  float* sSum = sMax + NW * C::kHeads;                                                        // [NW][kHeads]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, mh = warp / NW, nw = warp % NW;
  const int tw = nw * C::kWarpTok;  // the warp's first token of a tile
  const int g = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.y, ht = blockIdx.x % head_tiles, sp = blockIdx.x / head_tiles;
  const int h0 = ht * C::kHeads;
  const SplitRange range = split_range(lengths, b, sp, blocks_per_split, length_target, max_blocks);
  const int ntiles = (range.end - range.begin + kTok - 1) / kTok;

  // Q of the tile's heads as operands (heads past H: zero rows, their outputs are not stored); the
  // fp8 path's latent dims in q_column's order, in pairs: dims d + {0, 1} and d + {2, 3} of four.
  for (int i = tid; i < C::kHeads * (W / 4); i += NT) {
    const int r = i / (W / 4), c = (i % (W / 4)) * 4, h = h0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (h < H) v = *reinterpret_cast<const float4*>(q + (int64_t(b) * H + h) * W + c);
    if (kFp8 && c < kRkv) {
      *reinterpret_cast<uint32_t*>(sQ + r * S + q_column(c)) = Op::pack(v.x, v.y);
      *reinterpret_cast<uint32_t*>(sQ + r * S + q_column(c + 2)) = Op::pack(v.z, v.w);
    } else {
      *reinterpret_cast<uint2*>(sQ + r * S + c) = make_uint2(Op::pack(v.x, v.y), Op::pack(v.z, v.w));
    }
  }

  // Issues the copies of tile `it` into buffer `buf` (rows past the range or in a block outside
  // the cache: zeros, and masked below; zero codes and scales keep the products finite).
  auto load_tile = [&](int it, int buf) {
    const int t0 = range.begin + it * kTok;
    const int64_t base = block_slot(table, b, max_blocks, t0, slots);
    const int64_t slot0 = base + t0 % int(kMlaBlockTokens);
    unsigned char* dst = sBuf + buf * kBufBytes;
    auto copy16 = [&](int r, void* to, const void* from) {
      if (base >= 0 && t0 + r < range.end)
        cp_async16(to, from);
      else
        *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    };
    if constexpr (!kFp8) {
      for (int i = tid; i < kTok * (W / 8); i += NT) {
        const int r = i / (W / 8), c = (i % (W / 8)) * 8;
        copy16(r, reinterpret_cast<E*>(dst) + r * S + c, rows + (slot0 + r) * W + c);
      }
    } else {
      float* rs = reinterpret_cast<float*>(dst + C::kRawLat);  // [G][kTok]
      unsigned char* rr = dst + C::kRawLat + C::kRawScale;
      for (int i = tid; i < kTok * (kRkv / 16); i += NT) {
        const int r = i / (kRkv / 16), c = (i % (kRkv / 16)) * 16;
        copy16(r, dst + r * LS + c, lat + (slot0 + r) * kRkv + c);
      }
      for (int i = tid; i < kTok * G; i += NT) {
        const int r = i / G, gi = i % G;
        if (base >= 0 && t0 + r < range.end)
          cp_async4(rs + gi * kTok + r, lat_scale + (slot0 + r) * G + gi);
        else
          rs[gi * kTok + r] = 0.f;
      }
      for (int i = tid; i < kTok * (kDr / 8); i += NT) {
        const int r = i / (kDr / 8), c = (i % (kDr / 8)) * 8;
        copy16(r, rr + r * RS + 2 * c, rope + (slot0 + r) * kDr + c);
      }
    }
    cp_async_commit();
  };

  float acc[C::kNTiles][4];
#pragma unroll
  for (int n = 0; n < C::kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m_run[2] = {kNegInf, kNegInf}, l_run[2] = {0.f, 0.f};  // rows g and g + 8
  const int row0 = mh * 16 + g;                                 // the thread's first row in the tile
  const E* qa = sQ + (mh * 16 + (lane & 15)) * S + (lane >> 4) * 8;

  if (ntiles > 0) load_tile(0, 0);
  for (int it = 0; it < ntiles; ++it) {
    const int buf = it & 1;
    if (it + 1 < ntiles) {
      load_tile(it + 1, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const unsigned char* tile = sBuf + buf * kBufBytes;

    // Scores of 16 heads x the warp's tokens: s[j] is tokens tw + 8 j + [0, 8).
    float s[OCT][4] = {};
    if constexpr (!kFp8) {
      const E* K = reinterpret_cast<const E*>(tile);
      if constexpr (OCT == 2) {  // one ldmatrix: both octets' k-step
        const E* kb = K + (tw + ((lane >> 4) & 1) * 8 + (lane & 7)) * S + ((lane >> 3) & 1) * 8;
#pragma unroll 4
        for (int k0 = 0; k0 < W; k0 += 16) {
          uint32_t a[4], bb[4];
          ldmatrix_x4(a, qa + k0);
          ldmatrix_x4(bb, kb + k0);
          Op::mma(s[0], a, bb[0], bb[1]);
          Op::mma(s[OCT - 1], a, bb[2], bb[3]);
        }
      } else {  // one ldmatrix: the octet's two k-steps, into two accumulators
        const E* kb = K + (tw + (lane & 7)) * S + (lane >> 3) * 8;
        float s2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
        for (int k0 = 0; k0 < W; k0 += 32) {
          uint32_t a0[4], a1[4], bb[4];
          ldmatrix_x4(a0, qa + k0);
          ldmatrix_x4(a1, qa + k0 + 16);
          ldmatrix_x4(bb, kb + k0);
          Op::mma(s[0], a0, bb[0], bb[1]);
          Op::mma(s2, a1, bb[2], bb[3]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][e] += s2[e];
      }
    } else {
      const float* rs = reinterpret_cast<const float*>(tile + C::kRawLat);
      const unsigned char* rr = tile + C::kRawLat + C::kRawScale;
#pragma unroll
      for (int gi = 0; gi < G; ++gi) {  // the group's FP32 partial score times its tokens' scales
        float t[OCT][4] = {};
#pragma unroll
        for (int c = gi * 128; c < gi * 128 + 128; c += 32) {
          uint32_t a0[4], a1[4];
          ldmatrix_x4(a0, qa + c);
          ldmatrix_x4(a1, qa + c + 16);
#pragma unroll
          for (int j = 0; j < OCT; ++j) {
            const uint2 v = *reinterpret_cast<const uint2*>(tile + (tw + 8 * j + g) * LS + c + 8 * t4);
            uint32_t bb[4];
            e4m3x4_to_f16(v.x, bb[0], bb[1]);
            e4m3x4_to_f16(v.y, bb[2], bb[3]);
            Op::mma(t[j], a0, bb[0], bb[1]);
            Op::mma(t[j], a1, bb[2], bb[3]);
          }
        }
#pragma unroll
        for (int j = 0; j < OCT; ++j) {
          const float2 sc = *reinterpret_cast<const float2*>(rs + gi * kTok + tw + 8 * j + 2 * t4);
          s[j][0] = fmaf(t[j][0], sc.x, s[j][0]);
          s[j][1] = fmaf(t[j][1], sc.y, s[j][1]);
          s[j][2] = fmaf(t[j][2], sc.x, s[j][2]);
          s[j][3] = fmaf(t[j][3], sc.y, s[j][3]);
        }
      }
#pragma unroll
      for (int k0 = 0; k0 < kDr; k0 += 16) {  // the RoPE keys, BF16 -> FP16
        uint32_t a[4];
        ldmatrix_x4(a, qa + kRkv + k0);
#pragma unroll
        for (int j = 0; j < OCT; ++j) {
          const unsigned char* row = rr + (tw + 8 * j + g) * RS + 2 * (k0 + 2 * t4);
          Op::mma(s[j], a, bf16x2_to_f16x2(*reinterpret_cast<const uint32_t*>(row)),
                  bf16x2_to_f16x2(*reinterpret_cast<const uint32_t*>(row + 16)));
        }
      }
    }
    const int t0 = range.begin + it * kTok;
    const bool tile_ok = block_slot(table, b, max_blocks, t0, slots) >= 0;
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int j = 0; j < OCT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = t0 + tw + j * 8 + 2 * t4 + (e & 1);
        s[j][e] = tile_ok && tok < range.end ? s[j][e] * scale_log2 : kNegInf;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    if (t4 == 0) {
      sMax[nw * C::kHeads + row0] = mx[0];
      sMax[nw * C::kHeads + row0 + 8] = mx[1];
    }
    __syncthreads();
    float alpha[2], m_use[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m_tile = sMax[row0 + 8 * r];
#pragma unroll
      for (int w = 1; w < NW; ++w) m_tile = fmaxf(m_tile, sMax[w * C::kHeads + row0 + 8 * r]);
      const float m_new = fmaxf(m_run[r], m_tile);
      m_use[r] = m_new == kNegInf ? 0.f : m_new;  // no valid token yet: exp2(-inf - 0) = 0, no NaN
      alpha[r] = exp2f(m_run[r] - m_use[r]);
      m_run[r] = m_new;
    }
#pragma unroll
    for (int j = 0; j < OCT; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t p = Op::pack(exp2f(s[j][2 * r] - m_use[r]), exp2f(s[j][2 * r + 1] - m_use[r]));
        const E* pe = reinterpret_cast<const E*>(&p);  // the sum of the probabilities the products use
        sum[r] += float(pe[0]) + float(pe[1]);
        const int u = tw + j * 8;  // the octet's first token: k-step u / 16, from u % 16 in it
        E* prow = sP + (row0 + 8 * r) * PS + u / 16 * 16;
        if constexpr (kFp8) {
          prow[p_column(u % 16 + 2 * t4)] = pe[0];
          prow[p_column(u % 16 + 2 * t4 + 1)] = pe[1];
        } else {
          *reinterpret_cast<uint32_t*>(prow + u % 16 + 2 * t4) = p;
        }
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    }
    if (t4 == 0) {
      sSum[nw * C::kHeads + row0] = sum[0];
      sSum[nw * C::kHeads + row0 + 8] = sum[1];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l_tile = sSum[row0 + 8 * r];
#pragma unroll
      for (int w = 1; w < NW; ++w) l_tile += sSum[w * C::kHeads + row0 + 8 * r];
      l_run[r] = l_run[r] * alpha[r] + l_tile;
    }
#pragma unroll
    for (int n = 0; n < C::kNTiles; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }
    // o[16 heads, the warp's columns] += P [16, kTok] V [kTok, columns].
    const E* pa = sP + (mh * 16 + (lane & 15)) * PS + (lane >> 4) * 8;
    if constexpr (!kFp8) {
      const E* vb = reinterpret_cast<const E*>(tile) + (((lane >> 3) & 1) * 8 + (lane & 7)) * S + nw * C::kVCols +
                    (lane >> 4) * 8;
#pragma unroll
      for (int kk = 0; kk < kTok; kk += 16) {
        uint32_t a[4];
        ldmatrix_x4(a, pa + kk);
#pragma unroll
        for (int np = 0; np < C::kNTiles / 2; ++np) {
          uint32_t bb[4];
          ldmatrix_x4_trans(bb, vb + kk * S + np * 16);
          Op::mma(acc[2 * np], a, bb[0], bb[1]);
          Op::mma(acc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
    } else {
      // Where the warp's columns lie in one 128-dim group, its tokens' V scales multiply P's
      // columns (tokens t4 + {0, 4} and t4 + {8, 12} of the k-step in the thread's fragment) once
      // per k-step; else each V fragment by its group's.
      constexpr bool kScaleP = C::kVCols <= 128;
      const float* rs = reinterpret_cast<const float*>(tile + C::kRawLat);
      // The scales of the thread's tokens of k-step kk in group gi, as (t4, t4 + 4), (t4 + 8, t4 + 12).
      auto v_scales = [&](int gi, int kk, __half2& s01, __half2& s23) {
        const float* sc = rs + gi * kTok + kk + t4;
        s01 = __floats2half2_rn(sc[0], sc[4]);
        s23 = __floats2half2_rn(sc[8], sc[12]);
      };
#pragma unroll
      for (int kk = 0; kk < kTok; kk += 16) {
        uint32_t a[4];
        ldmatrix_x4(a, pa + kk);
        __half2 s01, s23;
        if constexpr (kScaleP) {
          v_scales(nw * C::kVCols / 128, kk, s01, s23);
          a[0] = hmul2_u32(a[0], s01);
          a[1] = hmul2_u32(a[1], s01);
          a[2] = hmul2_u32(a[2], s23);
          a[3] = hmul2_u32(a[3], s23);
        }
        const unsigned char* vrow = tile + (kk + t4) * LS + nw * C::kVCols + 4 * g;  // tokens kk + t4 + 4 i
#pragma unroll
        for (int c = 0; c < C::kVCols; c += 32) {
          if constexpr (!kScaleP) v_scales((nw * C::kVCols + c) / 128, kk, s01, s23);
          uint32_t w[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) w[i] = *reinterpret_cast<const uint32_t*>(vrow + i * 4 * LS + c);
          // Per dim pair: (token 0, token 4) and (token 8, token 12) interleaved byte by byte.
          const uint32_t x01 = __byte_perm(w[0], w[1], 0x5140), x23 = __byte_perm(w[0], w[1], 0x7362);
          const uint32_t y01 = __byte_perm(w[2], w[3], 0x5140), y23 = __byte_perm(w[2], w[3], 0x7362);
          uint32_t b0[4], b1[4];
          e4m3x4_to_f16(x01, b0[0], b0[1]);
          e4m3x4_to_f16(x23, b0[2], b0[3]);
          e4m3x4_to_f16(y01, b1[0], b1[1]);
          e4m3x4_to_f16(y23, b1[2], b1[3]);
#pragma unroll
          for (int i = 0; i < 4; ++i)
            Op::mma(acc[c / 8 + i], a, kScaleP ? b0[i] : hmul2_u32(b0[i], s01),
                    kScaleP ? b1[i] : hmul2_u32(b1[i], s23));
        }
      }
    }
    __syncthreads();  // the buffers, P and the statistics are rewritten by the next tile
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + row0 + 8 * r;
    if (h >= H) continue;
    const float inv = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;
    const int64_t orow = int64_t(b) * H + h;
    float* dst = (splits == 1 ? o + orow * kRkv : part + ((int64_t(b) * splits + sp) * H + h) * kRkv) + nw * C::kVCols;
    if (splits > 1 && nw == 0 && t4 == 0)
      part_lse[(int64_t(b) * splits + sp) * H + h] = l_run[r] > 0.f ? m_run[r] + log2f(l_run[r]) : kNegInf;
    if constexpr (!kFp8) {
#pragma unroll
      for (int n = 0; n < C::kNTiles; ++n)
        *reinterpret_cast<float2*>(dst + n * 8 + 2 * t4) = make_float2(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
    } else {  // column e of n-tile 4 c + i is dim 32 c + 8 t4 + 4 e + i
#pragma unroll
      for (int c = 0; c < C::kNTiles / 4; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          *reinterpret_cast<float4*>(dst + 32 * c + 8 * t4 + 4 * e) =
              make_float4(acc[4 * c][2 * r + e] * inv, acc[4 * c + 1][2 * r + e] * inv,
                          acc[4 * c + 2][2 * r + e] * inv, acc[4 * c + 3][2 * r + e] * inv);
    }
  }
}

// ---- CUDA-core path: one CTA of 4 warps per (head, split, sequence), FP32 throughout ----
constexpr int kCcWarps = 4, kCcMaxPerLane = 32;  // rkv + dr <= 1024

// Element c of the cache row at `slot`, as f32. kCache: 0 f32 rows, 1 bf16 rows, 2 fp8 form.
template <int kCache>
__device__ __forceinline__ float cache_value(const void* rows, const uint8_t* lat, const float* lat_scale,
                                             const __nv_bfloat16* rope, int64_t slot, int c, int rkv, int dr) {
  const int W = rkv + dr;
  if constexpr (kCache == 0) return static_cast<const float*>(rows)[slot * W + c];
  if constexpr (kCache == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(rows)[slot * W + c]);
  if constexpr (kCache == 2) {
    if (c >= rkv) return __bfloat162float(rope[slot * dr + (c - rkv)]);
    const __nv_fp8_e4m3 e = *reinterpret_cast<const __nv_fp8_e4m3*>(lat + slot * rkv + c);
    return float(e) * lat_scale[slot * (rkv / 128) + c / 128];
  }
  return 0.f;
}

template <int kCache>
__global__ void __launch_bounds__(kCcWarps * 32)
    mla_decode_cc_kernel(const float* __restrict__ q, const void* __restrict__ rows, const uint8_t* __restrict__ lat,
                         const float* __restrict__ lat_scale, const __nv_bfloat16* __restrict__ rope,
                         const int32_t* __restrict__ table, const int32_t* __restrict__ lengths, int H, int rkv,
                         int dr, int max_blocks, int64_t slots, int splits, int blocks_per_split, int length_target,
                         float scale_log2, float* __restrict__ o, float* __restrict__ part,
                         float* __restrict__ part_lse) {
  extern __shared__ float cc_smem[];  // [kCcWarps][rkv] accumulators, then [kCcWarps] maxima and sums
  const int W = rkv + dr, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.x % H, sp = blockIdx.x / H, b = blockIdx.y;
  const SplitRange range = split_range(lengths, b, sp, blocks_per_split, length_target, max_blocks);
  const float* qr = q + (int64_t(b) * H + h) * W;
  float qv[kCcMaxPerLane], acc[kCcMaxPerLane];
#pragma unroll
  for (int i = 0; i < kCcMaxPerLane; ++i) {
    const int c = lane + 32 * i;
    qv[i] = c < W ? qr[c] : 0.f;
    acc[i] = 0.f;
  }
  float m = kNegInf, l = 0.f;
  for (int p = range.begin + warp; p < range.end; p += kCcWarps) {
    const int64_t base = block_slot(table, b, max_blocks, p, slots);
    if (base < 0) continue;
    const int64_t slot = base + p % int(kMlaBlockTokens);
    float kv[kCcMaxPerLane], dot = 0.f;
#pragma unroll
    for (int i = 0; i < kCcMaxPerLane; ++i) {
      const int c = lane + 32 * i;
      kv[i] = c < W ? cache_value<kCache>(rows, lat, lat_scale, rope, slot, c, rkv, dr) : 0.f;
      dot = fmaf(qv[i], kv[i], dot);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float sc = dot * scale_log2, m_new = fmaxf(m, sc);
    const float alpha = exp2f(m - m_new), pr = exp2f(sc - m_new);
    l = l * alpha + pr;
#pragma unroll
    for (int i = 0; i < kCcMaxPerLane; ++i) acc[i] = acc[i] * alpha + (lane + 32 * i < rkv ? pr * kv[i] : 0.f);
    m = m_new;
  }
  float* sacc = cc_smem;
  float* sm = cc_smem + kCcWarps * rkv;
  float* sl = sm + kCcWarps;
#pragma unroll
  for (int i = 0; i < kCcMaxPerLane; ++i)
    if (lane + 32 * i < rkv) sacc[warp * rkv + lane + 32 * i] = acc[i];
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
  __syncthreads();
  float M = kNegInf;
  for (int w = 0; w < kCcWarps; ++w) M = fmaxf(M, sm[w]);
  float wt[kCcWarps], L = 0.f;
  for (int w = 0; w < kCcWarps; ++w) {
    wt[w] = sm[w] == kNegInf ? 0.f : exp2f(sm[w] - M);
    L += sl[w] * wt[w];
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  float* dst = splits == 1 ? o + (int64_t(b) * H + h) * rkv : part + ((int64_t(b) * splits + sp) * H + h) * rkv;
  for (int c = threadIdx.x; c < rkv; c += kCcWarps * 32) {
    float v = 0.f;
    for (int w = 0; w < kCcWarps; ++w) v += sacc[w * rkv + c] * wt[w];
    dst[c] = v * inv;
  }
  if (splits > 1 && threadIdx.x == 0) part_lse[(int64_t(b) * splits + sp) * H + h] = L > 0.f ? M + log2f(L) : kNegInf;
}

// ---- the merge of the splits: o = sum_s exp2(lse_s - lse) o_s, s in order ----
// Block (row, 64 columns): the row's split weights once into shared memory (their maximum by a
// reduction, exact in any order; their sum L in split order by one thread), then a thread per
// column sums the splits' partial outputs in split order. The loads do not depend on the sums, so
// the unrolled loop keeps many in flight: a long context's 128 splits at B = 1 cost their bytes,
// not a DRAM round trip each. The arithmetic and its order are those of one thread per row and
// column, so the bits are too.
constexpr int kMergeThreads = 64;
__global__ void __launch_bounds__(kMergeThreads)
    mla_decode_combine_kernel(const float* __restrict__ part, const float* __restrict__ part_lse, int H, int rkv,
                              int splits, float* __restrict__ o) {
  __shared__ float w[kMaxSplits];
  __shared__ float red[kMergeThreads / 32], sL;
  const int row = blockIdx.x, b = row / H, h = row % H, tid = threadIdx.x;
  const float* lse = part_lse + int64_t(b) * splits * H + h;  // split s at lse[s * H]
  float M = kNegInf;
  for (int s = tid; s < splits; s += kMergeThreads) M = fmaxf(M, lse[int64_t(s) * H]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  if (tid % 32 == 0) red[tid / 32] = M;
  __syncthreads();
  M = red[0];
#pragma unroll
  for (int i = 1; i < kMergeThreads / 32; ++i) M = fmaxf(M, red[i]);
  for (int s = tid; s < splits; s += kMergeThreads) w[s] = M != kNegInf ? exp2f(lse[int64_t(s) * H] - M) : 0.f;
  __syncthreads();
  if (tid == 0) {
    float L = 0.f;
    for (int s = 0; s < splits; ++s) L += w[s];
    sL = L;
  }
  __syncthreads();
  const int c = blockIdx.y * kMergeThreads + tid;
  if (c >= rkv) return;
  const float* src = part + (int64_t(b) * splits * H + h) * rkv + c;  // split s at src[s * H * rkv]
  const int64_t stride = int64_t(H) * rkv;
  // -0 is the sum's identity: one nonempty split passes through bit for bit, as when a sequence of
  // one split writes o directly (by_length's empty splits add nothing either).
  float v = -0.f;
#pragma unroll 16
  for (int s = 0; s < splits; ++s) {
    const float x = src[s * stride];
    if (w[s] > 0.f) v += w[s] * x;
  }
  o[int64_t(row) * rkv + c] = M != kNegInf ? v / sL : 0.f;
}

// The tensor-core instantiations: (rkv, dr).
bool tc_shape(int64_t rkv, int64_t dr) {
  return (rkv == 512 && dr == 64) || (rkv == 256 && dr == 32) || (rkv == 128 && dr == 32);
}

// The tensor-core CTAs one SM holds at once: as many as its shared memory takes (the registers
// and threads of those CTAs fit beside them). A CTA of 16 heads takes under half an SM's shared
// memory: two run side by side, twice the cache bytes in flight.
template <int kRkv, int kDr>
int64_t tc_ctas_per_sm(int heads_per_cta, bool fp8) {
  const size_t bytes = heads_per_cta == 16   ? TcConfig<kRkv, kDr, 1>::smem(fp8)
                       : heads_per_cta == 32 ? TcConfig<kRkv, kDr, 2>::smem(fp8)
                                             : TcConfig<kRkv, kDr, 4>::smem(fp8);
  const cudaDeviceProp& d = device_props();
  return std::max<int64_t>(1, int64_t(d.sharedMemPerMultiprocessor / (bytes + d.reservedSharedMemPerBlock)));
}

int64_t tc_ctas_per_sm(int64_t rkv, int heads_per_cta, bool fp8) {
  if (rkv == 512) return tc_ctas_per_sm<512, 64>(heads_per_cta, fp8);
  if (rkv == 256) return tc_ctas_per_sm<256, 32>(heads_per_cta, fp8);
  return tc_ctas_per_sm<128, 32>(heads_per_cta, fp8);
}

struct LaunchArgs {
  const float* q;
  const MlaCacheView* cache;
  const int32_t *table, *lengths;
  MlaDecodeShape s;
  MlaDecodePlan plan;
  float scale_log2;
  float *o, *part, *part_lse;
  cudaStream_t stream;
};

template <int kRkv, int kDr, int kMH, bool kFp8>
void launch_tc(const LaunchArgs& a) {
  using C = TcConfig<kRkv, kDr, kMH>;
  const size_t smem = C::smem(kFp8);
  auto kernel = mla_decode_tc_kernel<kRkv, kDr, kMH, kFp8>;
  // Above the default 48 KiB; set once per instantiation (the attribute call costs as much as a
  // small launch), one device per process as the rest of the backend assumes.
  static const bool smem_allowed = [&] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    return true;
  }();
  (void)smem_allowed;
  const dim3 grid(unsigned(a.plan.head_tiles * a.plan.splits), unsigned(a.s.B));
  const MlaCacheView& c = *a.cache;
  kernel<<<grid, C::kThreads, smem, a.stream>>>(
      a.q, kFp8 ? nullptr : c.rows.ptr<const __nv_bfloat16>(), kFp8 ? c.latent.ptr<const uint8_t>() : nullptr,
      kFp8 ? c.scale.ptr<const float>() : nullptr, kFp8 ? c.rope.ptr<const __nv_bfloat16>() : nullptr, a.table,
      a.lengths, int(a.s.H), int(a.s.max_blocks), a.s.slots, int(a.plan.head_tiles), int(a.plan.splits),
      int(a.plan.blocks_per_split), int(a.plan.length_target), a.scale_log2, a.o, a.part, a.part_lse);
  FP8MOE_CUDA_CHECK_LAUNCH("mla_decode_tc_kernel");
}

template <int kRkv, int kDr, bool kFp8>
void launch_tc_heads(const LaunchArgs& a) {
  switch (a.plan.heads_per_cta) {
    case 16: launch_tc<kRkv, kDr, 1, kFp8>(a); break;
    case 32: launch_tc<kRkv, kDr, 2, kFp8>(a); break;
    default: launch_tc<kRkv, kDr, 4, kFp8>(a); break;
  }
}

template <bool kFp8>
void launch_tc_shape(const LaunchArgs& a) {
  if (a.s.rkv == 512) launch_tc_heads<512, 64, kFp8>(a);
  else if (a.s.rkv == 256) launch_tc_heads<256, 32, kFp8>(a);
  else launch_tc_heads<128, 32, kFp8>(a);
}

template <int kCache>
void launch_cc(const LaunchArgs& a) {
  const size_t smem = sizeof(float) * size_t(kCcWarps) * size_t(a.s.rkv + 2);  // <= 16 KiB: rkv < 1024
  auto kernel = mla_decode_cc_kernel<kCache>;
  const dim3 grid(unsigned(a.s.H * a.plan.splits), unsigned(a.s.B));
  const MlaCacheView& c = *a.cache;
  kernel<<<grid, kCcWarps * 32, smem, a.stream>>>(
      a.q, kCache == 2 ? nullptr : c.rows.data, kCache == 2 ? c.latent.ptr<const uint8_t>() : nullptr,
      kCache == 2 ? c.scale.ptr<const float>() : nullptr, kCache == 2 ? c.rope.ptr<const __nv_bfloat16>() : nullptr,
      a.table, a.lengths, int(a.s.H), int(a.s.rkv), int(a.s.dr), int(a.s.max_blocks), a.s.slots, int(a.plan.splits),
      int(a.plan.blocks_per_split), int(a.plan.length_target), a.scale_log2, a.o, a.part, a.part_lse);
  FP8MOE_CUDA_CHECK_LAUNCH("mla_decode_cc_kernel");
}

}  // namespace

MlaDecodePlan mla_decode_plan(const MlaDecodeShape& s, const TensorView& q, const MlaCacheView& cache,
                              MlaDecodePath path, int64_t splits, MlaDecodeSplits rule) {
  MlaDecodePlan p;
  const bool tc_ok = s.cache != DType::f32 && tc_shape(s.rkv, s.dr) && aligned16(q.data) &&
                     (cache.fp8() ? aligned16(cache.latent.data) && aligned16(cache.rope.data)
                                  : aligned16(cache.rows.data));
  if (path == MlaDecodePath::automatic) path = tc_ok ? MlaDecodePath::tensor_core : MlaDecodePath::cuda_core;
  FP8MOE_CHECK(path != MlaDecodePath::tensor_core || tc_ok,
               "mla_decode_attention: the tensor-core path takes bf16 or fp8 caches with (rkv, dr) = (512, 64), "
               "(256, 32) or (128, 32) and 16-byte aligned q and rows; got "
                   << dtype_name(s.cache) << ", (" << s.rkv << ", " << s.dr << ")");
  FP8MOE_CHECK(path != MlaDecodePath::cuda_core || s.rkv + s.dr <= 32 * kCcMaxPerLane,
               "mla_decode_attention: rkv + dr = " << s.rkv + s.dr << " exceeds the CUDA-core path's "
                                                   << 32 * kCcMaxPerLane);
  p.path = path;
  if (path == MlaDecodePath::tensor_core) {
    p.heads_per_cta = s.H <= 16 ? 16 : s.H <= 32 ? 32 : 64;
    p.head_tiles = (s.H + p.heads_per_cta - 1) / p.heads_per_cta;
  } else {
    p.heads_per_cta = 1;
    p.head_tiles = s.H;
  }
  const int64_t blocks = std::max<int64_t>(1, s.max_blocks);
  // The split count nearest to one wave for `batch` sequences: 1.45 waves would run as 2.
  auto fit = [&](int64_t batch) {
    const int64_t per_sm = path == MlaDecodePath::tensor_core
                               ? tc_ctas_per_sm(s.rkv, int(p.heads_per_cta), s.cache == DType::e4m3)
                               : 8;
    const int64_t ctas = batch * p.head_tiles, wave = int64_t(device_props().multiProcessorCount) * per_sm;
    return std::max<int64_t>(1, (wave + ctas / 2) / ctas);
  };
  if (rule == MlaDecodeSplits::by_length) {
    // Every sequence splits as it would alone: the grid covers the most splits any length up to
    // the table's can take (split_blocks never gives more than min(blocks, target)).
    p.length_target = std::min(fit(1), kMaxSplits);
    p.blocks_per_split = 0;
    p.splits = std::min(blocks, p.length_target);
    return p;
  }
  p.blocks_per_split = split_blocks(blocks, splits > 0 ? splits : fit(s.B));
  p.splits = (blocks + p.blocks_per_split - 1) / p.blocks_per_split;
  return p;
}

void mla_decode_attention_cuda(const TensorView& q, const MlaCacheView& cache, const TensorView& table,
                               const TensorView& lengths, double scale, const TensorView& o, cudaStream_t stream,
                               MlaDecodePath path, int64_t splits, MlaDecodeSplits rule) {
  const MlaDecodeShape s = check_mla_decode(q, cache, table, lengths, o, Device::cuda);
  FP8MOE_CHECK(s.B <= 65535, "mla_decode_attention: B = " << s.B << " exceeds 65535 sequences per call");
  FP8MOE_CHECK(s.max_blocks * kMlaBlockTokens < (int64_t(1) << 30),
               "mla_decode_attention: table of " << s.max_blocks << " blocks is too long");
  FP8MOE_CHECK(rule == MlaDecodeSplits::fit_batch || splits == 0,
               "mla_decode_attention: a forced split count (" << splits << ") needs MlaDecodeSplits::fit_batch");
  const MlaDecodePlan plan = mla_decode_plan(s, q, cache, path, splits, rule);
  const int64_t rows = s.B * s.H;
  ops::DeviceBuffer part(plan.splits > 1 ? sizeof(float) * size_t(plan.splits * rows * s.rkv) : 0, stream);
  ops::DeviceBuffer part_lse(plan.splits > 1 ? sizeof(float) * size_t(plan.splits * rows) : 0, stream);
  LaunchArgs a{q.ptr<const float>(), &cache, table.ptr<const int32_t>(), lengths.ptr<const int32_t>(), s, plan,
               float(scale * M_LOG2E), o.ptr<float>(), part.as<float>(), part_lse.as<float>(), stream};
  if (plan.path == MlaDecodePath::tensor_core) {
    if (cache.fp8()) launch_tc_shape<true>(a);
    else launch_tc_shape<false>(a);
  } else if (cache.fp8()) {
    launch_cc<2>(a);
  } else if (s.cache == DType::bf16) {
    launch_cc<1>(a);
  } else {
    launch_cc<0>(a);
  }
  if (plan.splits > 1) {
    const dim3 grid(unsigned(rows), unsigned((s.rkv + kMergeThreads - 1) / kMergeThreads));
    mla_decode_combine_kernel<<<grid, kMergeThreads, 0, stream>>>(part.as<float>(), part_lse.as<float>(), int(s.H),
                                                                  int(s.rkv), int(plan.splits), o.ptr<float>());
    FP8MOE_CUDA_CHECK_LAUNCH("mla_decode_combine_kernel");
  }
}

}  // namespace fp8moe::cuda
