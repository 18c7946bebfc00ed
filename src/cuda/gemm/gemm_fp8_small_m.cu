// FP8 GEMM for few rows of A (decode: M = 1..64 tokens), D [M, N] = A [M, K] * B [N, K]^T (+ D),
// A 1x128-scaled, B 128x128-scaled (kernel_api.hpp). At such M the GEMM only streams B: the
// WGMMA kernel's 64- or 128-row tiles waste most of their math and read B at a fraction of the
// copy bandwidth. Here the operands swap roles (as in swap-AB decode kernels): B's rows are the
// M = 16 side of an mma.sync m16n8k32 (e4m3 in, f32 out) and the tokens its N = 8 side, so that
// every byte of B is read once, 16 bytes per load, straight into the MMA's registers.
//
// Layout. A warp owns 16 rows of B (a 128x128 scale block never splits them) and a share of the
// K blocks; the warps of a CTA split K (kw of them per 16 rows) and add their sums in shared
// memory in a fixed order, so D is deterministic and no second kernel is needed. Thread (g, t)
// (lane = 4 g + t) loads B[row g][k0 + 16 t, +16) and B[row g + 8][...] of each 64-wide K step,
// and A[token g][the same 16 k]; the mma's k index is a permutation of the physical k, the same one
// for both operands, so the products pair up as in the plain layout:
//   mma 1: a = {lo.x, hi.x, lo.y, hi.y}, b = {x.x, x.y};  mma 2: a = {lo.z, hi.z, lo.w, hi.w}, b = {x.z, x.w}.
// Promotion as the WGMMA kernel does it: each 128-wide K block sums in the Tensor Core from zero,
// then final += (s_a * s_b) * partial in FP32.
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/gemm/gemm_launch.cuh"
#include "cuda/kernel_api.hpp"
#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda {

