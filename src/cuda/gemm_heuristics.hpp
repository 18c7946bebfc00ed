// Tile-shape heuristic of the sm_90a FP8 GEMM, kept apart from the kernel (host only).
//
// Model: the persistent grid runs ceil(tiles / SMs) waves; a tile's time per 128-wide K block is
// the larger of its WGMMA time (bm*bn*128*2 FLOP at 8192 FLOP/clk/SM, derated for narrow N) and its
// load time ((bm + bn) * 128 bytes at ~48 B/clk/SM from L2). Cost = waves * per-block time; ties
// go to the larger tile (less global traffic). Small M thus gets narrow N tiles that spread B over
// all SMs. Tiles of 128 rows and up then go through a wave model calibrated on measured times
// (choose_gemm_tile): the pipelined 128x128, 128x192 (fewer waves for N = 2112, fewer epilogues
// for short K) or 256x128.
#pragma once
#include <cstdint>
#include <tuple>
#include <vector>

namespace fp8moe::cuda {

struct GemmTile {
  int block_m = 128;
  int block_n = 128;
  // TMA-store epilogue through shared-memory staging (costs pipeline stages). The one variant
  // compiled without it is 1d2d 128x128, chosen for K >= 4096 (measured on H200: 910 vs 1007 us
  // at 4096x7168x16384, while K <= 2048 gains 8-35% from the staged epilogue).
  bool tma_epilogue = true;
  // CTAs per cluster that share the B tile through TMA multicast (1 or 2, 128x128 only): halves
  // the L2 -> SM traffic of B.
  int multicast = 1;
  // Pipelined mainloop (1d2d, 128-row tiles): each math warpgroup queues the WGMMAs of K block
  // k+1 before it promotes block k, holding two accumulator sets.
  bool pipelined = false;
};

// A compiled tile as a type: gemm_launch.cuh instantiates the kernel for each entry of the lists
// below, and gemm_tiles() lists the same shapes at run time.
template <int BM, int BN, bool kTmaEpi = true, int kMC = 1, bool kPipe = false>
struct TileConfig {
  static constexpr GemmTile tile() { return {BM, BN, kTmaEpi, kMC, kPipe}; }
};
using Tiles1d2d = std::tuple<TileConfig<64, 16>, TileConfig<64, 32>, TileConfig<64, 64>, TileConfig<64, 128>,
                             TileConfig<128, 16>, TileConfig<128, 32>, TileConfig<128, 64>, TileConfig<128, 128>,
                             TileConfig<128, 128, false>, TileConfig<128, 128, true, 2>, TileConfig<128, 128, false, 2>,
                             TileConfig<128, 128, true, 1, true>, TileConfig<128, 128, false, 1, true>,
                             TileConfig<128, 160, false>, TileConfig<128, 192>, TileConfig<128, 192, false>,
                             TileConfig<256, 128, false>>;
using Tiles1d1d = std::tuple<TileConfig<64, 64>, TileConfig<64, 128>, TileConfig<128, 64>, TileConfig<128, 128>,
                             TileConfig<128, 128, true, 2>>;

template <class... C>
std::vector<GemmTile> tile_list(std::tuple<C...>*) {
  return {C::tile()...};
}

// Tile shapes compiled into the library.
inline const std::vector<GemmTile>& gemm_tiles(bool b_1x128) {
  static const std::vector<GemmTile> k1d2d = tile_list(static_cast<Tiles1d2d*>(nullptr));
  static const std::vector<GemmTile> k1d1d = tile_list(static_cast<Tiles1d1d*>(nullptr));
  return b_1x128 ? k1d1d : k1d2d;
}

// Tiles of the grouped GEMMs: at most 128 rows (one expert block) and no multicast, since the
// tiles of a cluster or the halves of a 256-row tile may belong to different groups.
constexpr bool grouped_tile_ok(const GemmTile& t) { return t.block_m <= 128 && t.multicast == 1; }

inline double gemm_tile_cost(const GemmTile& t, int64_t M, int64_t N, int num_sms) {
  const int64_t tiles = ((M + t.block_m - 1) / t.block_m) * ((N + t.block_n - 1) / t.block_n);
  const int64_t waves = (tiles + num_sms - 1) / num_sms;
  const double eff = t.block_n >= 128 ? 1.0 : t.block_n >= 64 ? 0.9 : t.block_n >= 32 ? 0.75 : 0.6;
  const double mma_clk = double(t.block_m) * t.block_n * 128 * 2 / 8192.0 / eff;
  // NOTES: 48 B/clk/SM of L2 -> SM bandwidth fits the measured 128x128 rate (~1070 TFLOPS, 54% of
  // peak) better than the ~64 B/clk peak: large tiles are L2-bound, not WGMMA-bound.
  const double load_clk = double(t.block_m + t.block_n) * 128 / 48.0;
  double per_block = mma_clk > load_clk ? mma_clk : load_clk;
  // Calibration from H200 runs: a 256x128 k-block takes 1.86x a 128x128 one (821 us in 7 waves vs
  // 882 us in 14 waves at 4096x7168x16384).
  if (t.block_m == 256) per_block = 1.86 * (double(128 + 128) * 128 / 48.0);
  return double(waves) * per_block;
}

// grouped: only tiles with grouped_tile_ok (M = the rows of all groups together).
inline GemmTile choose_gemm_tile(int64_t M, int64_t N, int64_t K, bool b_1x128, int num_sms, bool grouped = false) {
  GemmTile best{};
  double best_cost = -1;
  for (const GemmTile& t : gemm_tiles(b_1x128)) {
    if ((!t.tma_epilogue && t.block_m != 256) || t.multicast != 1) continue;  // variants picked below
    if (t.pipelined || t.block_n > 128) continue;  // chosen below
    // 256-row tiles only pay off with long K (measured: for K <= 2048 the staged 128x128 epilogue
    // wins) and many rows.
    if (t.block_m == 256 && (grouped || M < 1024 || K < 4096)) continue;
    const double c = gemm_tile_cost(t, M, N, num_sms);
    const bool larger = t.block_m * t.block_n > best.block_m * best.block_n;
    if (best_cost < 0 || c < best_cost * 0.999 || (c <= best_cost * 1.001 && larger)) {
      best = t;
      best_cost = c;
    }
  }
  if (best.block_m == 128 && best.block_n == 128) {
    if (!b_1x128 && K >= 4096) best.tma_epilogue = false;
    // NOTES: the multicast variant is correct (tested) but measured 2x slower on H200 (it looked
    // like only half the clusters were resident), so it is not picked; `fp8moe bench gemm` times it
    // beside the chosen tile and prints the cluster occupancy.
  }
  // NOTES: the pipelined mainloop is not used for 1x128 B (Wgrad): reading the per-column s_b from
  // shared memory during the promotion made it 13-17% slower than the plain 128x128 (H200).
  // 128x128 B (Fprop/Dgrad), 128-row tiles and up: a calibrated wave model over the three fastest
  // kernels (H200, 2026-11-29, M = 4096). Per wave: num_k_blocks * c_k + c_e (the epilogue), in
  // units of one pipelined 128x128 K block (~0.45 us): 128x128/pipe 1 + 1.9, 128x192 1.415 + 3.1,
  // 256x128/direct 2.02 + 6.4 (K >= 4096 only).
  if (!b_1x128 && best.block_m >= 128 && best.block_n == 128) {
    const double kb = double(K / 128);
    auto waves = [&](int bm, int bn) {
      const int64_t tiles = ((M + bm - 1) / bm) * ((N + bn - 1) / bn);
      return double((tiles + num_sms - 1) / num_sms);
    };
    const double c128 = waves(128, 128) * (kb * 1.0 + 1.9);
    const double c192 = waves(128, 192) * (kb * 1.415 + 3.1);
    const double c256 = !grouped && K >= 4096 && M >= 1024 ? waves(256, 128) * (kb * 2.02 + 6.4) : 1e300;
    if (c128 <= c192 && c128 <= c256) best = {128, 128, true, 1, true};
    else if (c192 <= c256) best = {128, 192, true, 1, false};
    else best = {256, 128, false, 1, false};
  }
  return best;
}

}  // namespace fp8moe::cuda
