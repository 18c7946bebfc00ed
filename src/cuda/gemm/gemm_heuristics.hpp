// Tile-shape heuristic of the sm_90a FP8 GEMM, kept apart from the kernel (host only).
//
// Model: the persistent grid runs ceil(tiles / SMs) waves; a tile's time per 128-wide K block is
// the larger of its WGMMA time (bm*bn*128*2 FLOP at 8192 FLOP/clk/SM, derated for narrow N) and its
// load time ((bm + bn) * 128 bytes at ~48 B/clk/SM from L2). Cost = waves * per-block time; ties
// go to the larger tile (less global traffic). Small M thus gets narrow N tiles that spread B over
// all SMs. Tiles of 128 rows and up then go through a wave model calibrated on measured times
// (choose_gemm_tile): the pipelined 128x128, 128x192 (fewer waves for N = 2112, fewer epilogues
// for short K), 192x128 (three math warpgroups: short K) or 256x128; for f32 D the FP32-staged
// variants of the first three; for bf16 D and long K, with the tiles past the last full wave in K
// slices (GemmTile::tail_split). M <= 64 with few tiles and long K takes K slices on 64x64.
// The dense Wgrad (1x128 B) takes 192x128 over 128x128 where it needs enough fewer waves.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
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
  // 1d2d: the TMA-store epilogue stages FP32 (for f32 D: TMA store, or TMA reduce-add for D +=);
  // else BF16 (for bf16 D). A D of the other dtype takes the direct global-store epilogue. The
  // FP32 staging tile is twice the size and costs a pipeline stage (192x128/f32 and
  // 128x128/pipe/f32 stage half of it at a time, in two store passes: 4 and 5 stages). 1d1d
  // (Wgrad) tiles always stage FP32 and leave this false.
  bool f32_staging = false;
  // N blocks per rasterization group of the tile scheduler (kernels/scheduler.cuh): the tiles in
  // flight at once share at most this many B row-panels.
  int raster_n = 16;
  // K slices (dense 1d2d, 64x64 only): each slice's K blocks into an FP32 workspace, summed in
  // slice order by a second kernel; for few output tiles and long K (64x2112x7168).
  int split_k = 1;
  // Last-wave K slices (dense 1d2d, 128x128/pipe and 192x128, bf16 staging): the tiles past the
  // last full wave of the grid are cut into this many K slices, so that they spread over the
  // SMs; the last slice of a tile to finish adds the slices' FP32 partials in order and stores D.
  int tail_split = 1;
};

// Output tiles of a bm x bn tiling of D [M, N], and the waves of a persistent grid of one CTA per SM
// that runs them.
constexpr int64_t gemm_tile_count(int64_t M, int64_t N, int bm, int bn) { return ((M + bm - 1) / bm) * ((N + bn - 1) / bn); }
constexpr int64_t gemm_waves(int64_t M, int64_t N, int bm, int bn, int64_t num_sms) {
  return (gemm_tile_count(M, N, bm, bn) + num_sms - 1) / num_sms;
}

// Last-wave K slices: the tiles of the grid's full waves (a multiple of the SM count; none when
// there is at most one wave) and the rest, which the slices split.
struct LastWave {
  int64_t full, rest;
};
constexpr LastWave last_wave(int64_t tiles, int64_t num_sms) {
  const int64_t full = tiles > num_sms ? tiles / num_sms * num_sms : 0;
  return {full, tiles - full};
}

// "128x128/pipe/f32/r8": the block shape, then the variants that differ from the defaults.
inline std::string tile_name(const GemmTile& t) {
  std::string s = std::to_string(t.block_m) + "x" + std::to_string(t.block_n);
  if (!t.tma_epilogue) s += "/direct";
  if (t.multicast > 1) s += "/mc" + std::to_string(t.multicast);
  if (t.pipelined) s += "/pipe";
  if (t.f32_staging) s += "/f32";
  if (t.raster_n != GemmTile{}.raster_n) s += "/r" + std::to_string(t.raster_n);
  if (t.split_k > 1) s += "/s" + std::to_string(t.split_k);
  if (t.tail_split > 1) s += "/t" + std::to_string(t.tail_split);
  return s;
}