namespace {

// B is read once: past L1 (no allocation there), 16 bytes per thread.
__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct SmallMArgs {
  const uint8_t* a;   // [M, K] e4m3
  const float* sa;    // [K / 128, sa_ld] f32 (group-major)
  const uint8_t* b;   // [N, K] e4m3
  const float* sb;    // [ceil(N / 128), K / 128] f32
  void* d;            // [M, ldd] f32 | bf16
  int64_t sa_ld, ldd;
  int M, N, K;
  int kw;             // warps splitting K per 16 rows
  bool accumulate;
};

// One K block of B in registers: rows g and g + 8 of both 64-wide halves ([half * 2 + (row g + 8)]).
struct BlockB {
  uint4 v[4];
};

__device__ __forceinline__ void load_block(int kb, const uint8_t* b_lo, const uint8_t* b_hi, BlockB& r) {
  const uint4 z = make_uint4(0, 0, 0, 0);
  const int64_t k = int64_t(kb) * 128;
  r.v[0] = b_lo ? load_stream(b_lo + k) : z;
  r.v[1] = b_hi ? load_stream(b_hi + k) : z;
  r.v[2] = b_lo ? load_stream(b_lo + k + 64) : z;
  r.v[3] = b_hi ? load_stream(b_hi + k + 64) : z;
}

// CTAs of 8 warps, each warp with kDepth blocks of B (2 KiB each) in flight: a decode GEMM is a
// few microseconds of DRAM reads, so the bytes requested at once and the waves of CTAs, not the
// math, set its time. Up to 8 tokens three CTAs fit on an SM (80 registers; deeper rings need more
// registers, fewer CTAs, and measured no faster), two up to 32, one for 64.
constexpr int kThreads = 256;
constexpr int kDepth = 2;
template <int NT>
constexpr int kMinBlocks = NT <= 1 ? 3 : NT <= 4 ? 2 : 1;

template <int NT, bool kBf16>
__global__ void __launch_bounds__(kThreads, kMinBlocks<NT>) small_m_gemm_kernel(const SmallMArgs p) {
  extern __shared__ float red[];  // [warps][NT][4][32]: each warp's sums, lane-contiguous
  constexpr int D = kDepth;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int rows_per_cta = int(blockDim.x) / 32 / p.kw;
  const int rg = warp / p.kw, ks = warp % p.kw;
  const int n0 = (int(blockIdx.x) * rows_per_cta + rg) * 16;
  const int KB = p.K / 128;

  // Rows past N and tokens past M load nothing and stay zero.
  const uint8_t* b_lo = n0 + g < p.N ? p.b + int64_t(n0 + g) * p.K + t * 16 : nullptr;
  const uint8_t* b_hi = n0 + g + 8 < p.N ? p.b + int64_t(n0 + g + 8) * p.K + t * 16 : nullptr;
  const uint8_t* a_g = p.a + int64_t(g) * p.K + t * 16;  // token g of n tile 0
  const float* sb_row = n0 < p.N ? p.sb + int64_t(n0 / 128) * KB : nullptr;

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;

  // A ring of D blocks of B: block kb + D * kw is requested as soon as block kb has been used. A (a
  // few KiB, read by every CTA) comes from L1 and L2 as it is used.
  BlockB ring[D];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (ks + d * p.kw < KB) load_block(ks + d * p.kw, b_lo, b_hi, ring[d]);
#pragma unroll 1
  for (int kb0 = ks; kb0 < KB; kb0 += D * p.kw) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int kb = kb0 + d * p.kw;
      if (kb >= KB) break;
      const BlockB& cur = ring[d];
      const float sb = sb_row ? __ldg(sb_row + kb) : 0.f;
      const int64_t k = int64_t(kb) * 128;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const bool row_ok = j * 8 + g < p.M;
        const uint4 z = make_uint4(0, 0, 0, 0);
        const uint8_t* a = a_g + int64_t(j) * 8 * p.K + k;
        const uint4 x0 = row_ok ? __ldg(reinterpret_cast<const uint4*>(a)) : z;
        const uint4 x1 = row_ok ? __ldg(reinterpret_cast<const uint4*>(a + 64)) : z;
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        mma_e4m3(part, cur.v[0].x, cur.v[1].x, cur.v[0].y, cur.v[1].y, x0.x, x0.y);
        mma_e4m3(part, cur.v[0].z, cur.v[1].z, cur.v[0].w, cur.v[1].w, x0.z, x0.w);
        mma_e4m3(part, cur.v[2].x, cur.v[3].x, cur.v[2].y, cur.v[3].y, x1.x, x1.y);
        mma_e4m3(part, cur.v[2].z, cur.v[3].z, cur.v[2].w, cur.v[3].w, x1.z, x1.w);
        const int m = j * 8 + t * 2;
        const float sa0 = m < p.M ? __ldg(p.sa + kb * p.sa_ld + m) : 0.f;
        const float sa1 = m + 1 < p.M ? __ldg(p.sa + kb * p.sa_ld + m + 1) : 0.f;
        acc[j][0] = fmaf(sa0 * sb, part[0], acc[j][0]);
        acc[j][1] = fmaf(sa1 * sb, part[1], acc[j][1]);
        acc[j][2] = fmaf(sa0 * sb, part[2], acc[j][2]);
        acc[j][3] = fmaf(sa1 * sb, part[3], acc[j][3]);
      }
      // Its registers are free once the MMAs have read them.
      if (kb + D * p.kw < KB) load_block(kb + D * p.kw, b_lo, b_hi, ring[d]);
    }
  }

  float* mine = red + size_t(warp) * NT * 4 * 32;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) mine[(j * 4 + c) * 32 + lane] = acc[j][c];
  __syncthreads();
  if (ks != 0) return;
  // The K shares in warp order: the same sum whatever the timing.
  const float* group = red + size_t(rg) * p.kw * NT * 4 * 32;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float s = 0.f;
      for (int w = 0; w < p.kw; ++w) s += group[(size_t(w) * NT * 4 + j * 4 + c) * 32 + lane];
      const int m = j * 8 + t * 2 + (c & 1), n = n0 + g + (c >= 2 ? 8 : 0);
      if (m >= p.M || n >= p.N) continue;
      if constexpr (kBf16) {
        static_cast<__nv_bfloat16*>(p.d)[int64_t(m) * p.ldd + n] = __float2bfloat16_rn(s);
      } else {
        float* d = static_cast<float*>(p.d) + int64_t(m) * p.ldd + n;
        *d = p.accumulate ? *d + s : s;
      }
    }
}

