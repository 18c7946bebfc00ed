// The Tensor Cores' ceiling under the board's power cap (bench_util.hpp: tensor_ceiling, Ceilings;
// `fp8moe bench gemm --ceiling`, `bench grouped --ceiling`, docs/PERF-log.md "The Tensor Cores'
// ceiling"): a GEMM's FLOPs as back-to-back FP8 WGMMAs on operands held in shared memory, with no
// loads, no epilogue and no partly filled tiles or waves, spread evenly over one CTA per SM. Timed
// beside the GEMMs (Timer::interleaved) it runs in the same power state of the board. A kernel that
// issues the same tensor work cannot be faster: it adds the memory traffic (power, so a lower clock
// under the cap), the tiles and the waves.
//   bare:          two warpgroups of m64n256k32 WGMMAs accumulating in the Tensor Core over the
//                  whole loop: the ceiling of any FP8 GEMM;
//   promote_1d2d:  the math of our pipelined 128x128 tile alone: two warpgroups of m64n128k32, the
//                  WGMMAs of K block k+1 queued before block k is promoted (fin += s_a s_b acc, one
//                  FFMA per accumulator, the scales read from shared memory);
//   promote_1d1d:  the same with the Wgrad's per-column scales (s_a * s_b[col] per accumulator:
//                  FMUL + FFMA).
// Operands: each CTA holds one K block of rows of the case's own A and B (so the Tensor Cores see
// the same data statistics as the GEMM's), every scale `scale`.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>

#include "bench/bench_util.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/gemm/kernels/mma.cuh"
#include "cuda/gemm/kernels/ptx.cuh"

namespace fp8moe::cuda::bench {

namespace {

constexpr int kWG = 2;             // math warpgroups of a CTA (one CTA per SM)
constexpr int kRows = 64 * kWG;    // A rows in shared memory
constexpr int kScaleSlots = 8;     // K blocks of scales cycled through

constexpr int tile_n(CeilingMode m) { return m == CeilingMode::bare ? 256 : 128; }
constexpr int smem_bytes(CeilingMode m) { return 1024 + (kRows + tile_n(m)) * 128 + kScaleSlots * (kRows + tile_n(m)) * 4; }

template <int kAcc>
__device__ __forceinline__ void fence_all(float (&r)[kAcc]) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) ptx::fence_operand(r[i]);
}

// One 128-wide K block: four m64nNk32 WGMMAs into acc (restarted from zero unless `keep`), committed.
template <class Mma>
__device__ __forceinline__ void issue_block(uint64_t da, uint64_t db, float (&acc)[Mma::kNumAccum], bool keep) {
  fence_all(acc);
  ptx::wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k) Mma::mma(da + 2 * k, db + 2 * k, acc, keep || k > 0);  // 32 bytes of K = 2 units
  ptx::wgmma_commit();
  fence_all(acc);
}

// fin += (s_a * s_b) * acc for the fragment of m64n128 (mma.cuh): rows r0 and r0 + 8 of the CTA's
// tile; 1d2d: one s_b per K block, 1d1d: s_b per column.
template <CeilingMode kMode>
__device__ __forceinline__ void promote(float (&fin)[64], const float (&acc)[64], const float* ssa, const float* ssb,
                                        int r0, int l) {
  const float sa0 = ssa[r0], sa1 = ssa[r0 + 8];
  if constexpr (kMode == CeilingMode::promote_1d2d) {
    const float s0 = sa0 * ssb[0], s1 = sa1 * ssb[0];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      fin[4 * j + 0] = fmaf(s0, acc[4 * j + 0], fin[4 * j + 0]);
      fin[4 * j + 1] = fmaf(s0, acc[4 * j + 1], fin[4 * j + 1]);
      fin[4 * j + 2] = fmaf(s1, acc[4 * j + 2], fin[4 * j + 2]);
      fin[4 * j + 3] = fmaf(s1, acc[4 * j + 3], fin[4 * j + 3]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 sb = *reinterpret_cast<const float2*>(ssb + 8 * j + 2 * (l % 4));
      fin[4 * j + 0] = fmaf(sa0 * sb.x, acc[4 * j + 0], fin[4 * j + 0]);
      fin[4 * j + 1] = fmaf(sa0 * sb.y, acc[4 * j + 1], fin[4 * j + 1]);
      fin[4 * j + 2] = fmaf(sa1 * sb.x, acc[4 * j + 2], fin[4 * j + 2]);
      fin[4 * j + 3] = fmaf(sa1 * sb.y, acc[4 * j + 3], fin[4 * j + 3]);
    }
  }
}

