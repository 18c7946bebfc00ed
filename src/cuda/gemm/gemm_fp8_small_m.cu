// FP8 GEMM for few rows of A (decode: M = 1..64 tokens), D [M, N] = A [M, K] * B [N, K]^T (+ D),
// A 1x128-scaled, B 128x128-scaled (kernel_api.hpp). At such M the GEMM only streams B, and its
// time is how many bytes of B are in flight against DRAM's latency: a few microseconds of reads,
// of which the first round trip is a large part. So B goes through a deep shared-memory ring fed
// by TMA (one producer thread per CTA, full/empty mbarriers), tens of KiB in flight per CTA and
// about 100-200 KiB per SM, and the math runs from shared memory on mma.sync with the operands'
// roles swapped (as in swap-AB decode kernels): B's rows are the M = 16 side of m16n8k32 (e4m3 in,
// f32 out), the tokens its N = 8 side.
//
// Work. A CTA owns row_warps 16-row slices of B (16 * row_warps rows: a 128x128 scale block never
// splits a slice) and all of K, in k_split chunks: chunk c holds the K blocks kb = c mod k_split.
// Consumer warp (slice r, chunk c) folds its chunk's blocks in K order; the chunks' sums are added
// in chunk order in shared memory. Stage i of the ring holds, for each chunk c, block i * k_split +
// c of the CTA's rows of B and of A (TMA boxes of 128 bytes per row, 128-byte swizzle; rows past N
// and tokens past M come in as zeros). The arithmetic per element is thus fixed by k_split, which
// depends on N and K only (small_m_k_split): not on M, the stages, the slices per CTA or the CTAs
// per SM, so a row of D has the same bits for any number of tokens.
//
// Fragments. Thread (g, t) (lane = 4 g + t) holds mma rows g and g + 8 (B rows pi(g), pi(g) + 8 of
// its slice) and mma column g (token pi(g) of each 8-token tile), 16 bytes at 16 t and 64 + 16 t of
// each 128-wide K block: the mma's k index is a permutation of the physical k, the same one for
// both operands, so the products pair up as in the plain layout:
//   mma 1: a = {lo.x, hi.x, lo.y, hi.y}, b = {x.x, x.y};  mma 2: a = {lo.z, hi.z, lo.w, hi.w}, b = {x.z, x.w}.
// pi(g) = (g >> 1) | (g & 1) << 2 puts the two rows a quarter-warp reads 4 rows apart, in the other
// half of the 128-byte swizzle pattern, so the 16-byte shared loads meet no bank conflicts.
// Promotion as the WGMMA kernel does it: each 128-wide K block sums in the Tensor Core from zero,
// then final = fmaf(s_a * s_b, partial, final) in FP32.
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/gemm/gemm_launch.cuh"
#include "cuda/gemm/kernels/ptx.cuh"
#include "cuda/kernel_api.hpp"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda {

namespace {

constexpr int kMaxStages = 32;
// Consumer warps per CTA: 16, or 8 from 32 tokens on, whose accumulators (4 per 8 tokens) need
// more registers than 17 warps of a CTA may hold without spilling.
constexpr int max_consumer_warps(int nt) { return nt >= 4 ? 8 : 16; }
// Shared memory: an SM's 228 KiB less 1 KiB per CTA (the system's), at most 227 KiB per CTA; the
// ring is 1024-aligned by hand (the 128-byte swizzle's pattern repeats every 1024 bytes).
constexpr int kSmemPerSm = 233472, kSmemPerCtaMax = 232448, kSmemReservedPerCta = 1024, kAlignPad = 1024;
constexpr int kStaticSmem = 2 * kMaxStages * int(sizeof(uint64_t));  // the mbarriers

__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct SmallMArgs {
  const float* sa;  // [K / 128, sa_ld] f32 (group-major)
  const float* sb;  // [ceil(N / 128), K / 128] f32
  void* d;          // [M, ldd] f32 | bf16
  int64_t sa_ld, ldd;
  int M, N, K;
  int k_split, row_warps, stages;
  bool accumulate;
};

// NT: 8-token tiles (M <= 8 * NT).
template <int NT, bool kBf16>
__global__ void __launch_bounds__(32 * (max_consumer_warps(NT) + 1), 1)
    small_m_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                        const SmallMArgs p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  const int S = p.k_split, RW = p.row_warps, P = p.stages;
  const int consumers = S * RW;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int BN = 16 * RW, MT = 8 * NT;
  const uint32_t chunk_bytes = uint32_t(BN + MT) * 128, stage_bytes = chunk_bytes * uint32_t(S);
  const int KB = p.K / 128, steps = (KB + S - 1) / S;
  const int n0 = int(blockIdx.x) * BN;
  const uint32_t ring = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  uint8_t* ring_ptr = smem_raw + (ring - ptx::smem_addr(smem_raw));

