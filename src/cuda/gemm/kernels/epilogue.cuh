// GEMM epilogues: a warpgroup's FP32 accumulator fragment (m64 x BLOCK_N, layout in mma.cuh)
// to D [M, N] row-major, BF16 or FP32, optionally accumulating into FP32 D. Layer 4 of
// src/cuda/kernels.
//   store_fragment      direct global stores, rows >= M and columns >= N masked (any D);
//   stage_fragment      into a 128B-swizzled shared-memory tile that TMA then stores (or adds)
//                       asynchronously, clipped at the tensor bounds (D rows 16-byte aligned);
//   copy_box_rows       a staged box's rows to D by the warpgroup's threads, row by row (grouped
//                       GEMMs: a box with rows to write beside rows to leave alone).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemm/kernels/ptx.cuh"

namespace fp8moe::cuda {

struct EpilogueArgs {
  void* d;           // D [M, N] f32 | bf16, row stride ldd elements
  int64_t ldd;
  uint32_t M, N;
  bool d_f32;        // else bf16
  bool accumulate;   // D += result (f32 only)
  bool pair_ok;      // two adjacent columns can be written as one 8/4-byte access
  bool tma_store;    // D goes through the staging tile and TMA (dtype matches the kernel's staging)
};

// acc: this thread's fragment; row0: global row of d[0] (= tile row + 16*warp + lane/4);
// col0: global column of d[0] (= tile column + 2*(lane%4)); rows: bit i set = row row0 + 8*i may
// be written (the grouped kernels mask rows of other groups and padding).
template <int BLOCK_N>
__device__ __forceinline__ void store_fragment(const float (&acc)[BLOCK_N / 2], const EpilogueArgs& e,
                                               uint32_t row0, uint32_t col0, uint32_t rows = 3) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t r = row0 + 8 * i;
    if (r >= e.M || !((rows >> i) & 1)) continue;
    if (e.d_f32) {
      float* row = static_cast<float*>(e.d) + int64_t(r) * e.ldd;
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        const uint32_t c = col0 + 8 * j;
        float v0 = acc[4 * j + 2 * i], v1 = acc[4 * j + 2 * i + 1];
        if (e.pair_ok && c + 1 < e.N) {
          float2* p = reinterpret_cast<float2*>(row + c);
          if (e.accumulate) {
            const float2 old = *p;
            v0 += old.x;
            v1 += old.y;
          }
          *p = make_float2(v0, v1);
        } else {
          if (c < e.N) row[c] = e.accumulate ? row[c] + v0 : v0;
          if (c + 1 < e.N) row[c + 1] = e.accumulate ? row[c + 1] + v1 : v1;
        }
      }
    } else {
      __nv_bfloat16* row = static_cast<__nv_bfloat16*>(e.d) + int64_t(r) * e.ldd;
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) {
        const uint32_t c = col0 + 8 * j;
        const float v0 = acc[4 * j + 2 * i], v1 = acc[4 * j + 2 * i + 1];
        if (e.pair_ok && c + 1 < e.N) {
          *reinterpret_cast<__nv_bfloat162*>(row + c) = __floats2bfloat162_rn(v0, v1);
        } else {
          if (c < e.N) row[c] = __float2bfloat16_rn(v0);
          if (c + 1 < e.N) row[c + 1] = __float2bfloat16_rn(v1);
        }
      }
    }
  }
}

// Shared-memory staging tile of one warpgroup: kBoxes boxes of [64 rows, 128 bytes], each
// 128B-swizzled (16-byte chunk c of row r stored at chunk c ^ (r % 8)), the layout a TMA store with
// CU_TENSOR_MAP_SWIZZLE_128B and box [64, 128 / sizeof(OutT)] reads. With kPasses = 2 the tile
// holds half the boxes and the epilogue stages and stores the two halves of the columns in turn.
// NOTES: the swizzle makes the 8 rows a warp writes at once land in 8 different bank groups.
template <int BLOCK_N, bool kF32, int kPasses = 1>
struct StagingTile {
  static constexpr int kElemBytes = kF32 ? 4 : 2;
  static constexpr int kBoxCols = 128 / kElemBytes;      // columns per box
  static constexpr int kBoxes = (BLOCK_N * kElemBytes + 127) / 128;
  static constexpr int kPassBoxes = kBoxes / kPasses;    // boxes staged at once
  static constexpr int kBoxBytes = 64 * 128;
  static constexpr int kBytes = kPassBoxes * kBoxBytes;  // per warpgroup
  static_assert(kBoxes % kPasses == 0, "staging passes of whole boxes");
};