template <int NT, bool kBf16>
int ctas_per_sm() {
  static const int n = [] {
    int v = 0;
    FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &v, small_m_gemm_kernel<NT, kBf16>, kThreads, size_t(kThreads / 32) * NT * 4 * 32 * sizeof(float)));
    return std::max(v, 1);
  }();
  return n;
}

// Warps per 16-row slice along K (1, 2, 4, 8): the most that keep every CTA in one wave, each warp
// with at least kDepth blocks where K has them. A second, partial wave costs a whole DRAM round
// trip more than fewer warps per slice with more blocks each.
int choose_k_split(int N, int KB, int slots) {
  const int slices = (N + 15) / 16, warps = kThreads / 32;
  int best = 1;
  for (int kw = 1; kw <= warps; kw *= 2) {
    if (kw > 1 && KB < kw * kDepth) break;
    const int ctas = (slices * kw + warps - 1) / warps;
    if (ctas <= slots) best = kw;
  }
  return best;
}

template <int NT, bool kBf16>
void launch(const SmallMArgs& p, int k_split, cudaStream_t stream) {
  const int warps = kThreads / 32;
  const int slots = ctas_per_sm<NT, kBf16>() * device_props().multiProcessorCount;
  SmallMArgs q = p;
  q.kw = k_split > 0 ? k_split : choose_k_split(p.N, p.K / 128, slots);
  const int rows_per_cta = warps / q.kw * 16;
  const dim3 grid(unsigned((p.N + rows_per_cta - 1) / rows_per_cta));
  const size_t smem = size_t(warps) * NT * 4 * 32 * sizeof(float);
  small_m_gemm_kernel<NT, kBf16><<<grid, kThreads, smem, stream>>>(q);
  FP8MOE_CUDA_CHECK_LAUNCH("small_m_gemm_kernel");
}

template <int NT>
void launch(const SmallMArgs& p, bool bf16, int k_split, cudaStream_t stream) {
  if (bf16) launch<NT, true>(p, k_split, stream);
  else launch<NT, false>(p, k_split, stream);
}

}  // namespace

void gemm_fp8_small_m(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                      cudaStream_t stream, int k_split) {
  FP8MOE_CHECK(k_split == 0 || k_split == 1 || k_split == 2 || k_split == 4 || k_split == 8,
               "gemm_fp8_small_m: k_split must be 0 (chosen), 1, 2, 4 or 8, got " << k_split);
  check_operand(a, "gemm_fp8_small_m", "a", ScaleKind::tile_1x128, false);
  check_operand(b, "gemm_fp8_small_m", "b", ScaleKind::block_128x128, false);
  const int64_t M = a.rows(), K = a.cols(), N = b.rows();
  FP8MOE_CHECK(M <= kSmallMMaxRows, "gemm_fp8_small_m: M = " << M << " rows of a, at most " << kSmallMMaxRows);
  FP8MOE_CHECK(b.cols() == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.values.str());
  FP8MOE_CHECK(K % 128 == 0 && K > 0, "a: K = " << K << " must be a positive multiple of 128 (pad K with zeros)");
  check_output(d, "gemm_fp8_small_m", M, N, accumulate);
  FP8MOE_CHECK(N < (int64_t(1) << 31) && K < (int64_t(1) << 31), "gemm_fp8_small_m: N and K must be below 2^31");
  if (M == 0 || N == 0) return;
  SmallMArgs p{};
  p.a = a.values.ptr<const uint8_t>();
  p.sa = a.scales.ptr<const float>();
  p.sa_ld = a.scales.strides[0];
  p.b = b.values.ptr<const uint8_t>();
  p.sb = b.scales.ptr<const float>();
  p.d = d.data;
  p.ldd = d.strides[0];
  p.M = int(M), p.N = int(N), p.K = int(K);
  p.accumulate = accumulate;
  const bool bf16 = d.dtype == DType::bf16;
  if (M <= 8) launch<1>(p, bf16, k_split, stream);
  else if (M <= 16) launch<2>(p, bf16, k_split, stream);
  else if (M <= 32) launch<4>(p, bf16, k_split, stream);
  else launch<8>(p, bf16, k_split, stream);
}

}  // namespace fp8moe::cuda