  if (threadIdx.x == 0) {
    for (int s = 0; s < P; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], uint32_t(consumers));
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;
  const int rs = warp / S, ck = warp % S;  // consumer warp: slice, chunk
  const int g = lane / 4, t = lane % 4;
  const int pg = (g >> 1) | ((g & 1) << 2);

  if (warp == consumers) {
    // Producer: one thread keeps every stage of the ring in flight.
    if (lane == 0) {
      ptx::prefetch_tmap(&map_a);
      ptx::prefetch_tmap(&map_b);
      int s = 0;
      uint32_t phase = 0;
      for (int i = 0; i < steps; ++i) {
        ptx::mbar_wait(&empty[s], phase ^ 1u);
        const int chunks = KB - i * S < S ? KB - i * S : S;
        ptx::mbar_arrive_expect_tx(&full[s], uint32_t(chunks) * chunk_bytes);
        uint8_t* stage = ring_ptr + size_t(s) * stage_bytes;
        for (int c = 0; c < chunks; ++c) {
          const int k = (i * S + c) * 128;
          ptx::tma_load_2d(&map_b, &full[s], stage + size_t(c) * chunk_bytes, k, n0);
          ptx::tma_load_2d(&map_a, &full[s], stage + size_t(c) * chunk_bytes + size_t(BN) * 128, k, 0);
        }
        if (++s == P) s = 0, phase ^= 1u;
      }
    }
  } else {
    // Consumer: rows pi(g) and pi(g) + 8 of slice rs, 16 bytes at chunks t and 4 + t of each row
    // (the swizzle XORs the 16-byte chunk index with the row's index mod 8, which is pi(g)).
    const uint32_t o0 = uint32_t(pg * 128 + ((t ^ pg) << 4)), o1 = uint32_t(pg * 128 + (((t | 4) ^ pg) << 4));
    const uint32_t b_off = uint32_t(ck) * chunk_bytes + uint32_t(rs) * 2048u;
    const uint32_t a_off = uint32_t(ck) * chunk_bytes + uint32_t(BN) * 128u;
    const int row0 = n0 + rs * 16;
    const float* sb_row = row0 < p.N ? p.sb + int64_t(row0 / 128) * KB : nullptr;
    int s = 0;
    uint32_t phase = 0;
    for (int i = 0; i < steps; ++i) {
      const int kb = i * S + ck;
      const bool live = kb < KB && sb_row != nullptr;
      // The scales do not depend on the stage: their loads fly during the wait.
      float sb = 0.f, sa[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int m = j * 8 + t;
        sa[j][0] = live && m < p.M ? __ldg(p.sa + int64_t(kb) * p.sa_ld + m) : 0.f;
        sa[j][1] = live && m + 4 < p.M ? __ldg(p.sa + int64_t(kb) * p.sa_ld + m + 4) : 0.f;
      }
      if (live) sb = __ldg(sb_row + kb);
      ptx::mbar_wait(&full[s], phase);
      if (live) {
        const uint32_t st = ring + uint32_t(s) * stage_bytes;
        const uint4 lo0 = ptx::lds_b32x4(st + b_off + o0), hi0 = ptx::lds_b32x4(st + b_off + 1024u + o0);
        const uint4 lo1 = ptx::lds_b32x4(st + b_off + o1), hi1 = ptx::lds_b32x4(st + b_off + 1024u + o1);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 x0 = ptx::lds_b32x4(st + a_off + uint32_t(j) * 1024u + o0);
          const uint4 x1 = ptx::lds_b32x4(st + a_off + uint32_t(j) * 1024u + o1);
          float part[4] = {0.f, 0.f, 0.f, 0.f};
          mma_e4m3(part, lo0.x, hi0.x, lo0.y, hi0.y, x0.x, x0.y);
          mma_e4m3(part, lo0.z, hi0.z, lo0.w, hi0.w, x0.z, x0.w);
          mma_e4m3(part, lo1.x, hi1.x, lo1.y, hi1.y, x1.x, x1.y);
          mma_e4m3(part, lo1.z, hi1.z, lo1.w, hi1.w, x1.z, x1.w);
          acc[j][0] = fmaf(sa[j][0] * sb, part[0], acc[j][0]);
          acc[j][1] = fmaf(sa[j][1] * sb, part[1], acc[j][1]);
          acc[j][2] = fmaf(sa[j][0] * sb, part[2], acc[j][2]);
          acc[j][3] = fmaf(sa[j][1] * sb, part[3], acc[j][3]);
        }
      }
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&empty[s]);
      if (++s == P) s = 0, phase ^= 1u;
    }
  }

  // D: acc[j][c] is row pi(g) (+ 8 for c >= 2) of the slice, token 8 j + t (+ 4 for odd c).
  auto store = [&](int j, int c, float v) {
    const int m = j * 8 + t + ((c & 1) ? 4 : 0), n = n0 + rs * 16 + pg + (c >= 2 ? 8 : 0);
    if (m >= p.M || n >= p.N) return;
    if constexpr (kBf16) {
      static_cast<__nv_bfloat16*>(p.d)[int64_t(m) * p.ldd + n] = __float2bfloat16_rn(v);
    } else {
      float* d = static_cast<float*>(p.d) + int64_t(m) * p.ldd + n;
      *d = p.accumulate ? *d + v : v;
    }
  };
  if (S == 1) {
    if (warp < consumers)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) store(j, c, acc[j][c]);
    return;
  }
  // Every stage has been waited for, so the TMA writes are done and the ring is free for the sums:
  // [warp][NT][4][32], lane-contiguous.
  __syncthreads();
  float* red = reinterpret_cast<float*>(ring_ptr);
  if (warp < consumers) {
    float* mine = red + size_t(warp) * NT * 4 * 32;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) mine[(j * 4 + c) * 32 + lane] = acc[j][c];
  }
  __syncthreads();
  if (warp >= consumers || ck != 0) return;
  // The chunks in chunk order: the same sum whatever the timing.
  const float* group = red + size_t(rs) * S * NT * 4 * 32;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float v = 0.f;
      for (int w = 0; w < S; ++w) v += group[(size_t(w) * NT * 4 + j * 4 + c) * 32 + lane];
      store(j, c, v);
    }
}

