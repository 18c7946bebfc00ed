// GEMM epilogue: writes a warpgroup's FP32 accumulator fragment (m64 x BLOCK_N, layout in
// mma.cuh) to D [M, N] row-major, BF16 or FP32, optionally accumulating into FP32 D.
// Layer 4 of src/cuda/kernels. Rows >= M and columns >= N are masked.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace fp8moe::cuda {

struct EpilogueArgs {
  void* d;           // D [M, N] f32 | bf16, row stride ldd elements
  int64_t ldd;
  uint32_t M, N;
  bool d_f32;        // else bf16
  bool accumulate;   // D += result (f32 only)
  bool pair_ok;      // two adjacent columns can be written as one 8/4-byte access
};

// acc: this thread's fragment; row0: global row of d[0] (= tile row + 16*warp + lane/4);
// col0: global column of d[0] (= tile column + 2*(lane%4)).
template <int BLOCK_N>
__device__ __forceinline__ void store_fragment(const float (&acc)[BLOCK_N / 2], const EpilogueArgs& e,
                                               uint32_t row0, uint32_t col0) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t r = row0 + 8 * i;
    if (r >= e.M) continue;
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

}  // namespace fp8moe::cuda
