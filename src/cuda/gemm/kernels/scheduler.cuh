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

#include "cuda/gemm/kernels/fast_div.hpp"

namespace fp8moe::cuda {

// The scheduler's divisors: the units of a rasterization group (group_n x the M units), group_n,
// and the last group's width (what is left of the N blocks; group_n when group_n divides them).
// Computed by the launcher (GemmKernelArgs::sched), so that the kernels compute no magic numbers
// (only those whose rows come from a device table do).
// NOTES: as integer divisions the two per tile were ~45 dependent instructions (two MUFU.RCP)
// between a tile's first barrier wait and its first WGMMAs; computing the magic numbers in every
// kernel (~140 instructions run once) costs the short GEMMs at M = 64/128 0.1-0.7 us: a launch
// pays for fetching its code.
struct SchedDivs {
  FastDiv per_group, width, last_width;
};

__host__ __device__ __forceinline__ SchedDivs sched_divs(uint32_t M, uint32_t N, uint32_t block_m, uint32_t block_n,
                                                         uint32_t mc, uint32_t group_n) {
  const uint32_t m_units = ((M + block_m - 1) / block_m + mc - 1) / mc;
  const uint32_t n_blocks = (N + block_n - 1) / block_n;
  const uint32_t last = n_blocks - (n_blocks ? (n_blocks - 1) / group_n * group_n : 0);
  return {FastDiv(group_n * m_units), FastDiv(group_n), FastDiv(last)};
}

struct TileScheduler {
  uint32_t num_m_blocks, num_n_blocks, num_tiles;
  uint32_t mc;            // CTAs per cluster sharing B (1 or 2)
  SchedDivs divs;         // sched_divs of the same arguments (divs.width.d: N blocks per rasterization group)

  // num_tiles counts units of mc tiles.
  __device__ __forceinline__ TileScheduler(uint32_t M, uint32_t N, uint32_t block_m, uint32_t block_n, uint32_t mc_,
                                           const SchedDivs& divs_)
      : num_m_blocks((M + block_m - 1) / block_m),
        num_n_blocks((N + block_n - 1) / block_n),
        num_tiles(((num_m_blocks + mc_ - 1) / mc_) * num_n_blocks),
        mc(mc_),
        divs(divs_) {}

  // Unit `t` (< num_tiles) and CTA rank -> (m block, n block); m_blk may be a phantom (>= num_m_blocks).
  __device__ __forceinline__ void tile_coords(uint32_t t, uint32_t rank, uint32_t& m_blk, uint32_t& n_blk) const {
    const uint32_t group_n = divs.width.d;
    const uint32_t group = divs.per_group.div(t);
    const uint32_t first_n = group * group_n;
    const uint32_t in_group = t - group * divs.per_group.d;
    const FastDiv w = first_n + group_n > num_n_blocks ? divs.last_width : divs.width;
    const uint32_t m_in = w.div(in_group);
    m_blk = m_in * mc + rank;
    n_blk = first_n + in_group - m_in * w.d;
  }
};

}  // namespace fp8moe::cuda
