// Grouped GEMM problems (MoE experts) on top of TileScheduler: the scheduler hands out (m block,
// n block) pairs of a virtual row range; resolve_tile turns one into the rows, columns and K
// blocks the tile reads and writes. Layer 3 of src/cuda/kernels, beside scheduler.cuh. G groups.
//
//   none        the dense GEMM: m block b -> rows b*BM of A and D, every K block.
//   contiguous  A [R, K] (rows sorted by expert), B [G*N, K], D [R, N]: the expert g of an m block
//               is row_group[first row of its 128-row block] (the other rows of that block have
//               group g or -1); B rows and B scale blocks are offset by g*N. g < 0 (padding block):
//               no K blocks. Row by row, rows with row_group < 0 get zeros.
//               BM = 192: m block b is tiles[b] of a table built on the device (grouped_gemm.cu;
//               tiles[R / 128 rounded up] = the number of tiles, the scheduler's m blocks): start
//               row | (rows of the tile in its segment) / 64; the rest of the tile (the next
//               segment's rows) is read but never written.
//   masked      A [G*M_max, K], B [G*N, K], D [G*M_max, N]: m block b -> group g = b / T, tile i =
//               b % T (T = ceil(M_max / BM)), rows g*M_max + i*BM; rows at or past counts[g] get
//               zeros and rows at or past M_max (the next group's) are never written. No K
//               blocks when the whole tile is past counts[g].
//   k_grouped   Wgrad: A = dy_t [N, R], B = x_t [K, R], D [G*N, K]: m block b -> (g, i) as for
//               masked with N rows per group; A rows i*BM, D rows g*N + i*BM, K blocks
//               offsets[g]/128 .. offsets[g+1]/128 (an empty segment: none, zeros written).
//   split_k     the dense GEMM with its K blocks cut into S slices (groups = S, group_rows = M): m
//               block b -> slice g = b / T, rows r0 = (b % T) * BM (T = ceil(M / BM)); A rows r0,
//               K blocks [g * KB / S, (g + 1) * KB / S), D = the FP32 workspace [S * M, N], rows
//               g * M + r0 (rows past M are the next slice's: never written). No group table.
//   tail_split  the dense GEMM with its last, partial wave of tiles cut into K slices (S = groups,
//               D = group_rows: the tiles before that wave, a multiple of the grid). Work unit u <
//               D is tile u; unit D + S*i + s is slice s of tile D + i, K blocks [s*KB/S,
//               (s+1)*KB/S). A slice stores its FP32 partial tile in `partials`; the last slice of a
//               tile to finish (a counter per tile and math warpgroup in `arrivals`, zero at launch)
//               adds all S partials in slice order and runs the epilogue (join_slices in
//               sm90_fp8_gemm.cuh): deterministic. Rows and columns as for the dense GEMM.
// Group tables are read on the device (no host synchronization); values out of range are clamped
// so that no load leaves the operands: a row_group past G counts as padding, counts are clamped to
// [0, M_max], offsets to [0, R].
// The tile of the same (m block, n block) resolves identically in the producer and the math
// warpgroups, so both run the same number of K blocks.
#pragma once
#include <cstdint>

