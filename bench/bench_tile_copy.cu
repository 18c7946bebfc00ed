// The requantizer's memory traffic without its arithmetic (`fp8moe bench quant`): x [T, C] bytes
// loaded by TMA in tiles of `tokens` rows x 128 channels and stored by TMA, unchanged, as
// [128 channels][128 tokens] boxes at the transposed place of q [C, T], through a ring of `stages`
// stages, by `ctas_per_sm` persistent CTAs per SM walking the tiles as requantize_128x1 does
// (quantize.cu). One thread per CTA works: it is the TMA traffic alone that is timed, the bound of
// any kernel of this tiling. T % tokens == 0, C % 128 == 0.
#include <cuda_runtime.h>

#include "bench/bench_util.hpp"
#include "cuda/gemm/kernels/ptx.cuh"
#include "cuda/gemm/tensor_map.hpp"

namespace fp8moe::cuda::bench {

namespace {

constexpr int kMaxStages = 8;

__global__ void __launch_bounds__(32) tile_copy_kernel(const __grid_constant__ CUtensorMap x_map,
                                                       const __grid_constant__ CUtensorMap q_map, int64_t T, int64_t C,
                                                       int tokens, int stages) {
  namespace p = ptx;
  extern __shared__ uint8_t tc_raw[];
  uint8_t* const ring = tc_raw + ((1024 - p::smem_addr(tc_raw) % 1024) % 1024);  // 128B swizzle: 1024-aligned
  __shared__ uint64_t full[kMaxStages];
  if (threadIdx.x != 0) return;
  const int tile_bytes = tokens * 128;
  const int64_t CB = C / 128, tiles = CB * (T / tokens);
  for (int i = 0; i < stages; ++i) p::mbar_init(&full[i], 1);
  p::fence_barrier_init();
  int64_t next = blockIdx.x;
  int load_stage = 0;
  auto issue = [&] {
    if (next >= tiles) return;
    p::mbar_arrive_expect_tx(&full[load_stage], tile_bytes);
    p::tma_load_2d(&x_map, &full[load_stage], ring + load_stage * tile_bytes, int32_t(next % CB) * 128,
                   int32_t(next / CB) * tokens);
    next += gridDim.x;
    load_stage = load_stage == stages - 1 ? 0 : load_stage + 1;
  };
  for (int i = 0; i < stages - 1; ++i) issue();
  int stage = 0;
  uint32_t parity = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    p::bulk_wait_read();  // the stage about to be reloaded held the previous tile, stored from it
    issue();
    p::mbar_wait(&full[stage], parity);
    for (int h = 0; h < tokens / 128; ++h)
      p::tma_store_2d(&q_map, ring + stage * tile_bytes + h * 128 * 128, int32_t(t / CB) * tokens + h * 128,
                      int32_t(t % CB) * 128);
    p::bulk_commit();
    if (++stage == stages) stage = 0, parity ^= 1;
  }
  p::bulk_wait();
}

}  // namespace

void tma_tile_copy(const void* x, void* q, int64_t T, int64_t C, const TileCopyShape& shape, cudaStream_t stream) {
  FP8MOE_CHECK(shape.tokens % 128 == 0 && shape.tokens <= 256 && T % shape.tokens == 0 && C % 128 == 0,
               "tma_tile_copy: T % tokens, C % 128 must be 0 and tokens 128 or 256, got T=" << T << " C=" << C
                                                                                           << " tokens=" << shape.tokens);
  FP8MOE_CHECK(shape.stages >= 2 && shape.stages <= kMaxStages && shape.ctas_per_sm >= 1,
               "tma_tile_copy: 2..8 stages and >= 1 CTA per SM, got " << shape.stages << ", " << shape.ctas_per_sm);
  const CUtensorMap x_map = make_tmap_2d(x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(C), uint64_t(T), uint64_t(C), 128,
                                         uint32_t(shape.tokens), CU_TENSOR_MAP_SWIZZLE_NONE, "tile copy x");
  const CUtensorMap q_map = make_tmap_2d(q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(T), uint64_t(C), uint64_t(T), 128,
                                         128, CU_TENSOR_MAP_SWIZZLE_128B, "tile copy q");
  const int smem = 1024 + shape.stages * shape.tokens * 128;
  FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(tile_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tile_copy_kernel, 32, smem));
  FP8MOE_CHECK(per_sm >= shape.ctas_per_sm, "tma_tile_copy: " << shape.ctas_per_sm << " CTAs of " << smem
                                                                << " bytes of shared memory do not fit on an SM");
  // As many CTAs as run at once, each taking an equal share of the tiles (within one).
  const int64_t tiles = (C / 128) * (T / shape.tokens);
  const int64_t resident = int64_t(shape.ctas_per_sm) * device_props().multiProcessorCount;
  const int64_t rounds = (tiles + resident - 1) / resident;
  tile_copy_kernel<<<int((tiles + rounds - 1) / rounds), 32, smem, stream>>>(x_map, q_map, T, C, shape.tokens,
                                                                            shape.stages);
  FP8MOE_CUDA_CHECK_LAUNCH("tile_copy_kernel");
}

}  // namespace fp8moe::cuda::bench
