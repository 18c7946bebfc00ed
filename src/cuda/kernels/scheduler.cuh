// Persistent tile scheduler for the GEMM kernels: CTA b takes tiles b, b + gridDim.x, ... of
// the output, enumerated in L2-friendly groups. Layer 3 of src/cuda/kernels.
//
// Rasterization: the N blocks are cut into groups of kGroupN; inside a group the tiles run
// n-fastest, then m. The ~132 tiles in flight at once then share a few A row-panels and at most
// kGroupN B row-panels, so both stay in L2 across the K loop.
#pragma once
#include <cstdint>

namespace fp8moe::cuda {

struct TileScheduler {
  static constexpr uint32_t kGroupN = 16;

  uint32_t num_m_blocks, num_n_blocks, num_tiles;

  __device__ __forceinline__ TileScheduler(uint32_t M, uint32_t N, uint32_t block_m, uint32_t block_n)
      : num_m_blocks((M + block_m - 1) / block_m),
        num_n_blocks((N + block_n - 1) / block_n),
        num_tiles(num_m_blocks * num_n_blocks) {}

  // Tile `t` (< num_tiles) -> (m block, n block).
  __device__ __forceinline__ void tile_coords(uint32_t t, uint32_t& m_blk, uint32_t& n_blk) const {
    const uint32_t per_group = kGroupN * num_m_blocks;
    const uint32_t group = t / per_group;
    const uint32_t first_n = group * kGroupN;
    const uint32_t group_n = min(kGroupN, num_n_blocks - first_n);
    const uint32_t in_group = t - group * per_group;
    m_blk = in_group / group_n;
    n_blk = first_n + in_group % group_n;
  }
};

}  // namespace fp8moe::cuda
