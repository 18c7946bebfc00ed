// The sm_90a FP8 block-scaled GEMM kernel with per-128-K promotion (contract: gemm_ref.hpp, report §3.3.2):
//
//   D [M, N] = A [M, K] * B [N, K]^T  (+ D),  A 1x128-scaled, B 128x128-scaled (Fprop, Dgrad:
//   kind "1d2d") or 1x128-scaled (Wgrad: "1d1d"), D bf16 | f32.
//
// Structure (as DeepGEMM's sm90 kernels): one producer warpgroup whose elected thread issues TMA
// loads of A, B and the scales into a STAGES-deep shared-memory ring guarded by full/empty
// mbarriers, and BLOCK_M/64 math warpgroups (two for 256); each math warpgroup owns 64 rows of the
// BLOCK_M x BLOCK_N tile. Per 128-wide K block it issues four m64nNk32 WGMMAs into `acc` (Tensor
// Core accumulation, restarted from zero at each block), waits, releases the stage, and promotes:
// final += (s_a * s_b) * acc in FP32 registers on the CUDA cores. Two (or three) math warpgroups
// alternate naturally: while one promotes, the others' WGMMAs run. The pipelined variant (kPipe, 1d2d)
// keeps two accumulator sets per warpgroup and queues block k+1's WGMMAs before promoting block k
// (wgmma.wait_group 1), so the Tensor Cores never wait for a promotion. 1d2d tiles of BLOCK_N
// 160/192 meet two 128-row scale blocks of B; the promotion picks s_b per column group through a
// compile-time boundary. The grid is persistent (one CTA per SM), tiles come from TileScheduler.
//
// Shared memory: per math warpgroup a staging tile for the epilogue (1d2d: bf16, or f32 for the
// kF32Stg variants; 1d1d: f32; StagingTile in epilogue.cuh; half a tile, stored in two passes, for
// three warpgroups staging f32), then per stage: A tile [BLOCK_M, 128] e4m3 (128B-swizzled,
// K-major), B tile [BLOCK_N, 128] e4m3, s_a [BLOCK_M] f32, and s_b: for 1d1d [BLOCK_N] f32 (TMA),
// for 1d2d the two 128x128-block scales a tile may meet (stored by the producer thread).
// Epilogue: when D's dtype is the staging dtype and its rows are 16-byte aligned, each math
// warpgroup writes its 64 x BLOCK_N result into its staging tile and one thread issues TMA stores
// (TMA reduce-add for D += ...) that run while the next tile's WGMMAs start; otherwise direct
// masked global stores.
// Grouped GEMMs (MoE experts, grouping.cuh) are the same kernel with kG != none: each tile
// resolves its group's A/B rows, K blocks and D rows on the device, and the epilogue leaves rows of
// other groups alone and writes zeros for padding rows.
// Launch: gemm_launch.cuh (tensor maps, kernel launch; heuristics in gemm_heuristics.hpp), called
// by gemm_fp8.cu and grouped_gemm*.cu.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/gemm/kernels/epilogue.cuh"
#include "cuda/gemm/kernels/grouping.cuh"
#include "cuda/gemm/kernels/mma.cuh"
#include "cuda/gemm/kernels/ptx.cuh"
#include "cuda/gemm/kernels/scheduler.cuh"

namespace fp8moe::cuda {

constexpr int kBlockK = 128;
constexpr int kMaxSmemBytes = 232448;  // sm_90 opt-in limit per block

template <int BLOCK_M, int BLOCK_N, bool kB1x128, bool kTmaEpilogue = true, int kMC = 1, bool kPipe = false,
          bool kF32Stg = false>
struct GemmTraits {
  // kPipe: the WGMMAs of K block k+1 are issued before block k is promoted (two accumulator sets).
  static constexpr bool kPipelined = kPipe;
  static constexpr int kMulticast = kMC;  // CTAs per cluster sharing (multicasting) the B tile
  // One math warpgroup per 64 rows up to BLOCK_M = 192 (three: every B tile shared by three
  // m64 WGMMA batches); BLOCK_M = 256 gives two of them two m64 "waves" each (rows 64*wg + 128*w).
  static constexpr int kNumMathWG = BLOCK_M == 256 ? 2 : BLOCK_M / 64;
  static constexpr int kWaves = BLOCK_M / (64 * kNumMathWG);
  static constexpr int kNumMathThreads = kNumMathWG * 128;
  static constexpr int kNumThreads = kNumMathThreads + 128;  // + producer warpgroup
  // Registers per thread after the producer gives its share to the math warpgroups (setmaxnreg;
  // 65536 per SM): 40 + 2 x 232 with two math warpgroups, 24 + 3 x 160 with three.
  static constexpr int kProducerRegs = kNumMathWG == 3 ? 24 : 40;
  static constexpr int kMathRegs = kNumMathWG == 3 ? 160 : 232;
  static constexpr int kSmemA = BLOCK_M * kBlockK;            // [BLOCK_M, 128] e4m3
  static constexpr int kSmemB = BLOCK_N * kBlockK;            // [BLOCK_N, 128] e4m3
  static constexpr int kSmemSA = BLOCK_M * 4;                 // [BLOCK_M] f32
  // 1d1d: [BLOCK_N] f32 by TMA. 1d2d: the tile's two 128x128-block scales of B (s_b of block
  // n0/128 and of the next one), written by the producer thread, so that the math warpgroups make
  // no global loads (one in their loop put an L2 round trip before the next WGMMAs: ptxas moved
  // the loaded value to a uniform register right away, to free the accumulator it sat in).
  static constexpr int kSmemSB = kB1x128 ? BLOCK_N * 4 : 8;
  static constexpr int kStageBytes = kSmemA + kSmemB + kSmemSA + kSmemSB;
  // Epilogue staging dtype: f32 (Wgrad; 1d2d kF32Stg variants, for f32 D) or bf16 (1d2d).
  static constexpr bool kStageF32 = kB1x128 || kF32Stg;
  // Half a tile staged at a time, stored in two passes, where that buys a pipeline stage: three
  // math warpgroups staging FP32 keep 4 stages (three whole FP32 tiles, 96 KiB, would leave 3);
  // the pipelined 128x128 gets 6 stages for bf16 D (5 with whole tiles) and 5 for f32 D (4).
  // NOTES: the sixth stage of the pipelined 128x128 with bf16 D pays most on the single-wave
  // mid-M shapes (2.5-5%), whose loads its five stages did not cover (docs/PERF-log.md, "A sixth
  // stage").
  static constexpr int kStagingPasses =
      (kNumMathWG == 3 && kStageF32) || (kNumMathWG == 2 && kPipe && BLOCK_N == 128) ? 2 : 1;
  using Staging = StagingTile<BLOCK_N, kStageF32, kStagingPasses>;
  // TMA-store epilogue only for tiles at least one 128-byte box wide.
  // NOTES: the staging tiles cost pipeline stages (plain 128x128 1d2d: 5 instead of 6); for long K
  // the mainloop matters more than the epilogue, so the host may pick the variant without them.
  static constexpr bool kTmaStoreOk = kTmaEpilogue && kWaves == 1 && BLOCK_N % Staging::kBoxCols == 0;
  // 1d2d tiles of 128x128 and more with the TMA-store epilogue store D through it only: the
  // kernel compiles no direct stores, and where D cannot take these TMA stores the host runs
  // direct_gemm_tile() instead (gemm_heuristics.hpp, staged_only_tile: the same test on the host;
  // tile_for_d in gemm_launch.cuh). Their grouped kernels (contiguous, masked) are given only
  // 64-row store boxes of all or none of the tile's rows, except for D += on the contiguous GEMM,
  // where a box may hold padding rows to leave alone: those boxes are copied row by row from the
  // staging tile (copy_box_rows).
  // NOTES: the direct stores (f32 and bf16 D, D +=, bounds) would be ~70% of these kernels' code
  // (128x128/pipe: 6008 SASS instructions, 1384 without), never run with the TMA store, and a
  // launch after another kernel pays for fetching that code: up to 2 us on a 13 us GEMM
  // (docs/PERF-log.md, "The launch after another kernel"). The 1d1d tiles (Wgrad) keep them:
  // without them the 1d1d 128x128 was 2-3% slower.
  static constexpr bool kStagedOnly = kTmaStoreOk && !kB1x128 && BLOCK_M * BLOCK_N >= 128 * 128;
  static constexpr int kSmemStaging = kTmaStoreOk ? kNumMathWG * Staging::kBytes : 0;
  static constexpr int kStages = [] {
    int s = (kMaxSmemBytes - 1024 - 512 - kSmemStaging) / kStageBytes;
    return s > 10 ? 10 : s;
  }();
  // + barriers + alignment slack
  static constexpr int kSmemBytes = kSmemStaging + kStages * kStageBytes + 2 * kStages * 8 + 1024;
  // Bytes the TMA loads deliver per stage (the 1d2d s_b pair is stored by the producer thread).
  static constexpr uint32_t kTxBytes = kStageBytes - (kB1x128 ? 0 : kSmemSB);

