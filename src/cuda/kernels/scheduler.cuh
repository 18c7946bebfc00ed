// Persistent tile scheduler for the GEMM kernels: CTA b takes tiles b, b + gridDim.x, ... of
// the output, enumerated in L2-friendly groups. Layer 3 of src/cuda/kernels.
// With TMA multicast over a cluster of kMC CTAs, the unit of work is kMC vertically adjacent
// tiles (same N block, so the B tile is shared): cluster c takes units c, c + clusters, ..., and
// its CTA of rank r the M block kMC * unit_m + r (past the last M block: a "phantom" tile whose
// loads are clamped and whose stores are all masked, kept so both CTAs run the same pipeline).
//
// Rasterization: the N blocks are cut into groups of group_n (GemmTile::raster_n, 16 unless the
// caller picks another); inside a group the tiles run n-fastest, then m. The ~132 tiles in flight
// at once then share a few A row-panels and at most group_n B row-panels, so both stay in L2
// across the K loop.
#pragma once
#include <cstdint>

namespace fp8moe::cuda {

struct TileScheduler {
  uint32_t num_m_blocks, num_n_blocks, num_tiles;
  uint32_t group_n;       // N blocks per rasterization group

  uint32_t mc;            // CTAs per cluster sharing B (1 or 2)
  uint32_t num_m_units;   // ceil(num_m_blocks / mc)

  // num_tiles counts units of mc tiles.
  __device__ __forceinline__ TileScheduler(uint32_t M, uint32_t N, uint32_t block_m, uint32_t block_n, uint32_t mc_,
                                           uint32_t group_n_)
      : num_m_blocks((M + block_m - 1) / block_m),
        num_n_blocks((N + block_n - 1) / block_n),
        num_tiles(((num_m_blocks + mc_ - 1) / mc_) * num_n_blocks),
        group_n(group_n_),
        mc(mc_),
        num_m_units((num_m_blocks + mc_ - 1) / mc_) {}

  // Unit `t` (< num_tiles) and CTA rank -> (m block, n block); m_blk may be a phantom (>= num_m_blocks).
  __device__ __forceinline__ void tile_coords(uint32_t t, uint32_t rank, uint32_t& m_blk, uint32_t& n_blk) const {
    const uint32_t per_group = group_n * num_m_units;
    const uint32_t group = t / per_group;
    const uint32_t first_n = group * group_n;
    const uint32_t width = min(group_n, num_n_blocks - first_n);
    const uint32_t in_group = t - group * per_group;
    m_blk = (in_group / width) * mc + rank;
    n_blk = first_n + in_group % width;
  }
};

}  // namespace fp8moe::cuda