// r: row in the warpgroup's 64 rows (16*warp + lane/4); c: column of d[0] in the tile (2*(lane%4)).
// Stages the columns of pass kPass (boxes [kPass * kPassBoxes, ...)) at the start of the staging
// tile: through the pointer smem, or (kShared) at the shared-memory address smem_s.
template <int BLOCK_N, bool kF32, int kPasses = 1, int kPass = 0, bool kShared = false>
__device__ __forceinline__ void stage_fragment(const float (&acc)[BLOCK_N / 2], uint8_t* smem, uint32_t r0,
                                               uint32_t c0, uint32_t smem_s = 0) {
  using S = StagingTile<BLOCK_N, kF32, kPasses>;
  constexpr int kJ = BLOCK_N / 8 / kPasses;  // 8-column groups per pass
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t r = r0 + 8 * i;
#pragma unroll
    for (int j = kPass * kJ; j < (kPass + 1) * kJ; ++j) {
      const uint32_t c = c0 + 8 * j - kPass * kJ * 8;
      const uint32_t box = c / S::kBoxCols;
      const uint32_t byte = (c % S::kBoxCols) * S::kElemBytes;
      const uint32_t addr = box * S::kBoxBytes + r * 128 + (((byte / 16) ^ (r % 8)) * 16) + byte % 16;
      if constexpr (kShared && kF32) {
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(smem_s + addr), "f"(acc[4 * j + 2 * i]),
                     "f"(acc[4 * j + 2 * i + 1])
                     : "memory");
      } else if constexpr (kShared) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1]);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_s + addr), "r"(*reinterpret_cast<const uint32_t*>(&h))
                     : "memory");
      } else if constexpr (kF32) {
        *reinterpret_cast<float2*>(smem + addr) = make_float2(acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1]);
      } else {
        *reinterpret_cast<__nv_bfloat162*>(smem + addr) = __floats2bfloat162_rn(acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1]);
      }
    }
  }
}

// The warpgroup copies the rows r of one staged box ([64 rows, 128 bytes] at the shared address
// box_s, StagingTile's layout; D rows row0 + r, columns from col0) for which row_ok(r), in 16-byte
// pieces, added to D when accumulating (f32). Rows past D's M rows and columns past its N are
// skipped. D's rows 16-byte aligned (as for the TMA store). A loop, not unrolled: it runs for the
// few boxes of a grouped GEMM that mix rows to write with rows to leave alone.
template <bool kF32, class RowOk>
__device__ __forceinline__ void copy_box_rows(uint32_t box_s, const EpilogueArgs& e, uint32_t row0, uint32_t col0,
                                              RowOk row_ok) {
  constexpr uint32_t kElemBytes = kF32 ? 4 : 2, kPieceCols = 16 / kElemBytes;
#pragma unroll 1
  for (uint32_t i = threadIdx.x % 128; i < 64 * 8; i += 128) {
    const uint32_t r = i / 8, piece = i % 8, row = row0 + r, col = col0 + piece * kPieceCols;
    if (row >= e.M || col >= e.N || !row_ok(r)) continue;
    const uint4 v = ptx::lds_b32x4(box_s + r * 128 + ((piece ^ (r % 8)) * 16));
    uint4* p = reinterpret_cast<uint4*>(static_cast<uint8_t*>(e.d) + (int64_t(row) * e.ldd + col) * kElemBytes);
    if (kF32 && e.accumulate) {
      const float4 old = *reinterpret_cast<const float4*>(p);
      *reinterpret_cast<float4*>(p) = make_float4(old.x + __uint_as_float(v.x), old.y + __uint_as_float(v.y),
                                                  old.z + __uint_as_float(v.z), old.w + __uint_as_float(v.w));
    } else {
      *p = v;
    }
  }
}

}  // namespace fp8moe::cuda