  static_assert(BLOCK_M == 64 || BLOCK_M == 128 || BLOCK_M == 192 || BLOCK_M == 256,
                "BLOCK_M: 64, 128, 192 (three math warpgroups) or 256 (two waves)");
  static_assert(kNumMathWG < 3 || (!kPipe && kMC == 1 && BLOCK_N <= 128),
                "three math warpgroups: one accumulator set of at most 128 columns (160 registers)");
  // setmaxnreg.inc takes registers from the CTA's pool, which holds what the launch allocated:
  // the per-thread count ptxas gives a 1-CTA kernel of kNumThreads threads (65536 / kNumThreads,
  // rounded down to a multiple of 8: 168 for 384 threads, 128 for 512) times kNumThreads.
  // NOTES: a producer of 48 registers with two math warpgroups of 232 asks for 1024 more than
  // 168 x 384, and the math warpgroups' setmaxnreg.inc then waits forever (the kernel hangs).
  static_assert(kProducerRegs * 128 + kMathRegs * kNumMathThreads <= 65536 / kNumThreads / 8 * 8 * kNumThreads,
                "register file: more than the CTA's pool");
  static_assert(kWaves == 1 || (!kB1x128 && !kTmaEpilogue && kMC == 1),
                "BLOCK_M = 256: 1d2d with the direct epilogue only (registers)");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 192, "BLOCK_N: a WGMMA N");
  // 1d2d: n0 % 128 is a multiple of kSbAlign, so a tile meets at most two 128-row scale blocks of B
  // when BLOCK_N + (128 - kSbAlign) <= 256 (16..128 | 144, 160, 192, 256 yes; 176 no).
  static constexpr int kSbAlign = BLOCK_N % kBlockK == 0 ? kBlockK : (BLOCK_N & -BLOCK_N);
  static_assert(kB1x128 || BLOCK_N + kBlockK - kSbAlign <= 2 * kBlockK,
                "1d2d: a tile must not meet three 128-row scale blocks of B");
  // 1d2d: the tile may meet two 128-row scale blocks of B.
  static constexpr bool kTwoSb = !kB1x128 && BLOCK_N > kSbAlign;
  static_assert(!kPipe || (kWaves == 1 && !kB1x128), "pipelined mainloop: 1d2d, one wave per warpgroup (registers)");
  static_assert(kSmemA % 1024 == 0 && kSmemB % 1024 == 0, "swizzle-128B tiles need 1024-byte alignment");
  static_assert(kStages >= 2, "shared memory too small for two stages");
  // kF32Stg: 1d2d only (1d1d stages f32 anyway), and only where the staged epilogue is used.
  static_assert(!kF32Stg || (!kB1x128 && kTmaStoreOk), "kF32Stg: a 1d2d tile with the TMA-store epilogue");
  static_assert(!kTmaStoreOk || Staging::kBoxes * Staging::kBoxCols == BLOCK_N, "staging: whole boxes");
  static_assert(kMC == 1 || (kMC == 2 && BLOCK_N % 16 == 0), "multicast: 1 or 2 CTAs, B halves of whole swizzle atoms");
};