template <CeilingMode kMode>
__global__ void __launch_bounds__(128 * kWG, 1)
    tensor_ceiling_kernel(const uint8_t* __restrict__ a, int64_t M, const uint8_t* __restrict__ b, int64_t N,
                          int64_t K, int64_t blocks, float scale, float* __restrict__ d, int d_cta) {
  constexpr int kN = tile_n(kMode);
  using Mma = WgmmaFp8<kN>;
  extern __shared__ uint8_t ceiling_raw[];
  uint8_t* const sa = ceiling_raw + ((1024 - ptx::smem_addr(ceiling_raw) % 1024) % 1024);  // [kRows][128 B]
  uint8_t* const sb = sa + kRows * 128;                                                      // [kN][128 B]
  float* const ssa = reinterpret_cast<float*>(sb + kN * 128);                                // [slot][kRows]
  float* const ssb = ssa + kScaleSlots * kRows;                                              // [slot][kN]
  // The CTA's operands: one K block of rows of A and B from its own place in the case's tensors.
  const int64_t k0 = (blockIdx.x % (K / 128)) * 128;
  const int64_t m0 = M > kRows ? (int64_t(blockIdx.x) * kRows) % (M - kRows + 1) : 0;
  const int64_t n0 = N > kN ? (int64_t(blockIdx.x) * kN) % (N - kN + 1) : 0;
  load_k128b_swizzled(sa, a + m0 * K + k0, kRows, K, std::min<int64_t>(M, kRows));
  load_k128b_swizzled(sb, b + n0 * K + k0, kN, K, std::min<int64_t>(N, kN));
  for (int i = threadIdx.x; i < kScaleSlots * (kRows + kN); i += blockDim.x) ssa[i] = scale;
  ptx::fence_proxy_async_smem();  // the threads' stores, visible to the WGMMAs' reads
  __syncthreads();

  const int wg = threadIdx.x / 128, w = threadIdx.x / 32 % 4, l = threadIdx.x % 32;
  const uint64_t da = make_smem_desc_k128b(ptx::smem_addr(sa + wg * 64 * 128));
  const uint64_t db = make_smem_desc_k128b(ptx::smem_addr(sb));
  const int r0 = wg * 64 + 16 * w + l / 4;  // the fragment's first row in the CTA's tile
  float fin[Mma::kNumAccum];
#pragma unroll
  for (int i = 0; i < Mma::kNumAccum; ++i) fin[i] = 0.0f;
  if constexpr (kMode == CeilingMode::bare) {
    for (int64_t kb = 0; kb < blocks; ++kb) {
      issue_block<Mma>(da, db, fin, true);
      ptx::wgmma_wait<1>();
    }
    ptx::wgmma_wait<0>();
    fence_all(fin);
  } else {
    // The loop of the GEMM's pipelined mainloop: block kb + 1 is queued before block kb is
    // promoted; each point of the loop has one known set of WGMMAs in flight (ptxas serialises the
    // WGMMAs when it cannot tell), hence the two-way unrolling.
    float acc0[64], acc1[64];
    auto scales = [&](int64_t kb, const float*& sa_kb, const float*& sb_kb) {
      sa_kb = ssa + (kb % kScaleSlots) * kRows, sb_kb = ssb + (kb % kScaleSlots) * kN;
    };
    const float *sa_c, *sb_c, *sa_n, *sb_n;
    issue_block<Mma>(da, db, acc0, false);
    scales(0, sa_c, sb_c);
    for (int64_t kb = 0;;) {
      // acc0 holds block kb in flight.
      if (kb + 1 == blocks) {
        ptx::wgmma_wait<0>();
        fence_all(acc0);
        promote<kMode>(fin, acc0, sa_c, sb_c, r0, l);
        break;
      }
      issue_block<Mma>(da, db, acc1, false);
      scales(kb + 1, sa_n, sb_n);
      ptx::wgmma_wait<1>();
      fence_all(acc0);
      promote<kMode>(fin, acc0, sa_c, sb_c, r0, l);
      sa_c = sa_n, sb_c = sb_n;
      ++kb;
      // acc1 holds block kb in flight.
      if (kb + 1 == blocks) {
        ptx::wgmma_wait<0>();
        fence_all(acc1);
        promote<kMode>(fin, acc1, sa_c, sb_c, r0, l);
        break;
      }
      issue_block<Mma>(da, db, acc0, false);
      scales(kb + 1, sa_n, sb_n);
      ptx::wgmma_wait<1>();
      fence_all(acc1);
      promote<kMode>(fin, acc1, sa_c, sb_c, r0, l);
      sa_c = sa_n, sb_c = sb_n;
      ++kb;
    }
  }
  if (int(blockIdx.x) != d_cta) return;
  // Fragment (mma.cuh): fin[4j + 2i + c] is row 16w + l/4 + 8i, column 8j + 2(l%4) + c.
#pragma unroll
  for (int j = 0; j < kN / 8; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float* row = d + int64_t(r0 + 8 * i) * kN + 8 * j + 2 * (l % 4);
      row[0] = fin[4 * j + 2 * i];
      row[1] = fin[4 * j + 2 * i + 1];
    }
}