// A compiled tile as a type: gemm_launch.cuh instantiates the kernel for each entry of the lists
// below, and gemm_tiles() lists the same shapes at run time.
template <int BM, int BN, bool kTmaEpi = true, int kMC = 1, bool kPipe = false, bool kF32Stg = false>
struct TileConfig {
  static constexpr GemmTile tile() { return {BM, BN, kTmaEpi, kMC, kPipe, kF32Stg}; }
};
using Tiles1d2d = std::tuple<TileConfig<64, 16>, TileConfig<64, 32>, TileConfig<64, 64>, TileConfig<64, 128>,
                             TileConfig<128, 16>, TileConfig<128, 32>, TileConfig<128, 64>, TileConfig<128, 128>,
                             TileConfig<128, 128, false>, TileConfig<128, 128, true, 2>, TileConfig<128, 128, false, 2>,
                             TileConfig<128, 128, true, 1, true>, TileConfig<128, 128, false, 1, true>,
                             TileConfig<128, 160, false>, TileConfig<128, 192>, TileConfig<128, 192, false>,
                             TileConfig<256, 128, false>,
                             // Three math warpgroups (dense, and the contiguous grouped GEMM).
                             TileConfig<192, 128>,
                             // FP32 staging (f32 D): the large-problem tiles (4, 3 and 4 stages) and the
                             // 128x64 of one or two row blocks (7).
                             TileConfig<128, 128, true, 1, true, true>, TileConfig<128, 192, true, 1, false, true>,
                             TileConfig<192, 128, true, 1, false, true>, TileConfig<128, 64, true, 1, false, true>>;
// NOTES: no 1d1d 128x128 without the FP32 staging tiles: its 6 stages (against 4) do not pay for
// the direct D += stores (0.66-0.80x the staged tile on the Wgrad shapes). No pipelined mainloop
// for 1d1d either (0.87-0.90x the plain tile, with or without spills): its promotion reads the
// per-column s_b from the stage after the next block's WGMMAs are issued.
using Tiles1d1d = std::tuple<TileConfig<64, 64>, TileConfig<64, 128>, TileConfig<128, 64>, TileConfig<128, 128>,
                             TileConfig<128, 128, true, 2>, TileConfig<192, 128>>;

template <class... C>
std::vector<GemmTile> tile_list(std::tuple<C...>*) {
  return {C::tile()...};
}

// The one tile compiled with K slices (Grouping::split_k): 1d2d 64x64 with the staged epilogue
// flag (its f32 workspace takes the direct stores), any number of slices.
constexpr bool split_k_tile_ok(const GemmTile& t, bool b_1x128) {
  return !b_1x128 && t.block_m == 64 && t.block_n == 64 && t.tma_epilogue && t.multicast == 1 && !t.pipelined &&
         !t.f32_staging;
}

// The tiles compiled with last-wave K slices (Grouping::tail_split), any number of slices: the
// large bf16-staged 1d2d tiles.
constexpr bool tail_split_tile_ok(const GemmTile& t, bool b_1x128) {
  return !b_1x128 && t.block_n == 128 && t.tma_epilogue && t.multicast == 1 && !t.f32_staging && t.split_k == 1 &&
         ((t.block_m == 128 && t.pipelined) || (t.block_m == 192 && !t.pipelined));
}

// 1d2d tiles of 128x128 and more with the TMA-store epilogue: their kernels, dense and m-grouped,
// store D through the staging tile only (GemmTraits::kStagedOnly, the same test), so they need D's
// rows 16-byte aligned and D of their staging dtype (f32 with f32_staging, else bf16).
constexpr bool staged_only_tile(const GemmTile& t, bool b_1x128) {
  return !b_1x128 && t.tma_epilogue && t.block_m != 256 && t.block_m * t.block_n >= 128 * 128;
}

// What runs a staged-only tile's GEMM where D cannot take its TMA stores: the same tile with the
// direct epilogue, without last-wave K slices (192x128, compiled with staging only: the pipelined
// 128x128).
constexpr GemmTile direct_gemm_tile(GemmTile t) {
  if (t.block_m == 192) t.block_m = 128, t.pipelined = true;
  t.tma_epilogue = false;
  t.f32_staging = false;
  t.tail_split = 1;
  return t;
}