// 1d2d promotion of one m64 fragment: fa += (s_a * s_b) * acc, with s_b = sb0 for tile columns
// < bnd and sb1 from there on; s00 = s_a(row) * sb0, s10 = s_a(row + 8) * sb0, s01/s11 with sb1.
// bnd (a multiple of kStep) is made a compile-time kBnd by uniform branches, a few per K block;
// kBnd = BLOCK_N: the whole tile uses sb0.
template <int BLOCK_N, int kStep, int kBnd = BLOCK_N>
__device__ __forceinline__ void promote_1d2d(uint32_t bnd, float (&fa)[BLOCK_N / 2], const float (&acc)[BLOCK_N / 2],
                                             float s00, float s10, float s01, float s11) {
  if constexpr (kBnd > kStep) {
    if (bnd < uint32_t(kBnd)) {
      promote_1d2d<BLOCK_N, kStep, kBnd - kStep>(bnd, fa, acc, s00, s10, s01, s11);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < BLOCK_N / 8; ++j) {
    const bool second = 8 * j >= kBnd;
    // NOTES: written as fmaf so that the promotion is one FFMA per accumulator.
    fa[4 * j + 0] = fmaf(second ? s01 : s00, acc[4 * j + 0], fa[4 * j + 0]);
    fa[4 * j + 1] = fmaf(second ? s01 : s00, acc[4 * j + 1], fa[4 * j + 1]);
    fa[4 * j + 2] = fmaf(second ? s11 : s10, acc[4 * j + 2], fa[4 * j + 2]);
    fa[4 * j + 3] = fmaf(second ? s11 : s10, acc[4 * j + 3], fa[4 * j + 3]);
  }
}

// tail_split (grouping.cuh): unit j of the last wave (slice j % S of its tile j / S) stores this
// math warpgroup's partial tile `fa` and counts itself in with one atomic per warpgroup; the
// warpgroup that completes the tile's count sums the S partials in slice order into `fa`
// (deterministic, whichever slice finishes last) and returns true: it runs the epilogue.
// Partials are laid out [unit][float4 chunk][math thread], so that stores and loads coalesce.
template <int kNumAccum, int kThreads>
__device__ __forceinline__ bool join_slices(float (&fa)[kNumAccum], uint32_t j, const GroupArgs& ga, uint32_t wg) {
  constexpr int kChunks = kNumAccum / 4;
  const uint32_t S = ga.groups, tile = j / S;
  float4* parts = reinterpret_cast<float4*>(ga.partials) + threadIdx.x;
  auto chunk = [&](uint32_t unit, int c) { return parts + (size_t(unit) * kChunks + c) * kThreads; };
#pragma unroll
  for (int c = 0; c < kChunks; ++c) __stcg(chunk(j, c), make_float4(fa[4 * c], fa[4 * c + 1], fa[4 * c + 2], fa[4 * c + 3]));
  ptx::named_barrier_sync(1 + wg, 128);  // the warpgroup's stores, published by the leader's release
  // NOTES: the leader's atomic is a predicated instruction, not a branch: behind a branch ptxas
  // kept fewer values in registers across the whole kernel and recomputed addresses in the K loop
  // (125 instructions per K block of the 192x128 tile against 118; 1.5-4.6% slower).
  const int32_t old =
      ptx::atom_add_acq_rel_gpu_if(threadIdx.x % 128 == 0, ga.arrivals + tile * (kThreads / 128) + wg, 1);
  bool last = old < 0 || old == int32_t(S) - 1;
  // NOTES: a warp reduction makes the result visibly warp-uniform (see the store-box vote).
  last = __reduce_and_sync(0xffffffffu, uint32_t(ptx::named_barrier_and(1 + wg, 128, last))) != 0;
  if (!last) return false;
  for (uint32_t s = 0; s < S; ++s) {
    float4 v[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) v[c] = __ldcg(chunk(tile * S + s, c));
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float* f = fa + 4 * c;
      f[0] = s == 0 ? v[c].x : f[0] + v[c].x;
      f[1] = s == 0 ? v[c].y : f[1] + v[c].y;
      f[2] = s == 0 ? v[c].z : f[2] + v[c].z;
      f[3] = s == 0 ? v[c].w : f[3] + v[c].w;
    }
  }
  return true;
}

struct GemmKernelArgs {
  const float* sb_blk;  // 1d2d: B scales [ceil(N/128), K/128] f32 row-major (grouped: [G*N/128, K/128])
  EpilogueArgs epi;
  uint32_t M, N, K;     // D rows, D columns (per group), K of the operands (k_grouped: R tokens)
  GroupArgs group;      // grouped kernels only
  uint32_t raster_n;    // N blocks per rasterization group of the tile scheduler (launch_gemm: GemmTile::raster_n)
  SchedDivs sched;      // the scheduler's divisors (launch_kernel: sched_divs)
};

template <int BLOCK_M, int BLOCK_N, bool kB1x128, bool kTmaEpilogue, int kMC, bool kPipe, Grouping kG,
          bool kF32Stg = false>
