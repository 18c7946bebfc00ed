// The Tensor Core's own FP8 accumulation, measured on the hardware: D [M, N] f32 = A [M, K] *
// B [N, K]^T with raw e4m3 values (unit scales) through m64n128k32 WGMMAs whose running sum stays in
// the Tensor Core for `promote_every` elements of K and is then added to FP32 registers on the CUDA
// cores: the hardware that AccumMode::tensor_core (gemm_ref.hpp) models, at any promotion interval,
// including none (the report's §3.3.2 experiment). It is a probe, not a fast kernel: one warpgroup
// per CTA and 64 x 128 outputs, each 128-wide K block copied into shared memory by the threads
// themselves in the 128-byte swizzle the WGMMA descriptors read, one WGMMA (32 elements of K) at a
// time, each waited for, so that the promotion points can fall after any of them.
#include <cuda_runtime.h>

#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/codecs.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/gemm/kernels/mma.cuh"

namespace fp8moe::cuda {

namespace {

constexpr int kProbeM = 64, kProbeN = 128, kProbeK = 128;  // outputs of a CTA; K bytes per shared-memory block
constexpr int kProbeSmem = 1024 + (kProbeM + kProbeN) * kProbeK;

__global__ void __launch_bounds__(128) wgmma_accumulate_kernel(const uint8_t* __restrict__ a,
                                                               const uint8_t* __restrict__ b, float* __restrict__ d,
                                                               int64_t N, int64_t K, int promote_steps) {
  extern __shared__ uint8_t probe_raw[];
  uint8_t* const sa = probe_raw + ((1024 - ptx::smem_addr(probe_raw) % 1024) % 1024);  // [64][128 B]
  uint8_t* const sb = sa + kProbeM * kProbeK;                                            // [128][128 B]
  const int64_t m0 = int64_t(blockIdx.x) * kProbeM, n0 = int64_t(blockIdx.y) * kProbeN;
  using Mma = WgmmaFp8<kProbeN>;
  float acc[Mma::kNumAccum], tc[Mma::kNumAccum];
#pragma unroll
  for (int i = 0; i < Mma::kNumAccum; ++i) acc[i] = tc[i] = 0.0f;
  const int64_t steps = K / 32;
  int64_t s = 0;  // WGMMAs issued
  for (int64_t k0 = 0; k0 < K; k0 += kProbeK) {
    load_k128b_swizzled(sa, a + m0 * K + k0, kProbeM, K, kProbeM);
    load_k128b_swizzled(sb, b + n0 * K + k0, kProbeN, K, kProbeN);
    ptx::fence_proxy_async_smem();  // the threads' stores, visible to the WGMMAs' reads
    __syncthreads();
    const uint64_t desc_a = make_smem_desc_k128b(ptx::smem_addr(sa)), desc_b = make_smem_desc_k128b(ptx::smem_addr(sb));
#pragma unroll 1
    for (int k = 0; k < kProbeK / 32; ++k, ++s) {
      // The Tensor Core sum restarts after each promotion (scale-d = 0: D = A * B).
      const bool keep = promote_steps == 0 ? s > 0 : s % promote_steps != 0;
#pragma unroll
      for (int i = 0; i < Mma::kNumAccum; ++i) ptx::fence_operand(tc[i]);
      ptx::wgmma_fence();
      Mma::mma(desc_a + 2 * k, desc_b + 2 * k, tc, keep);  // 32 e4m3 = 32 bytes = 2 address units
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < Mma::kNumAccum; ++i) ptx::fence_operand(tc[i]);
      if ((promote_steps != 0 && (s + 1) % promote_steps == 0) || s + 1 == steps) {
#pragma unroll
        for (int i = 0; i < Mma::kNumAccum; ++i) acc[i] += tc[i];
      }
    }
    __syncthreads();  // every WGMMA has read the tiles before the next block overwrites them
  }
  // Accumulator fragment (mma.cuh): acc[4j + 2i + c] is row 16w + l/4 + 8i, column 8j + 2(l%4) + c.
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kProbeN / 8; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float* row = d + (m0 + 16 * w + l / 4 + 8 * i) * N + n0 + 8 * j + 2 * (l % 4);
      row[0] = acc[4 * j + 2 * i];
      row[1] = acc[4 * j + 2 * i + 1];
    }
}