// Tile shapes compiled into the library (1d2d: and the 64x64 tile with 2 and 4 K slices, the
// tail-split tiles with 2 and 3 last-wave slices).
inline const std::vector<GemmTile>& gemm_tiles(bool b_1x128) {
  static const std::vector<GemmTile> k1d2d = [] {
    std::vector<GemmTile> v = tile_list(static_cast<Tiles1d2d*>(nullptr));
    for (int s : {2, 4}) {
      GemmTile t{64, 64};
      t.split_k = s;
      v.push_back(t);
    }
    for (const GemmTile& whole : tile_list(static_cast<Tiles1d2d*>(nullptr)))
      if (tail_split_tile_ok(whole, false))
        for (int s : {2, 3}) {
          GemmTile t = whole;
          t.tail_split = s;
          v.push_back(t);
        }
    return v;
  }();
  static const std::vector<GemmTile> k1d1d = tile_list(static_cast<Tiles1d1d*>(nullptr));
  return b_1x128 ? k1d1d : k1d2d;
}

// Pipeline stages of a compiled tile, as GemmTraits computes them (gemm_launch.cuh asserts that
// the two agree): the shared memory left after the epilogue's staging tiles (one per math
// warpgroup, [64, BLOCK_N] bf16 or f32 in boxes of 128 bytes per row; half of it for three
// warpgroups staging f32 and for the pipelined 128x128, which store in two passes), in stages of
// the A, B and scale tiles of one 128-wide K block (1d2d: s_a and the pair of B block scales), at
// most 10.
constexpr int gemm_tile_stages(const GemmTile& t, bool b_1x128) {
  const int math_wg = t.block_m == 256 ? 2 : t.block_m / 64;
  const int waves = t.block_m / (64 * math_wg);
  const int stage_bytes = t.block_m * 128 + t.block_n * 128 + t.block_m * 4 + (b_1x128 ? t.block_n * 4 : 8);
  const int elem = b_1x128 || t.f32_staging ? 4 : 2;
  const int boxes = (t.block_n * elem + 127) / 128;
  const bool staged = t.tma_epilogue && waves == 1 && t.block_n % (128 / elem) == 0;
  const int passes = (math_wg == 3 && elem == 4) || (math_wg == 2 && t.pipelined && t.block_n == 128) ? 2 : 1;
  const int staging = staged ? math_wg * boxes * 64 * 128 / passes : 0;
  const int s = (232448 - 1024 - 512 - staging) / stage_bytes;
  return s > 10 ? 10 : s;
}

// Tiles of the grouped GEMMs: at most 128 rows (one expert block) and no multicast, since the
// tiles of a cluster or the halves of a 256-row tile may belong to different groups; the
// contiguous GEMM also runs the 192-row tiles (three math warpgroups), laid out per segment from a
// device table (kernels/grouping.cuh). The K-grouped Wgrad (1x128 B) has no pipelined mainloop,
// as the dense Wgrad.
constexpr bool grouped_tile_ok(const GemmTile& t, bool b_1x128, bool contiguous = false) {
  return (t.block_m <= 128 || (contiguous && t.block_m == 192)) && t.multicast == 1 && !(b_1x128 && t.pipelined) &&
         t.split_k == 1 && t.tail_split == 1;
}