__global__ void __launch_bounds__(GemmTraits<BLOCK_M, BLOCK_N, kB1x128, kTmaEpilogue, kMC, kPipe, kF32Stg>::kNumThreads, 1)
    sm90_fp8_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,   // A [M, K] e4m3, box [BLOCK_M, 128]
                         const __grid_constant__ CUtensorMap tmap_b,   // B [N, K] e4m3, box [BLOCK_N / kMC, 128]
                         const __grid_constant__ CUtensorMap tmap_sa,  // s_a [K/128, ld(M)] f32, box [1, BLOCK_M]
                         const __grid_constant__ CUtensorMap tmap_sb,  // 1d1d: s_b [K/128, ld(N)] f32, box [1, BLOCK_N]
                         const __grid_constant__ CUtensorMap tmap_d,   // D [M, N], box [64, 128 B], 128B swizzle
                         const GemmKernelArgs args) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using T = GemmTraits<BLOCK_M, BLOCK_N, kB1x128, kTmaEpilogue, kMC, kPipe, kF32Stg>;
  using Mma = WgmmaFp8<BLOCK_N>;
  constexpr int STAGES = T::kStages;
  constexpr int kNumAccum = Mma::kNumAccum;  // BLOCK_N / 2 f32 per thread
  // NOTES: the two CTAs of a multicast cluster share one B tile, and the two 128-row halves of a
  // 256-row tile share it too: neither fits tiles that may belong to different groups.
  static_assert(kG == Grouping::none || (kMC == 1 && T::kWaves == 1), "grouped: 64/128-row tiles, no multicast");
  static_assert(kG != Grouping::tail_split || (!kB1x128 && kMC == 1 && T::kWaves == 1), "tail_split: 1d2d, one wave");

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // NOTES: the runtime only guarantees 16-byte alignment of dynamic shared memory; align by hand.
  // The offset is added to smem_raw itself (not computed through an integer address), so the
  // compiler still knows every pointer below is in shared memory and emits LDS/STS: through a
  // round trip via uintptr_t it emitted generic loads and stores with 64-bit address arithmetic
  // for the scale reads and the epilogue's staging.
  uint8_t* smem = smem_raw + ((1024u - (ptx::smem_addr(smem_raw) & 1023u)) & 1023u);
  uint8_t* smem_stg = smem;                                // [math WG][Staging] epilogue tiles
  uint8_t* smem_a = smem_stg + T::kSmemStaging;            // [STAGES][BLOCK_M, 128] e4m3
  uint8_t* smem_b = smem_a + STAGES * T::kSmemA;           // [STAGES][BLOCK_N, 128] e4m3
  float* smem_sa = reinterpret_cast<float*>(smem_b + STAGES * T::kSmemB);  // [STAGES][BLOCK_M] f32
  float* smem_sb = smem_sa + STAGES * BLOCK_M;             // [STAGES][BLOCK_N] f32 (1d1d) | [STAGES][2] (1d2d)
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(smem_sb) + STAGES * T::kSmemSB);
  uint64_t* empty_bar = full_bar + STAGES;

  const uint32_t warp = threadIdx.x / 32;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t rank = kMC > 1 ? ptx::cluster_cta_rank() : 0;  // in the cluster
  const uint32_t cluster_id = blockIdx.x / kMC, num_clusters = gridDim.x / kMC;

  if (threadIdx.x == T::kNumMathThreads) {
    ptx::prefetch_tmap(&tmap_a);
    ptx::prefetch_tmap(&tmap_b);
    ptx::prefetch_tmap(&tmap_sa);
    if constexpr (kB1x128) ptx::prefetch_tmap(&tmap_sb);
    if (args.epi.tma_store) ptx::prefetch_tmap(&tmap_d);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(&full_bar[s], 1);                         // the producer's arrive + TMA bytes
      // One arrive per math warp of every CTA that writes this stage (multicast: both).
      ptx::mbar_init(&empty_bar[s], kMC * T::kNumMathThreads / 32);
    }
    ptx::fence_barrier_init();
  }
  // NOTES: with multicast the peer CTA writes into our stages and arrives on our barriers, so
  // initialisation must be visible cluster-wide before anyone starts.
  if constexpr (kMC > 1) ptx::cluster_sync();
  else __syncthreads();

  // A contiguous GEMM of 192-row tiles reads its rows from the group table: its divisors too.
  const uint32_t rows = sched_rows<kG, BLOCK_M>(args.M, args.group);
  const TileScheduler sched(rows, args.N, BLOCK_M, BLOCK_N, kMC,
                            kG == Grouping::contiguous && BLOCK_M > 128
                                ? sched_divs(rows, args.N, BLOCK_M, BLOCK_N, kMC, args.raster_n)
                                : args.sched);
  const uint32_t num_k_blocks = args.K / kBlockK;
  const uint32_t num_units = work_units<kG>(sched.num_tiles, args.group);
  // Grouped rows (contiguous, masked, k_grouped, split_k): tiles resolve their rows from the group
  // tables and mask them in the epilogue; tail_split tiles are the dense GEMM's.
  constexpr bool kRowGroups = kG != Grouping::none && kG != Grouping::tail_split;

  if (threadIdx.x >= T::kNumMathThreads) {
    // ---- producer warpgroup: one thread issues every TMA load ----
    // NOTES: with one math warpgroup (256 threads) every warp already has the 232 registers it
    // needs, so the register pool is only rebalanced for two and three.
    if constexpr (T::kNumMathWG > 1) ptx::setmaxnreg_dec<T::kProducerRegs>();
    if (threadIdx.x == T::kNumMathThreads) {
      uint32_t stage = 0, phase = 0;
      for (uint32_t unit = cluster_id; unit < num_units; unit += num_clusters) {
        uint32_t m_blk, n_blk;
        sched.tile_coords(unit_tile<kG>(unit, args.group), rank, m_blk, n_blk);
        const TileWork work =
            resolve_tile<kG, BLOCK_M, BLOCK_N>(m_blk, n_blk, sched.num_m_blocks, num_k_blocks, args.group, unit);
        const int32_t m0 = int32_t(work.a_row), n0 = int32_t(work.b_row);
        // 1d2d: s_b of B's 128-row block holding the tile's first column and, when the tile reaches
        // into the next block (tile columns >= bnd), of that one; loaded one K block ahead.
        const float* sb_row = kB1x128 ? nullptr : args.sb_blk + work.sb_blk * num_k_blocks;
        const uint32_t col0 = n_blk * BLOCK_N;
        const bool second_sb = T::kTwoSb && col0 + (kBlockK - col0 % kBlockK) < args.N;
        auto load_sb = [&](uint32_t kb) {
          float2 v = make_float2(0.0f, 0.0f);
          if constexpr (!kB1x128) {
            if (kb < work.kb_end) {
              v.x = __ldg(sb_row + kb);
              if (second_sb) v.y = __ldg(sb_row + num_k_blocks + kb);
            }
          }
          return v;
        };
        float2 sb = load_sb(work.kb_begin);
        for (uint32_t kb = work.kb_begin; kb < work.kb_end; ++kb) {
          const float2 sb_next = load_sb(kb + 1);
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          // 1d2d: the loads go out first and the s_b pair is stored after them: the store waits
          // for its global load, which at a tile's first K block (the kernel's first loads) would
          // otherwise hold the TMA loads back by an L2 miss. Plain shared stores, made visible to
          // the math warpgroups by the release of the arrive and the acquire of their wait.
          if constexpr (kB1x128) ptx::mbar_arrive_expect_tx(&full_bar[stage], T::kTxBytes);
          else ptx::mbar_expect_tx(&full_bar[stage], T::kTxBytes);
          const int32_t k0 = int32_t(kb * kBlockK);
          ptx::tma_load_2d(&tmap_a, &full_bar[stage], smem_a + stage * T::kSmemA, k0, m0);
          if constexpr (kMC > 1) {
            // Our half of the B tile goes to both CTAs; the peer sends the other half.
            constexpr int kRows = BLOCK_N / kMC;
            ptx::tma_load_2d_multicast(&tmap_b, &full_bar[stage], smem_b + stage * T::kSmemB + rank * kRows * kBlockK,
                                       k0, n0 + int32_t(rank) * kRows, uint16_t((1u << kMC) - 1));
          } else {
            ptx::tma_load_2d(&tmap_b, &full_bar[stage], smem_b + stage * T::kSmemB, k0, n0);
          }
          ptx::tma_load_2d(&tmap_sa, &full_bar[stage], smem_sa + stage * BLOCK_M, m0, int32_t(kb));
          if constexpr (kB1x128)
            ptx::tma_load_2d(&tmap_sb, &full_bar[stage], smem_sb + stage * BLOCK_N, n0, int32_t(kb));
          if constexpr (!kB1x128) {
            *reinterpret_cast<float2*>(smem_sb + stage * 2) = sb;
            ptx::mbar_arrive(&full_bar[stage]);
          }
          sb = sb_next;
          if (++stage == STAGES) stage = 0, phase ^= 1;
        }
      }
      if constexpr (kMC > 1) {
        // NOTES: the peer's consumers arrive on our empty barriers remotely; stay alive until every
        // stage has been released for its last use, so no arrive targets an exited CTA.
        for (int i = 0; i < STAGES; ++i) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          if (++stage == STAGES) stage = 0, phase ^= 1;
        }
      }
    }
  } else {
    // ---- math warpgroups ----
    if constexpr (T::kNumMathWG > 1) ptx::setmaxnreg_inc<T::kMathRegs>();
    constexpr int W = T::kWaves;
    // rows 64*wg + 128*w + [0, 64) of the tile. NOTES: read through a shuffle so that the compiler
    // knows it is warp-uniform and builds the WGMMA descriptors in uniform registers.
    const uint32_t wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    const uint32_t r_frag = wg * 64 + (warp % 4) * 16 + lane / 4;  // tile row of d[0] (wave 0); d[2] is 8 below
    const uint32_t c_frag = 2 * (lane % 4);                        // tile column of d[0]

    // NOTES: the ring's shared addresses, computed once. Derived per use from the pointers, ptxas
    // re-read SR_CgaCtaId (S2UR, a long-latency read) before every full-barrier wait: on the path
    // from one K block's WGMMAs to the next.
    const uint32_t full_bar_s = ptx::smem_addr(full_bar);
    const uint32_t smem_a_s = ptx::smem_addr(smem_a), smem_b_s = ptx::smem_addr(smem_b);

    uint32_t stage = 0, phase = 0;
    // The 1d2d plain mainloop's position in the ring as shared addresses (full barrier, A, B, s_a,
    // s_b of the stage), carried from K block to K block: advanced by their stride, wrapped by
    // subtraction.
    // NOTES: derived from a shared base at each use, even from one computed once, ptxas re-read
    // SR_CgaCtaId (an S2UR) in this loop before every full-barrier wait. The Wgrad keeps stage
    // indices: its 64 scale reads as volatile loads at carried addresses measured 3-6% slower.
    constexpr bool kCarry = !kB1x128 && !T::kPipelined;
    uint32_t c_bar = full_bar_s, c_a = smem_a_s, c_b = smem_b_s, c_sa = ptx::smem_addr(smem_sa),
             c_sb = ptx::smem_addr(smem_sb);
    float final_acc[W][kNumAccum];
    // The pipelined 128x128 tile with two bf16 staging passes (no multicast, no K slices) stages its second
    // pass in its own 64 rows of the A tile of the tile's last K block, which only its WGMMAs read:
    // that stage stays held (`held`) until the pass's TMA store has read it, and each warpgroup's
    // leader releases its four warps' share once the next tile's first WGMMAs are queued.
    // NOTES: the second pass then need not wait for the first pass's store to read the staging tile,
    // a wait of ~470 of the ~1500 cycles of the epilogue (docs/PERF-log.md, "The Tensor Cores'
    // ceiling under the power cap").
    constexpr bool kStageInRing = kG != Grouping::tail_split && kMC == 1 && T::kTmaStoreOk &&
                                  T::kStagingPasses == 2 && !T::kStageF32;
    int32_t held = -1;
    auto release_held = [&] {
      if constexpr (kStageInRing) {
        if (held >= 0) {
          if (threadIdx.x % 128 == 0) {
            ptx::bulk_wait_read();
            ptx::mbar_arrive_count(full_bar_s + (STAGES + uint32_t(held)) * 8, 4);  // empty_bar[held]
          }
          held = -1;
        }
      }
    };

    // Hands stage `s` back to the producer(s): its shared-memory reads are complete.
    auto release = [&](uint32_t s) {
      if (lane == 0) {
        // empty_bar[s] (= full_bar[STAGES + s]: at the carried full-barrier address + STAGES * 8).
        const uint32_t empty = kCarry ? c_bar + STAGES * 8 : ptx::smem_addr(&empty_bar[s]);
        if constexpr (kMC > 1) {
#pragma unroll
          for (uint32_t r = 0; r < uint32_t(kMC); ++r) {
            if (r == rank) ptx::mbar_arrive(empty);
            else ptx::mbar_arrive_cluster(empty, r);
          }
        } else {
          ptx::mbar_arrive(empty);
        }
      }
    };
    // Four m64nNk32 WGMMAs over the 128-wide K block of stage `s`, wave `w`, into `acc` (one commit group).
    auto issue = [&](uint32_t s, int w, float (&acc)[kNumAccum]) {
      const uint32_t a_s = kCarry ? c_a : smem_a_s + s * T::kSmemA, b_s = kCarry ? c_b : smem_b_s + s * T::kSmemB;
      const uint64_t desc_b = make_smem_desc_k128b(b_s);
      const uint64_t desc_a = make_smem_desc_k128b(a_s + (w * 128 + wg * 64) * kBlockK);
#pragma unroll
      for (int i = 0; i < kNumAccum; ++i) ptx::fence_operand(acc[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / 32; ++k) {
        // 32 e4m3 along K = 32 bytes = 2 descriptor address units.
        Mma::mma(desc_a + 2 * k, desc_b + 2 * k, acc, k > 0);
      }
      ptx::wgmma_commit();
#pragma unroll
      for (int i = 0; i < kNumAccum; ++i) ptx::fence_operand(acc[i]);
    };
    auto promote_1d2d_at = [&](uint32_t bnd, float (&fa)[kNumAccum], const float (&acc)[kNumAccum], float sa0,
                               float sa1, float sb0, float sb1) {
      constexpr int kStep = T::kTwoSb ? T::kSbAlign : BLOCK_N;
      promote_1d2d<BLOCK_N, kStep>(bnd, fa, acc, sa0 * sb0, sa1 * sb0, sa0 * sb1, sa1 * sb1);
    };

    float acc[kNumAccum];
    float acc2[T::kPipelined ? kNumAccum : 1];  // second accumulator set of the pipelined mainloop

    auto resolve = [&](uint32_t u) {
      uint32_t m_blk, n_blk;
      sched.tile_coords(unit_tile<kG>(u, args.group), rank, m_blk, n_blk);
      return resolve_tile<kG, BLOCK_M, BLOCK_N>(m_blk, n_blk, sched.num_m_blocks, num_k_blocks, args.group, u);
    };
    // NOTES: grouped kernels resolve the next tile before this tile's epilogue, so that the group
    // table loads overlap it instead of stalling the next tile's first WGMMAs.
    TileWork next_work{};
    if constexpr (kRowGroups)
      if (cluster_id < num_units) next_work = resolve(cluster_id);

    for (uint32_t unit = cluster_id; unit < num_units; unit += num_clusters) {
      uint32_t m_blk, n_blk;
      sched.tile_coords(unit_tile<kG>(unit, args.group), rank, m_blk, n_blk);
      TileWork work = kRowGroups ? next_work : resolve(unit);
      if constexpr (kRowGroups) {
        // NOTES: the K range comes from per-thread table reads, so ptxas cannot tell that it is
        // warp-uniform, and with one math warpgroup it then kept the whole K loop (ring stage,
        // phase, WGMMA descriptors) in per-thread registers. A warp reduction (REDUX) writes a
        // uniform register; a shuffle from lane 0 did not make it uniform.
        work.kb_begin = __reduce_max_sync(0xffffffffu, work.kb_begin);
        work.kb_end = __reduce_max_sync(0xffffffffu, work.kb_end);
      }
      const uint32_t m0 = work.d_row, n0 = n_blk * BLOCK_N;  // phantom tiles: m0 >= M, all stores masked
      RowMask row_mask{};
      if constexpr (kRowGroups) row_mask = group_rows<kG>(work, args.group, m0, r_frag, args.M);
#pragma unroll
      for (int w = 0; w < W; ++w)
#pragma unroll
        for (int i = 0; i < kNumAccum; ++i) final_acc[w][i] = 0.0f;

      // 1d2d: tile columns >= bnd take s_b of the next 128-row block of B (the stage's second value).
      const uint32_t bnd = kBlockK - n0 % kBlockK;
      // 1d2d: the stage's s_b pair (written by the producer; 0 where the tile has no second block).
      auto read_sb = [&](uint32_t s, float& sb0, float& sb1) {
        const float2 v = *reinterpret_cast<const float2*>(smem_sb + s * 2);
        sb0 = v.x;
        sb1 = T::kTwoSb ? v.y : 0.0f;
      };

      if constexpr (T::kPipelined) {
        // NOTES: pipelined mainloop: the WGMMAs of block k+1 are queued before block k is promoted,
        // so the Tensor Cores never wait for this warpgroup's promotion, its barrier waits or its
        // stage release (wgmma groups complete in order: wait_group 1 = block k done).
        // Each point of the loop has one known set of WGMMAs in flight (ptxas serialises the
        // WGMMAs when it cannot tell), hence the explicit two-way unrolling.
        float sa0c, sa1c, sb0c, sb1c;  // scales of the block in flight
        float sa0n, sa1n, sb0n, sb1n;  // scales of the block issued next
        // Waits for the next block's stage, queues its WGMMAs into `dst` and reads its scales.
        auto start = [&](float (&dst)[kNumAccum], float& sa0, float& sa1, float& sb0, float& sb1) {
          sb0 = sb1 = 0.0f;
          ptx::mbar_wait(full_bar_s + stage * 8, phase);
          issue(stage, 0, dst);
          read_sb(stage, sb0, sb1);
          sa0 = smem_sa[stage * BLOCK_M + r_frag];
          sa1 = smem_sa[stage * BLOCK_M + r_frag + 8];
          if (++stage == STAGES) stage = 0, phase ^= 1;
        };
        // The block in `src` is complete: release its stage, promote it.
        // `last`: the tile's last block, whose stage kStageInRing holds for the epilogue.
        auto finish = [&](uint32_t s, float (&src)[kNumAccum], bool last) {
#pragma unroll
          for (int i = 0; i < kNumAccum; ++i) ptx::fence_operand(src[i]);
          if (!(kStageInRing && last && args.epi.tma_store)) release(s);
          promote_1d2d_at(bnd, final_acc[0], src, sa0c, sa1c, sb0c, sb1c);
        };
        // A grouped tile may have no K block (padding, empty group): nothing to start then.
        if (kG == Grouping::none || work.kb_end > work.kb_begin) {
          uint32_t cur_stage = stage;
          start(acc, sa0c, sa1c, sb0c, sb1c);
          release_held();  // the last tile's held stage, its store long issued
          for (uint32_t kb = work.kb_begin;;) {
            // acc holds block kb in flight.
            if (kb + 1 == work.kb_end) {
              ptx::wgmma_wait<0>();
              finish(cur_stage, acc, true);
              break;
            }
            uint32_t nxt_stage = stage;
            start(acc2, sa0n, sa1n, sb0n, sb1n);
            ptx::wgmma_wait<1>();
            finish(cur_stage, acc, false);
            cur_stage = nxt_stage, sa0c = sa0n, sa1c = sa1n, sb0c = sb0n, sb1c = sb1n;
            ++kb;
            // acc2 holds block kb in flight.
            if (kb + 1 == work.kb_end) {
              ptx::wgmma_wait<0>();
              finish(cur_stage, acc2, true);
              break;
            }
            nxt_stage = stage;
            start(acc, sa0n, sa1n, sb0n, sb1n);
            ptx::wgmma_wait<1>();
            finish(cur_stage, acc2, false);
            cur_stage = nxt_stage, sa0c = sa0n, sa1c = sa1n, sb0c = sb0n, sb1c = sb1n;
            ++kb;
          }
          // The last block's stage, not released by its finish (the one started last).
          if (kStageInRing && args.epi.tma_store) held = int32_t(stage == 0 ? STAGES - 1 : stage - 1);
        } else {
          release_held();  // a grouped tile without K blocks: its epilogue stages outside the ring
        }
      } else {
        for (uint32_t kb = work.kb_begin; kb < work.kb_end; ++kb) {
          float sb0 = 0.0f, sb1 = 0.0f;
          ptx::mbar_wait(kCarry ? c_bar : full_bar_s + stage * 8, phase);
          if constexpr (kCarry) {
            const float2 v = ptx::lds_f32x2(c_sb);
            sb0 = v.x;
            sb1 = T::kTwoSb ? v.y : 0.0f;
          }

          // Read the scales of this stage before releasing it.
          float sa0[W], sa1[W];
#pragma unroll
          for (int w = 0; w < W; ++w) {
            if constexpr (kCarry) {
              sa0[w] = ptx::lds_f32(c_sa + (w * 128 + r_frag) * 4);
              sa1[w] = ptx::lds_f32(c_sa + (w * 128 + r_frag + 8) * 4);
            } else {
              sa0[w] = smem_sa[stage * BLOCK_M + w * 128 + r_frag];
              sa1[w] = smem_sa[stage * BLOCK_M + w * 128 + r_frag + 8];
            }
          }
          // 1d1d on three math warpgroups: s_b read during the promotion, and the stage released
          // after it. NOTES: held in registers across the WGMMAs (32 of them), as with two
          // warpgroups, the s_b spilled (72 bytes of stack) at 160 registers.
          constexpr bool kLateSb = kB1x128 && T::kNumMathWG == 3;
          // 1d1d: s_b of columns 8j + c_frag + {0, 1}, from the stage.
          auto stage_sb = [&](int j) {
            return *reinterpret_cast<const float2*>(&smem_sb[stage * BLOCK_N + 8 * j + c_frag]);
          };
          float sbc[kB1x128 && !kLateSb ? BLOCK_N / 4 : 1];  // stage_sb(j) in 2j, 2j + 1
          if constexpr (kB1x128 && !kLateSb) {
#pragma unroll
            for (int j = 0; j < BLOCK_N / 8; ++j) {
              const float2 v = stage_sb(j);
              sbc[2 * j] = v.x;
              sbc[2 * j + 1] = v.y;
            }
          }

#pragma unroll
          for (int w = 0; w < W; ++w) {
            issue(stage, w, acc);
            if constexpr (kB1x128 && !kLateSb) {
              // NOTES: the 64 scale products s_a * s_b do not depend on the WGMMAs, and the
              // compiler placed them before the WGMMA issue, holding it back by 64 FMULs per K
              // block; the fence pins them behind the issue, where they overlap the Tensor Cores.
              // The scale reads stay before the issue: after it, ptxas put the fourth WGMMA
              // behind the reads and 40 of the products, delaying this warpgroup's last WGMMA of
              // the block (the Wgrad 10% slower).
#pragma unroll
              for (int k = 0; k < BLOCK_N / 4; ++k) ptx::fence_operand(sbc[k]);
              ptx::fence_operand(sa0[w]);
              ptx::fence_operand(sa1[w]);
            }
            ptx::wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < kNumAccum; ++i) ptx::fence_operand(acc[i]);

            auto advance = [&] {
              release(stage);
              if (++stage == STAGES) {
                stage = 0, phase ^= 1;
                if constexpr (kCarry) {
                  c_bar -= (STAGES - 1) * 8, c_a -= (STAGES - 1) * T::kSmemA, c_b -= (STAGES - 1) * T::kSmemB;
                  c_sa -= (STAGES - 1) * T::kSmemSA, c_sb -= (STAGES - 1) * T::kSmemSB;
                }
              } else if constexpr (kCarry) {
                c_bar += 8, c_a += T::kSmemA, c_b += T::kSmemB, c_sa += T::kSmemSA, c_sb += T::kSmemSB;
              }
            };
            if (!kLateSb && w == W - 1) advance();

            // Promotion: final += (s_a * s_b) * acc, in FP32 on the CUDA cores.
            float(&fa)[kNumAccum] = final_acc[w];
            if constexpr (kB1x128) {
#pragma unroll
              for (int j = 0; j < BLOCK_N / 8; ++j) {
                const float2 v = kLateSb ? stage_sb(j) : make_float2(sbc[2 * j], sbc[2 * j + 1]);
                fa[4 * j + 0] = fmaf(sa0[w] * v.x, acc[4 * j + 0], fa[4 * j + 0]);
                fa[4 * j + 1] = fmaf(sa0[w] * v.y, acc[4 * j + 1], fa[4 * j + 1]);
                fa[4 * j + 2] = fmaf(sa1[w] * v.x, acc[4 * j + 2], fa[4 * j + 2]);
                fa[4 * j + 3] = fmaf(sa1[w] * v.y, acc[4 * j + 3], fa[4 * j + 3]);
              }
              if (kLateSb && w == W - 1) advance();
            } else {
              promote_1d2d_at(bnd, fa, acc, sa0[w], sa1[w], sb0, sb1);
            }
          }
        }
      }

      // tail_split: a slice of the last wave; only the warpgroup that completes the tile goes on.
      if constexpr (kG == Grouping::tail_split)
        if (unit >= args.group.group_rows &&
            !join_slices<kNumAccum, T::kNumMathThreads>(final_acc[0], unit - args.group.group_rows, args.group, wg))
          continue;

      // Grouped: rows without a product get zeros (or stay untouched when accumulating), rows of
      // other groups are never written; a 64-row TMA store box is used only when all its rows may be
      // (else the rows that may be are written one by one: from the registers, or where the tile
      // compiles no direct stores, from the staging tile: copy_box_rows).
      uint32_t rows_ok = 3;  // bit i: this thread's row r_frag + 8*i may be written
      bool box_ok = true;
      if constexpr (kRowGroups) {
        if (unit + num_clusters < num_units) next_work = resolve(unit + num_clusters);
        bool mine_ok = true;
        rows_ok = apply_row_mask<BLOCK_N>(final_acc[0], row_mask, args.epi.accumulate, mine_ok);
        // NOTES: box_ok is the same for the whole warpgroup, but ptxas cannot tell from the barrier's
        // reduction: it then treated everything after the branch on it as divergent, kept the
        // ring's stage and phase of the next tiles in per-thread registers and moved every WGMMA
        // descriptor to the uniform datapath (R2UR, WARPSYNC) between the barrier wait and the
        // WGMMAs: 262 against the dense kernel's 233 instructions per two K blocks (128x128/pipe).
        // A warp reduction makes it visibly warp-uniform (as the K range above).
        if (T::kTmaStoreOk && args.epi.tma_store)
          box_ok = __reduce_and_sync(0xffffffffu, uint32_t(ptx::named_barrier_and(1 + wg, 128, mine_ok))) != 0;
      }

      // Staged-only tiles have no direct stores: a box not ok holds no rows to write (the host sees
      // to that), except where D += may leave padding rows of the contiguous GEMM inside a box:
      // there the box is staged and its rows to write copied from the staging tile.
      // NOTES: the copy compiled into the bf16-staged 128x128/pipe kernels (which never accumulate)
      // made ptxas re-derive the ring's shared addresses in their K loop (SR_CgaCtaId per K block).
      constexpr bool kMixedBoxes = T::kStagedOnly && kG == Grouping::contiguous && T::kStageF32;
      if (T::kTmaStoreOk && args.epi.tma_store && (box_ok || kMixedBoxes)) {
        using S = typename T::Staging;
        const bool leader = threadIdx.x % 128 == 0;
        auto stage_and_store = [&](auto pass) {
          constexpr int kPass = decltype(pass)::value;
          // The pass's staging tile: the warpgroup's own (at a shared address where kStageInRing) or
          // its 64 rows of the held stage's A tile.
          // NOTES: a generic pointer into the ring made ptxas re-derive the ring's shared addresses in
          // the K loop (SR_CgaCtaId per K block); shared addresses and st.shared do not.
          const bool in_ring = kStageInRing && kPass == 1 && held >= 0;
          uint8_t* stg = smem_stg + wg * S::kBytes;
          const uint32_t stg_s = in_ring ? smem_a_s + uint32_t(held) * T::kSmemA + wg * 64 * kBlockK
                                         : ptx::smem_addr(smem_stg) + wg * S::kBytes;
          // The previous TMA store must have read the staging tile before it is rewritten (the held
          // stage's A rows: read by this warpgroup's completed WGMMAs only).
          if (leader && !in_ring) ptx::bulk_wait_read();
          ptx::named_barrier_sync(1 + wg, 128);
          stage_fragment<BLOCK_N, T::kStageF32, T::kStagingPasses, kPass, kStageInRing>(
              final_acc[0], stg, (warp % 4) * 16 + lane / 4, c_frag, stg_s);
          ptx::fence_proxy_async_smem();
          ptx::named_barrier_sync(1 + wg, 128);
          const uint32_t row0 = m0 + wg * 64;
          if constexpr (kMixedBoxes) {
            if (!box_ok) {
              auto row_ok = [&](uint32_t r) {
                bool product, own;
                tile_row<kG>(work, args.group, m0, wg * 64 + r, args.M, product, own);
                return own && (product || !args.epi.accumulate);
              };
#pragma unroll 1
              for (int b = 0; b < S::kPassBoxes; ++b)
                copy_box_rows<T::kStageF32>(stg_s + b * S::kBoxBytes, args.epi, row0,
                                            n0 + (kPass * S::kPassBoxes + b) * S::kBoxCols, row_ok);
              // Read before the staging tile (or the held stage) is reused.
              ptx::named_barrier_sync(1 + wg, 128);
              return;
            }
          }
          if (leader && row0 < args.M) {
#pragma unroll
            for (int b = 0; b < S::kPassBoxes; ++b) {
              const uint32_t col0 = n0 + (kPass * S::kPassBoxes + b) * S::kBoxCols;
              if (col0 >= args.N) break;
              const uint32_t src = kStageInRing ? stg_s + b * S::kBoxBytes : ptx::smem_addr(stg + b * S::kBoxBytes);
              if (args.epi.accumulate)
                ptx::tma_reduce_add_2d(&tmap_d, src, int32_t(col0), int32_t(row0));
              else
                ptx::tma_store_2d(&tmap_d, src, int32_t(col0), int32_t(row0));
            }
            ptx::bulk_commit();
          }
        };
        stage_and_store(std::integral_constant<int, 0>{});
        if constexpr (T::kStagingPasses == 2) stage_and_store(std::integral_constant<int, 1>{});
      } else if constexpr (!T::kStagedOnly) {
#pragma unroll
        for (int w = 0; w < W; ++w)
          store_fragment<BLOCK_N>(final_acc[w], args.epi, m0 + w * 128 + r_frag, n0 + c_frag, rows_ok);
      }
    }
    // Outstanding TMA stores must complete before the CTA's shared memory goes away.
    if (T::kTmaStoreOk && args.epi.tma_store && threadIdx.x % 128 == 0) ptx::bulk_wait();
  }
#else
  // Built for an architecture without wgmma: never launched (the host checks sm_90).
  if (threadIdx.x == 0 && blockIdx.x == 0) __trap();
#endif
}

}  // namespace fp8moe::cuda