int token_tiles(int64_t M) { return M <= 8 ? 1 : M <= 16 ? 2 : M <= 32 ? 4 : 8; }

// The launch of `want` for this shape, every field resolved, and its dynamic shared memory.
struct SmallMLaunch {
  SmallMConfig cfg;
  size_t smem = 0;
};

SmallMLaunch resolve(int64_t M, int64_t N, int64_t K, const SmallMConfig& want) {
  auto pow2_upto = [](int v, int hi) { return v >= 1 && v <= hi && (v & (v - 1)) == 0; };
  FP8MOE_CHECK(want.k_split == 0 || pow2_upto(want.k_split, 8),
               "gemm_fp8_small_m: k_split must be 0 (chosen), 1, 2, 4 or 8, got " << want.k_split);
  FP8MOE_CHECK(want.row_warps == 0 || pow2_upto(want.row_warps, 16),
               "gemm_fp8_small_m: row_warps must be 0 (chosen) or a power of two up to 16, got " << want.row_warps);
  FP8MOE_CHECK(want.ctas_per_sm >= 0 && want.ctas_per_sm <= 8,
               "gemm_fp8_small_m: ctas_per_sm must be 0 (chosen) .. 8, got " << want.ctas_per_sm);
  FP8MOE_CHECK(want.stages >= 0 && want.stages <= kMaxStages,
               "gemm_fp8_small_m: stages must be 0 (chosen) .. " << kMaxStages << ", got " << want.stages);
  SmallMLaunch l;
  l.cfg = small_m_config(M, N, K, device_props().multiProcessorCount, want);
  SmallMConfig& c = l.cfg;
  FP8MOE_CHECK(c.k_split * c.row_warps <= max_consumer_warps(token_tiles(M)),
               "gemm_fp8_small_m: k_split " << c.k_split << " x row_warps " << c.row_warps << " warps, at most "
                                            << max_consumer_warps(token_tiles(M)) << " for M = " << M);
  const int64_t KB = K / 128, steps = (KB + c.k_split - 1) / c.k_split;
  const int64_t stage = int64_t(c.k_split) * (16 * c.row_warps + 8 * token_tiles(M)) * 128;
  const int64_t avail =
      std::min(kSmemPerCtaMax, kSmemPerSm / c.ctas_per_sm - kSmemReservedPerCta) - kAlignPad - kStaticSmem;
  const int64_t fit = std::min<int64_t>(avail / stage, kMaxStages);
  if (c.stages == 0) c.stages = int(std::min(fit, steps));
  FP8MOE_CHECK(c.stages >= 1 && c.stages <= fit,
               "gemm_fp8_small_m: " << small_m_config_name(c) << ": " << c.stages << " stages of " << stage
                                    << " bytes do not fit the " << avail << " bytes of shared memory a CTA gets");
  const int64_t red = c.k_split > 1 ? int64_t(c.k_split) * c.row_warps * token_tiles(M) * 4 * 32 * 4 : 0;
  FP8MOE_CHECK(red <= avail, "gemm_fp8_small_m: " << small_m_config_name(c) << ": the chunks' sums need " << red
                                                  << " bytes of shared memory, " << avail << " available");
  l.smem = size_t(std::max<int64_t>(red, c.stages * stage) + kAlignPad);
  return l;
}