void check_probe_operand(const TensorView& t, const char* arg, int64_t rows_multiple) {
  FP8MOE_CHECK(t.data != nullptr && t.ndim == 2 && t.dtype == DType::e4m3,
               "wgmma_accumulate: " << arg << " must be a 2-D e4m3 tensor, got " << t.str());
  FP8MOE_CHECK(t.device == Device::cuda && t.is_contiguous(),
               "wgmma_accumulate: " << arg << " must be a contiguous GPU tensor, got " << t.str());
  FP8MOE_CHECK(t.size(0) % rows_multiple == 0,
               "wgmma_accumulate: " << arg << " rows must be a multiple of " << rows_multiple << ", got " << t.str());
  FP8MOE_CHECK(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, "wgmma_accumulate: " << arg << " must be 16-byte aligned");
}

}  // namespace

void wgmma_accumulate(const TensorView& a, const TensorView& b, const TensorView& d, int promote_every,
                      cudaStream_t stream) {
  check_probe_operand(a, "a", kProbeM);
  check_probe_operand(b, "b", kProbeN);
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  FP8MOE_CHECK(b.size(1) == K, "wgmma_accumulate: b must have K = " << K << " columns, got " << b.str());
  FP8MOE_CHECK(K > 0 && K % kProbeK == 0, "wgmma_accumulate: K = " << K << " must be a positive multiple of 128");
  FP8MOE_CHECK(promote_every >= 0 && promote_every % 32 == 0,
               "wgmma_accumulate: promote_every must be 0 (never) or a positive multiple of 32 (one WGMMA), got "
                   << promote_every);
  FP8MOE_CHECK(d.data != nullptr && d.ndim == 2 && d.dtype == DType::f32 && d.device == Device::cuda &&
                   d.is_contiguous() && d.size(0) == M && d.size(1) == N,
               "wgmma_accumulate: d must be a contiguous f32 GPU tensor [" << M << ", " << N << "], got " << d.str());
  FP8MOE_CHECK(sm90_available(), "wgmma_accumulate: needs an sm_90a GPU");
  if (M == 0 || N == 0) return;
  FP8MOE_CHECK(M / kProbeM <= INT32_MAX && N / kProbeN <= 65535, "wgmma_accumulate: M or N too large");
  const dim3 grid(unsigned(M / kProbeM), unsigned(N / kProbeN));
  wgmma_accumulate_kernel<<<grid, 128, kProbeSmem, stream>>>(static_cast<const uint8_t*>(a.data),
                                                             static_cast<const uint8_t*>(b.data),
                                                             static_cast<float*>(d.data), N, K, promote_every / 32);
  FP8MOE_CUDA_CHECK_LAUNCH("wgmma_accumulate_kernel");
}

std::pair<QuantizedTensor, QuantizedTensor> wgmma_accumulate_operands(int64_t M, int64_t N, int64_t K,
                                                                      std::mt19937_64& rng) {
  std::pair<QuantizedTensor, QuantizedTensor> ab{make_quantized_host(M, K, DType::e4m3, ScaleKind::tile_1x128),
                                                 make_quantized_host(N, K, DType::e4m3, ScaleKind::block_128x128)};
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (QuantizedTensor* q : {&ab.first, &ab.second}) {
    for (int64_t i = 0; i < q->values.numel(); ++i) q->values.ptr<uint8_t>()[i] = e4m3_encode(dist(rng));
    for (int64_t i = 0; i < q->scales.numel(); ++i) q->scales.ptr<float>()[i] = 1.0f;
  }
  return ab;
}

}  // namespace fp8moe::cuda