inline double gemm_tile_cost(const GemmTile& t, int64_t M, int64_t N, int num_sms) {
  const int64_t waves = gemm_waves(M, N, t.block_m, t.block_n, num_sms);
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

// grouped: only tiles with grouped_tile_ok (M = the rows of all groups together). d_f32: D is f32
// (1d2d: picks the FP32-staged variant where one is compiled; 1d1d D is always f32). split: K
// slices allowed (the bench turns them off to time the unsplit choice beside them).
// contiguous_groups: the grouped GEMM is the contiguous one over this many expert segments, which
// may take 192-row tiles.
inline GemmTile choose_gemm_tile(int64_t M, int64_t N, int64_t K, bool b_1x128, int num_sms, bool grouped,
                                 bool d_f32, bool split = true, int64_t contiguous_groups = 0) {
  GemmTile best{};
  double best_cost = -1;
  for (const GemmTile& t : gemm_tiles(b_1x128)) {
    if ((!t.tma_epilogue && t.block_m != 256) || t.multicast != 1) continue;  // variants picked below
    if (t.f32_staging) continue;                                                // f32 D: chosen below
    if (t.pipelined || t.block_n > 128) continue;  // chosen below
    if (t.block_m == 192 || t.split_k > 1 || t.tail_split > 1) continue;  // chosen below
    // 256-row tiles only pay off with long K (measured: for K <= 2048 the staged 128x128 epilogue
    // wins) and many rows.
    if (t.block_m == 256 && (grouped || M < 1024 || K < 4096)) continue;
    const double c = gemm_tile_cost(t, M, N, num_sms);
    // Ties go to the larger tile, and between tiles of one size (1d2d) to the taller one: fewer row
    // blocks read B fewer times (128x64 against 64x128: 1.07-1.26x at M = 128 and 256, dense and
    // masked grouped).
    const bool larger = t.block_m * t.block_n > best.block_m * best.block_n ||
                        (!b_1x128 && t.block_m * t.block_n == best.block_m * best.block_n && t.block_m > best.block_m);
    if (best_cost < 0 || c < best_cost * 0.999 || (c <= best_cost * 1.001 && larger)) {
      best = t;
      best_cost = c;
    }
  }
  // 1x128 B (Wgrad), dense: the 192x128 tile (three math warpgroups) where it takes fewer waves.
  // A wave of it takes 1.45x one of 128x128 tiles (3% less per FLOP: the promotion's FP32 work per
  // FLOP is the same), fitted to the six Wgrad shapes: the tile wins where it needs at most about
  // two thirds of the waves (2112x7168x4096: 5 against 8, 1.075x) and loses where it saves less
  // (32768x512x4096: 6 against 8, 0.92x).
  if (b_1x128 && !grouped && best.block_m == 128 && best.block_n == 128 &&
      1.45 * double(gemm_waves(M, N, 192, 128, num_sms)) < 0.99 * double(gemm_waves(M, N, 128, 128, num_sms)))
    best = {192, 128};
  if (best.block_m == 128 && best.block_n == 128) {
    if (!b_1x128 && K >= 4096) best.tma_epilogue = false;
    // NOTES: the multicast variant (/mc2) is correct (tested) but not picked: a stage is refilled
    // only when the consumers of both CTAs have released it, and that coupling costs more than the
    // halved B traffic saves (0.82-0.84x the chosen tiles at M = 4096); `fp8moe bench gemm` times
    // it beside the chosen tile and prints the cluster occupancy.
  }
  // No pipelined mainloop for 1x128 B (Wgrad; see Tiles1d1d).
  // 128x128 B (Fprop/Dgrad), 128-row tiles and up: a wave model over the three fastest kernels,
  // fitted to their measured times at M = 4096, bf16 D. Per wave: num_k_blocks * c_k + c_e (the
  // epilogue), in units of one pipelined 128x128 K block (~0.45 us): 128x128/pipe 1 + 1.9,
  // 128x192 1.415 + 3.1, 256x128/direct 2.02 + 6.4 (K >= 4096 only).
  // NOTES (f32 D): the FP32-staged variants 128x128/pipe/f32 and 128x192/f32 store through TMA
  // (reduce-add for D +=) while the next tile's WGMMAs run, as bf16 D does: through the direct
  // stores D += is 1.6-1.8x slower and plain f32 D 2-5% slower. Their staging tiles are twice as
  // large, which costs a stage: 128x192/f32 has 3 (bf16: 4), of which its plain mainloop holds one,
  // leaving about two K blocks (~1.3 us) of loads in flight and no slack. So for f32 D the tile
  // with more stages (128x128/pipe/f32: 5, staging half a tile at a time) is preferred, and
  // 128x192/f32 is taken only when the model puts it at least kFewStagesMargin ahead. With
  // kF32Epilogue = 2.0 and kFewStagesMargin = 1.03 the choice between the two staged tiles is within
  // 4% of the better one on the 10 shapes of the gemm config's step.
  if (!b_1x128 && best.block_m >= 128 && best.block_n == 128) {
    const double kb = double(K / 128);
    auto waves = [&](int bm, int bn) { return double(gemm_waves(M, N, bm, bn, num_sms)); };
    constexpr double kF32Epilogue = 2.0, kFewStagesMargin = 1.03;
    constexpr GemmTile t128 = {128, 128, true, 1, true}, t192 = {128, 192, true, 1, false};
    const double ce = d_f32 ? kF32Epilogue : 1.0;
    const bool few_stages_192 =
        d_f32 && gemm_tile_stages({128, 192, true, 1, false, true}, false) < gemm_tile_stages({128, 128, true, 1, true, true}, false);
    const double c128 = waves(128, 128) * (kb * 1.0 + 1.9 * ce);
    const double c192 = waves(128, 192) * (kb * 1.415 + 3.1 * ce) * (few_stages_192 ? kFewStagesMargin : 1.0);
    const double c256 = !grouped && K >= 4096 && M >= 1024 ? waves(256, 128) * (kb * 2.02 + 6.4 * ce) : 1e300;
    // 192x128 (three math warpgroups; dense and contiguous grouped): calibrated against the two
    // above on the same shapes (M = 4096, bf16 D: per wave 0.575 us per K block + 0.78 us, against
    // 0.402 + 0.69 for 128x128/pipe: 1.43 and 2.15 in the model's units), and taken only when the
    // model puts it 1% ahead (where the model calls a tie the two measure within 0.5%). For f32 D
    // (192x128/f32: half-tile FP32 staging, two store passes, 4 stages) the same constants hold: it
    // is 3-12% faster than the better of the other two on 9 of the gemm config's 10 f32-D shapes and
    // 1.3% slower on the tenth (8192x2048x4096), where the model keeps 128x128/pipe/f32.
    // bf16 D at M >= 8192: a K block of 192x128 costs 1.38 (at 1.43 the model called ties where
    // 192x128 is 3-7% faster than 128x192); at M = 4096, 1.43 holds (ties, and losses to wave
    // quantization).
    // bf16 D at K >= 12288: 1.33, the ratio of the two tiles' K-block times per wave at K = 16384
    // (1.29-1.43x, 1.33 on average); with it 192x128 is taken at M = 2048..6144, 2-12% faster than
    // 128x128/pipe and 128x192. M = 1024 and the M = 4096 set keep their tiles.
    // Contiguous grouped GEMM: the 192-row tiles of a segment of whole 128-row blocks leave 0, 64
    // or 128 rows of their last tile to the next segment, 64 per segment on average (waste192); so
    // 192x128 is taken for a few long segments (4-8 experts of 4-8K rows: 4-10% faster than both
    // others; 32 of 1024 rows: 1-4%), not for many short ones.
    // Dense bf16 D with N a multiple of 128 (no half-empty column block) and K < 12288: 1.5% off,
    // what 192x128 gains over 128x128/pipe from carrying no direct stores in its code (2.2-2.5%
    // against 0.5-0.8%); it moves 9 shapes of M = 1536..8192 to 192x128, which run 1.01-1.11x faster
    // or tie. At K = 16384 it would move two shapes that run 0.8-2% slower, so it stops below 12288.
    const bool n_fits_192x128 = !d_f32 && !grouped && M >= 1536 && N % 128 == 0;
    const double k192x128 = (d_f32 ? 1.43 : K >= 12288 ? 1.33 : M >= 8192 ? 1.38 : 1.43) *
                             (n_fits_192x128 && K < 12288 ? 0.985 : 1.0);
    const double waste192 = 1.0 + 64.0 * double(contiguous_groups) / double(M);
    const double c192x128 = !grouped || contiguous_groups > 0
                                ? waves(192, 128) * (kb * k192x128 + 2.15 * ce) * waste192
                                : 1e300;
    // Last-wave K slices (bf16 D, dense, after at least one full wave): the R tiles past the last
    // full wave run as S slices each on R * S <= SMs CTAs, in the time of K / S blocks plus a cost
    // that grows with K: (10.5 + 0.09 K / 128) us (23.3 + 0.2 K / 128 in the model's units of
    // ~0.45 us), fitted to the gains and losses of 30 (shape, S) pairs against the unsplit tile. So
    // the slices win at K >= 7168 with one round of units, and lose at K <= 2048, with two rounds
    // (R * S > SMs) or at N = 2112. Taken when 2% ahead of the unsplit tile.
    auto tail = [&](int bm, int bn, double ck, double cep, double whole, int& slices) {
      slices = 1;
      const LastWave lw = last_wave(gemm_tile_count(M, N, bm, bn), num_sms);
      if (d_f32 || grouped || !split || lw.full == 0 || lw.rest == 0) return whole;
      const double full_waves = double(lw.full / num_sms);
      double c_best = whole * 0.98;
      for (int S = 2; S <= 8 && S <= kb && lw.rest * S <= num_sms; ++S) {
        const double c = full_waves * (kb * ck + cep) + (std::ceil(kb / S) * ck + cep) + (23.3 + 0.2 * kb);
        if (c < c_best) c_best = c, slices = S;
      }
      return slices > 1 ? c_best : whole;
    };
    int s128 = 1, s192x128 = 1;
    const double c128t = tail(128, 128, 1.0, 1.9 * ce, c128, s128);
    const double c192x128t = tail(192, 128, k192x128, 2.15 * ce, c192x128, s192x128);
    // Where the model takes 128x192 for bf16 D, dense, M >= 1536 and N a multiple of 128 (no
    // half-empty last column block of 192x128; 128x192 fits N = 2112 exactly, and wins there), it
    // takes 192x128 instead: faster on every such shape measured (25 shapes of M = 1536..6144,
    // 1.03-1.10x). Where the model takes 128x128/pipe the two are within 2.7%, so it stays.
    if (c192x128t * 1.01 < std::min({c128t, c192, c256}) || (n_fits_192x128 && c192 < c128t && c192 <= c256))
      best = {192, 128}, best.tail_split = s192x128;
    else if (c128t <= c192 && c128t <= c256) best = t128, best.tail_split = s128;
    else if (c192 <= c256) best = t192;
    else best = {256, 128, false, 1, false};
  }
  // f32 D (1d2d): the FP32-staged variant of the chosen tile where one is compiled (128x64 and the
  // large tiles with a staging tile; not 256x128/direct), whose TMA store (reduce-add for D +=)
  // leaves the math warpgroups once the tile is staged, where a bf16-staged kernel stores f32 D
  // directly (read-add-write for D +=): on the 128x64, D += at M = 128..512 is 1.25-1.5x faster
  // staged (1.05-1.27x cuBLASLt, against 0.71-1.03x); f32 D without += is the same either way.
  if (!b_1x128 && d_f32)
    for (const GemmTile& t : gemm_tiles(false))
      if (t.f32_staging && t.block_m == best.block_m && t.block_n == best.block_n && t.tma_epilogue == best.tma_epilogue &&
          t.multicast == best.multicast && t.pipelined == best.pipelined)
        best.f32_staging = true;
  // Rasterization (dense only): groups of 16 N blocks unless their B row-panels (raster_n x BN x
  // K bytes) would pass 24 MiB, about half the L2; then 8, so that the panels of the tiles in
  // flight stay in L2 (at 4096x7168x16384, 2 MiB panels, 8 is 3-7% faster than 16; at K <= 7168
  // the two tie and 32 is up to 4% slower). The grouped GEMMs and the Wgrad at K = 4096 see no
  // difference and keep 16.
  if (!grouped && int64_t(best.raster_n) * best.block_n * K > (int64_t(24) << 20)) best.raster_n = 8;
  // K slices: one row block (M <= 64) whose 64x64 tiles fill at most a third of the SMs, and
  // K >= 7168: S = SMs / tiles slices (at most 8, each at least 8 K blocks). There the slices run
  // 1.17-2.1x faster than the unsplit tile (64x2112x7168: 16.8 us against 19.6). With more tiles
  // or shorter K the second kernel and the workspace's traffic cost more than the idle SMs
  // (64x2112x4096 and 64x4096x7168 0.91x, K <= 2048 1.5-2.5x slower).
  if (split && !grouped && !b_1x128 && M <= 64) {
    const int64_t tiles64 = (N + 63) / 64, kb = K / 128;
    if (tiles64 * 3 <= num_sms && kb >= 56) {
      GemmTile t{64, 64};
      t.split_k = int(std::min<int64_t>({num_sms / tiles64, kb / 8, 8}));
      if (t.split_k > 1) best = t;
    }
  }
  return best;
}

// ---- The few-rows kernel (gemm_fp8_small_m.cu) ----
// Its launch: k_split K chunks per 16-row slice of B (chunk c holds the K blocks kb = c mod
// k_split; its warp folds them in order, and the chunks are added in chunk order, so k_split alone
// sets the rounding), row_warps 16-row slices per CTA (rows per CTA 16 * row_warps), ctas_per_sm
// CTAs sharing an SM's shared memory, stages the depth of each CTA's ring. 0: chosen.
struct SmallMConfig {
  int k_split = 0;
  int row_warps = 0;
  int ctas_per_sm = 0;
  int stages = 0;
};

// "s4/r2/c2/p6" (k_split, row_warps, ctas_per_sm, stages).
inline std::string small_m_config_name(const SmallMConfig& c) {
  return "s" + std::to_string(c.k_split) + "/r" + std::to_string(c.row_warps) + "/c" + std::to_string(c.ctas_per_sm) +
         "/p" + std::to_string(c.stages);
}

// The slices per CTA that still give every SM a CTA (N = 2112: one; 7168: two; 24576: eight).
inline int small_m_base_row_warps(int64_t N, int num_sms) {
  int rw = 8;
  while (rw > 1 && (N + 16 * rw - 1) / (16 * rw) < num_sms) rw /= 2;
  return rw;
}

// The K chunks, from N and K only (never M or the launch), so that a row of D is the same bits
// whatever the number of tokens and the launch: eight consumer warps at the base slices per CTA,
// at most one chunk per K block.
inline int small_m_k_split(int64_t N, int64_t K, int num_sms) {
  int s = 8 / small_m_base_row_warps(N, num_sms);
  while (s > 1 && s > K / 128) s /= 2;
  return s;
}

// Launch defaults for what `want` leaves at 0 (stages: chosen by the launch, from the shared
// memory a CTA gets). CTAs per SM (the share of shared memory each CTA's ring takes): as many as
// the grid needs for one wave (at most 4), and up to 8 tokens at least 3.
// NOTES: on an H100 (`bench small-m` with FP8MOE_SMALL_M_CONFIGS=c1,c2,c3,c4), M = 1 and 8 on 12
// decode shapes: the share of 3 CTAs (rings of 2-4 stages) was 2-6% faster than the one-wave count
// (2: 6 stages) on 24576x1536, 4096x7168 and 7168x2048, within 4% either way elsewhere; that of 1
// was 10-35% slower than 3's where the grid needs two CTAs per SM. (The kernel's 74 registers let
// two CTAs reside per SM: the share sets the depth of the rings.) Above 8 tokens A's rows enlarge
// the stages and 3 CTAs' share holds one or two: up to 1.54x slower at M = 32.
inline SmallMConfig small_m_config(int64_t M, int64_t N, int64_t K, int num_sms, SmallMConfig want) {
  if (want.k_split == 0) want.k_split = small_m_k_split(N, K, num_sms);
  if (want.row_warps == 0) want.row_warps = small_m_base_row_warps(N, num_sms);
  if (want.ctas_per_sm == 0) {
    const int64_t ctas = (N + 16 * want.row_warps - 1) / (16 * want.row_warps);
    const int64_t waves = std::min<int64_t>(4, std::max<int64_t>(1, (ctas + num_sms - 1) / num_sms));
    want.ctas_per_sm = int(M <= 8 ? std::max<int64_t>(3, waves) : waves);
  }
  return want;
}

}  // namespace fp8moe::cuda