template <int NT, bool kBf16>
void launch(const CUtensorMap& ma, const CUtensorMap& mb, const SmallMArgs& p, size_t smem, cudaStream_t stream) {
  auto kernel = small_m_gemm_kernel<NT, kBf16>;
  static const bool attr_set = [&] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kSmemPerCtaMax - kStaticSmem));
    return true;
  }();
  (void)attr_set;
  const int rows_per_cta = 16 * p.row_warps;
  const dim3 grid(unsigned((p.N + rows_per_cta - 1) / rows_per_cta));
  const unsigned threads = unsigned(32 * (p.k_split * p.row_warps + 1));
  kernel<<<grid, threads, smem, stream>>>(ma, mb, p);
  FP8MOE_CUDA_CHECK_LAUNCH("small_m_gemm_kernel");
}

template <int NT>
void launch(const CUtensorMap& ma, const CUtensorMap& mb, const SmallMArgs& p, bool bf16, size_t smem,
            cudaStream_t stream) {
  if (bf16) launch<NT, true>(ma, mb, p, smem, stream);
  else launch<NT, false>(ma, mb, p, smem, stream);
}

}  // namespace

SmallMConfig gemm_fp8_small_m_config(int64_t M, int64_t N, int64_t K, const SmallMConfig& want) {
  return resolve(M, N, K, want).cfg;
}

void gemm_fp8_small_m(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                      cudaStream_t stream, const SmallMConfig& want) {
  check_operand(a, "gemm_fp8_small_m", "a", ScaleKind::tile_1x128, false);
  check_operand(b, "gemm_fp8_small_m", "b", ScaleKind::block_128x128, false);
  const int64_t M = a.rows(), K = a.cols(), N = b.rows();
  FP8MOE_CHECK(M <= kSmallMMaxRows, "gemm_fp8_small_m: M = " << M << " rows of a, at most " << kSmallMMaxRows);
  FP8MOE_CHECK(b.cols() == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.values.str());
  FP8MOE_CHECK(K % 128 == 0 && K > 0, "a: K = " << K << " must be a positive multiple of 128 (pad K with zeros)");
  check_output(d, "gemm_fp8_small_m", M, N, accumulate);
  FP8MOE_CHECK(N < (int64_t(1) << 31) && K < (int64_t(1) << 31), "gemm_fp8_small_m: N and K must be below 2^31");
  const SmallMLaunch l = resolve(M, N, K, want);
  if (M == 0 || N == 0) return;
  const int nt = token_tiles(M);
  const CUtensorMap ma = make_values_map(a.values, uint32_t(8 * nt), "a.values");
  const CUtensorMap mb = make_values_map(b.values, uint32_t(16 * l.cfg.row_warps), "b.values");
  SmallMArgs p{};
  p.sa = a.scales.ptr<const float>();
  p.sa_ld = a.scales.strides[0];
  p.sb = b.scales.ptr<const float>();
  p.d = d.data;
  p.ldd = d.strides[0];
  p.M = int(M), p.N = int(N), p.K = int(K);
  p.k_split = l.cfg.k_split, p.row_warps = l.cfg.row_warps, p.stages = l.cfg.stages;
  p.accumulate = accumulate;
  const bool bf16 = d.dtype == DType::bf16;
  if (nt == 1) launch<1>(ma, mb, p, bf16, l.smem, stream);
  else if (nt == 2) launch<2>(ma, mb, p, bf16, l.smem, stream);
  else if (nt == 4) launch<4>(ma, mb, p, bf16, l.smem, stream);
  else launch<8>(ma, mb, p, bf16, l.smem, stream);
}

}  // namespace fp8moe::cuda