namespace fp8moe::cuda {

enum class Grouping : int { none, contiguous, masked, k_grouped, split_k, tail_split };

struct GroupArgs {
  const int32_t* table = nullptr;  // contiguous: row_group [R]; masked: counts [G]; k_grouped: offsets [G + 1]
  const int32_t* tiles = nullptr;  // contiguous, BM = 192: the tiles and their number (grouping.cuh)
  uint32_t groups = 1;       // split_k, tail_split: slices
  uint32_t group_rows = 0;  // masked: M_max; k_grouped: N (D rows per group); split_k: M; tail_split: D
  uint32_t b_rows = 0;      // contiguous, masked: N (B rows per group, a multiple of 128)
  float* partials = nullptr;    // tail_split: [units past D][BM * BN] f32
  int32_t* arrivals = nullptr;  // tail_split: [tiles past D][math warpgroups] i32
};

// Work units of the persistent loop over the scheduler's tiles (tail_split: D tiles, then S
// slices of each later tile; else one unit per tile).
template <Grouping kG>
__host__ __device__ __forceinline__ uint32_t work_units(uint32_t tiles, const GroupArgs& ga) {
  if constexpr (kG == Grouping::tail_split) return ga.group_rows + (tiles - ga.group_rows) * ga.groups;
  else return tiles;
}

// The scheduler's tile of work unit u.
template <Grouping kG>
__device__ __forceinline__ uint32_t unit_tile(uint32_t u, const GroupArgs& ga) {
  if constexpr (kG == Grouping::tail_split) return u < ga.group_rows ? u : ga.group_rows + (u - ga.group_rows) / ga.groups;
  else return u;
}

// What one output tile computes.
struct TileWork {
  uint32_t a_row;               // first row of the A box (and of its s_a)
  uint32_t b_row;               // first row of the B box
  uint32_t d_row;               // first row of D
  uint32_t kb_begin, kb_end;    // 128-wide K blocks [kb_begin, kb_end)
  uint32_t sb_blk;              // 1d2d: 128-row scale block of B holding b_row
  uint32_t valid_rows;          // masked, k_grouped: tile rows [0, valid_rows) get the product, the others zeros
  uint32_t write_rows;          // masked, k_grouped, contiguous BM = 192: tile rows [0, write_rows) are the
                                // group's; none written past
};

// Rows of the scheduler's virtual M: m blocks of BM rows (per group for masked and k_grouped).
template <Grouping kG, int BM>
__host__ __device__ __forceinline__ uint32_t sched_rows(uint32_t M, const GroupArgs& ga) {
  if constexpr (kG == Grouping::masked || kG == Grouping::k_grouped || kG == Grouping::split_k)
    return ga.groups * ((ga.group_rows + BM - 1) / BM) * BM;
  else if constexpr (kG == Grouping::contiguous && BM > 128)
#ifdef __CUDA_ARCH__
    return uint32_t(__ldg(ga.tiles + (M + 127) / 128)) * BM;  // the tiles of the table
#else
    return (M + 127) / 128 * BM;  // at most one per 128-row block (the launch's bound)
#endif
  else
    return M;
}

// m_blk < num_m_blocks of the scheduler, except multicast phantoms (dense only); num_k_blocks:
// K / 128 of the (whole) K dimension.
// unit: the work unit (tail_split: picks the K slice).
template <Grouping kG, int BM, int BN>
__device__ __forceinline__ TileWork resolve_tile(uint32_t m_blk, uint32_t n_blk, uint32_t num_m_blocks,
                                                 uint32_t num_k_blocks, const GroupArgs& ga, uint32_t unit = 0) {
  TileWork w;
  const uint32_t n0 = n_blk * BN;
  w.kb_begin = 0;
  w.kb_end = num_k_blocks;
  w.valid_rows = w.write_rows = BM;
  if constexpr (kG == Grouping::tail_split) {
    if (unit >= ga.group_rows) {
      const uint32_t s = (unit - ga.group_rows) % ga.groups;
      w.kb_begin = s * num_k_blocks / ga.groups;
      w.kb_end = (s + 1) * num_k_blocks / ga.groups;
    }
  }
  if constexpr (kG == Grouping::none || kG == Grouping::tail_split) {
    // Phantom tiles (multicast, odd M block count) load the last real A block; nothing is stored.
    w.a_row = min(m_blk, num_m_blocks - 1) * BM;
    w.d_row = m_blk * BM;
    w.b_row = n0;
  } else if constexpr (kG == Grouping::contiguous) {
    if constexpr (BM > 128) {
      const uint32_t e = uint32_t(__ldg(ga.tiles + m_blk));
      w.a_row = w.d_row = e & ~63u;
      w.valid_rows = w.write_rows = (e & 63u) * 64;
    } else {
      w.a_row = w.d_row = m_blk * BM;
    }
    const int32_t g = __ldg(ga.table + (w.a_row & ~127u));
    const bool real = g >= 0 && uint32_t(g) < ga.groups;
    w.b_row = (real ? uint32_t(g) : 0u) * ga.b_rows + n0;
    if (!real) w.kb_end = 0;
  } else {
    const uint32_t per_group = (ga.group_rows + BM - 1) / BM;
    const uint32_t g = m_blk / per_group, r0 = (m_blk - g * per_group) * BM;
    w.write_rows = min(uint32_t(BM), ga.group_rows - r0);
    w.d_row = g * ga.group_rows + r0;
    if constexpr (kG == Grouping::masked) {
      const int32_t cnt = min(max(__ldg(ga.table + g), 0), int32_t(ga.group_rows));
      w.valid_rows = uint32_t(cnt) > r0 ? min(w.write_rows, uint32_t(cnt) - r0) : 0u;
      w.a_row = w.d_row;
      w.b_row = g * ga.b_rows + n0;
      if (w.valid_rows == 0) w.kb_end = 0;
    } else if constexpr (kG == Grouping::split_k) {
      w.kb_begin = g * num_k_blocks / ga.groups;
      w.kb_end = (g + 1) * num_k_blocks / ga.groups;
      w.a_row = r0;
      w.b_row = n0;
    } else {
      const int32_t o0 = __ldg(ga.table + g), o1 = __ldg(ga.table + g + 1);
      w.kb_begin = min(uint32_t(max(o0, 0)) / 128u, num_k_blocks);
      w.kb_end = max(w.kb_begin, min(uint32_t(max(o1, 0)) / 128u, num_k_blocks));
      w.valid_rows = w.kb_end > w.kb_begin ? w.write_rows : 0u;
      w.a_row = r0;
      w.b_row = n0;
    }
  }
  w.sb_blk = w.b_row / 128;
  return w;
}

// The epilogue's view of one thread's two fragment rows (tile rows r_frag and r_frag + 8, D rows
// d_row + those), resolved when the tile starts so that the table loads overlap the mainloop.
// Bit i of each mask is row r_frag + 8*i.
struct RowMask {
  uint32_t product;  // the row gets the product (else zeros, or nothing when accumulating)
  uint32_t own;      // the row belongs to the tile's group (rows of other groups are never written)
  uint32_t clipped;  // the row lies past D's M rows (a TMA store clips it, direct stores skip it)
};

// Tile row r (D row d_row + r): whether it gets the product, and whether it is the tile's group's.
template <Grouping kG>
__device__ __forceinline__ void tile_row(const TileWork& w, const GroupArgs& ga, uint32_t d_row, uint32_t r, uint32_t M,
                                         bool& product, bool& own) {
  if constexpr (kG == Grouping::contiguous) {
    const uint32_t row = d_row + r;
    const int32_t g = row < M ? __ldg(ga.table + row) : -1;
    own = r < w.write_rows;  // BM = 192: the tile's rows in its segment
    product = own && g >= 0 && uint32_t(g) < ga.groups;
  } else {
    product = r < w.valid_rows;
    own = r < w.write_rows;
  }
}

template <Grouping kG>
__device__ __forceinline__ RowMask group_rows(const TileWork& w, const GroupArgs& ga, uint32_t d_row, uint32_t r_frag,
                                              uint32_t M) {
  RowMask m{0, 0, 0};
#pragma unroll
  for (uint32_t i = 0; i < 2; ++i) {
    const uint32_t r = r_frag + 8 * i, row = d_row + r;
    bool product, own;
    tile_row<kG>(w, ga, d_row, r, M, product, own);
    m.product |= uint32_t(product) << i;
    m.own |= uint32_t(own) << i;
    m.clipped |= uint32_t(row >= M) << i;
  }
  return m;
}

// Epilogue of a grouped tile: rows without a product are zeroed in `acc` (layout of mma.cuh).
// Returns the rows that may be written (bit i: row r_frag + 8*i): the group's rows, less those
// without a product when accumulating (D is left alone there). all_ok: both rows may be written or
// are clipped.
template <int BLOCK_N>
__device__ __forceinline__ uint32_t apply_row_mask(float (&acc)[BLOCK_N / 2], const RowMask& m, bool accumulate,
                                                   bool& all_ok) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
    if (!((m.product >> i) & 1))
#pragma unroll
      for (int j = 0; j < BLOCK_N / 8; ++j) acc[4 * j + 2 * i] = acc[4 * j + 2 * i + 1] = 0.0f;
  const uint32_t rows = m.own & (accumulate ? m.product : 3u);
  all_ok = ((rows | m.clipped) & 3u) == 3u;
  return rows;
}

}  // namespace fp8moe::cuda