template <CeilingMode kMode>
void launch(const uint8_t* a, int64_t M, const uint8_t* b, int64_t N, int64_t K, int64_t blocks, float scale, float* d,
            int d_cta, cudaStream_t stream) {
  static const bool configured = [] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(tensor_ceiling_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           smem_bytes(kMode)));
    return true;
  }();
  (void)configured;
  tensor_ceiling_kernel<kMode><<<ceiling_ctas(), 128 * kWG, smem_bytes(kMode), stream>>>(a, M, b, N, K, blocks, scale,
                                                                                          d, d_cta);
  FP8MOE_CUDA_CHECK_LAUNCH("tensor_ceiling_kernel");
}

}  // namespace

int ceiling_ctas() { return device_props().multiProcessorCount; }
int ceiling_tile_rows() { return kRows; }
int ceiling_tile_cols(CeilingMode mode) { return tile_n(mode); }

double ceiling_block_flops(CeilingMode mode) { return 2.0 * kRows * tile_n(mode) * 128 * ceiling_ctas(); }

int64_t ceiling_blocks(CeilingMode mode, double flops) {
  return std::max<int64_t>(1, int64_t(std::ceil(flops / ceiling_block_flops(mode))));
}

void tensor_ceiling(CeilingMode mode, const void* a, int64_t M, const void* b, int64_t N, int64_t K, int64_t blocks,
                    float scale, float* d, int d_cta, cudaStream_t stream) {
  FP8MOE_CHECK(a && b && M > 0 && N > 0 && K > 0 && K % 128 == 0,
               "tensor_ceiling: needs e4m3 operands [M, K] and [N, K] with K a positive multiple of 128, got M = "
                   << M << ", N = " << N << ", K = " << K);
  FP8MOE_CHECK(reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0,
               "tensor_ceiling: operands must be 16-byte aligned");
  FP8MOE_CHECK(blocks > 0, "tensor_ceiling: blocks must be positive, got " << blocks);
  FP8MOE_CHECK(sm90_available(), "tensor_ceiling: needs an sm_90a GPU");
  const auto* pa = static_cast<const uint8_t*>(a);
  const auto* pb = static_cast<const uint8_t*>(b);
  switch (mode) {
    case CeilingMode::bare: return launch<CeilingMode::bare>(pa, M, pb, N, K, blocks, scale, d, d_cta, stream);
    case CeilingMode::promote_1d2d:
      return launch<CeilingMode::promote_1d2d>(pa, M, pb, N, K, blocks, scale, d, d_cta, stream);
    case CeilingMode::promote_1d1d:
      return launch<CeilingMode::promote_1d1d>(pa, M, pb, N, K, blocks, scale, d, d_cta, stream);
  }
}

Ceilings::Ceilings(bool b_1x128, double case_flops)
    : mode{CeilingMode::bare, b_1x128 ? CeilingMode::promote_1d1d : CeilingMode::promote_1d2d},
      blocks{ceiling_blocks(mode[0], case_flops), ceiling_blocks(mode[1], case_flops)},
      flops(case_flops) {}

std::vector<std::function<void()>> Ceilings::launches(const QuantizedView& a, const QuantizedView& b) const {
  std::vector<std::function<void()>> v;
  for (int c = 0; c < 2; ++c)
    for (int64_t n : {blocks[c], int64_t(1)})
      v.push_back([=, this] {
        tensor_ceiling(mode[c], a.values.data, a.values.size(0), b.values.data, b.values.size(0), a.values.size(1), n,
                       1.0f, nullptr, -1, nullptr);
      });
  return v;
}

double Ceilings::us(int c) const {
  const double per_block =
      blocks[c] > 1 ? (t[c].us - t_one[c].us) / double(blocks[c] - 1) : t[c].us;  // one block: with the overhead
  return per_block * flops / ceiling_block_flops(mode[c]);
}

std::string Ceilings::line(double t_ours, double t_ref, const char* ref) const {
  auto tf = [&](double us) { return flops / (us * 1e-6) / 1e12; };
  char s[512];
  std::snprintf(s, sizeof s,
                "#   Tensor Core ceiling: bare %.1f us, %.0f TFLOPS at %.3f GHz | promoted %s %.1f us, %.0f TFLOPS at "
                "%.3f GHz; ours at %.1f%% / %.1f%% of them, %s at %.1f%% / %.1f%%",
                us(0), tf(us(0)), t[0].ghz, mode[1] == CeilingMode::promote_1d1d ? "1d1d" : "1d2d", us(1), tf(us(1)),
                t[1].ghz, 100 * us(0) / t_ours, 100 * us(1) / t_ours, ref, 100 * us(0) / t_ref, 100 * us(1) / t_ref);
  return s;
}

}  // namespace fp8moe::cuda::bench
