// Host entry points of the CUDA kernels (no Backend involved): argument checks, launch, and the
// knobs the benchmarks and tests use (forced tile shapes, streams). The Backend classes in
// cuda_backend.cu and cublaslt.cu call these. All tensors are device views.
#pragma once
#include <cuda_runtime.h>

#include <random>
#include <string>
#include <utility>

#include "fp8moe/gemm_ref.hpp"
#include "fp8moe/quantize.hpp"
#include "cuda/gemm/gemm_heuristics.hpp"

namespace fp8moe::cuda {

// ---- our sm_90a FP8 GEMM (gemm_fp8.cu) ----
// D [M, N] = A [M, K] * B [N, K]^T (+ D).  A: 1x128 e4m3; B: 128x128 (Fprop/Dgrad) or 1x128
// (Wgrad) e4m3; D: bf16 | f32 (accumulate needs f32). K % 128 == 0; M, N any (N even for the
// paired stores, else masked single stores). `tile` overrides the heuristic when non-null.
void gemm_fp8_sm90(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                   cudaStream_t stream, const GemmTile* tile = nullptr);
// The tile the heuristic picks for this problem (d_f32: D is f32, else bf16).
GemmTile gemm_fp8_sm90_tile(int64_t M, int64_t N, int64_t K, bool b_1x128, bool d_f32);
// cudaOccupancyMaxActiveClusters of the launch `tile` would use (1 for tiles without clusters).
int gemm_fp8_sm90_max_active_clusters(const GemmTile& tile, bool b_1x128);
// True when the current device can run the sm_90a kernels.
bool sm90_available();

// ---- FP8 GEMM for few rows (gemm_fp8_small_m.cu) ----
// gemm_fp8_sm90's contract for M <= kSmallMMaxRows and a 128x128-scaled B (Fprop and Dgrad of
// decode-sized batches): B streamed once through a TMA-fed shared-memory ring, mma.sync with the
// operands' roles swapped; D is deterministic, and a row of D does not depend on M or on the launch
// (only k_split sets the summation order, chosen from N and K). gemm_fp8_sm90 takes it up to
// kSmallMDispatchRows unless a tile is forced: with more tokens, the mma.sync math and A's rows in
// every stage bound it (M = 32: 0.50-1.00x the WGMMA kernel's speed; `fp8moe bench small-m`).
// `want`: the launch (SmallMConfig, 0 fields chosen), for the benchmark and the tests; a
// configuration that does not fit is an Error.
constexpr int64_t kSmallMMaxRows = 64;
constexpr int64_t kSmallMDispatchRows = 8;
void gemm_fp8_small_m(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                      cudaStream_t stream, const SmallMConfig& want = {});
// The launch gemm_fp8_small_m runs for this shape and `want`, every field resolved.
SmallMConfig gemm_fp8_small_m_config(int64_t M, int64_t N, int64_t K, const SmallMConfig& want = {});

// ---- FP8 GEMMs with emulated Tensor Core accumulation (gemm_fp8_emulated.cu) ----
// gemm_fp8_ref's AccumMode::tensor_core arithmetic, bit for bit (its mantissa_bits and
// promote_every, NaN payloads aside), on CUDA cores at a small fraction of the Tensor Cores'
// speed: the accumulation settings the sm_90a kernels cannot run. Same operand contracts as
// gemm_fp8_sm90 and the grouped kernels of moe_api.hpp (group tables read on the device, no host
// synchronization, out-of-range table values clamped); opt.accum must be tensor_core.
void gemm_fp8_emulated(const QuantizedView& a, const QuantizedView& b, const TensorView& d, const GemmOptions& opt,
                       cudaStream_t stream);
void grouped_gemm_fp8_contiguous_emulated(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                          int64_t groups, const TensorView& d, const GemmOptions& opt,
                                          cudaStream_t stream);
void grouped_gemm_fp8_masked_emulated(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                                      int64_t groups, const TensorView& d, const GemmOptions& opt, cudaStream_t stream);
// K-grouped Wgrad: each group's token segment is one K range of the reference, so promotion points
// count from the segment's start and N_c = 0 promotes once at its end.
void grouped_wgrad_fp8_emulated(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                                const TensorView& d, const GemmOptions& opt, cudaStream_t stream);
// True for the accumulation settings that need the emulation: Tensor Core accumulation with a
// promotion interval other than the kernels' 128 (FP32 accumulation and N_c = 128 run on them).
inline bool needs_accum_emulation(const AccumConfig& ac) {
  return ac.mode == AccumMode::tensor_core && ac.promote_every != 128;
}

// ---- The Tensor Core's own accumulation, on the hardware (wgmma_accum.cu) ----
// D [M, N] f32 = A [M, K] * B [N, K]^T, a [M, K] and b [N, K] raw e4m3 values (unit scales), by
// WGMMAs whose running sum stays in the Tensor Core for `promote_every` elements of K (a multiple of
// 32, one WGMMA; 0 = the whole K) and is then added to FP32 registers: the hardware counterpart of
// gemm_fp8_ref's AccumMode::tensor_core with all scales 1. M % 64 == 0, N % 128 == 0, K % 128 ==
// 0; a probe for `fp8moe numerics accum --hardware`, not a fast kernel.
void wgmma_accumulate(const TensorView& a, const TensorView& b, const TensorView& d, int promote_every,
                      cudaStream_t stream);
// Host operands for it and for the emulation of the same products: a [M, K] (1x128) and b [N, K]
// (128x128) e4m3 values of N(0, 1) draws (a's, then b's, from one distribution), every scale 1.
std::pair<QuantizedTensor, QuantizedTensor> wgmma_accumulate_operands(int64_t M, int64_t N, int64_t K,
                                                                      std::mt19937_64& rng);

// ---- quantization kernels (quantize.cu) ----
// Same contracts as the CPU quantizers in quantize.hpp, bit-exact. `check_finite` makes the call
// synchronous: the kernel flags NaN/Inf inputs and the host raises fp8moe::Error.
void quantize_1x128_cuda(const TensorView& x, const QuantizedView& out, ScaleMode mode, cudaStream_t stream,
                         bool check_finite);
void quantize_128x128_cuda(const TensorView& w, const QuantizedView& out, ScaleMode mode, cudaStream_t stream,
                           bool check_finite);
void quantize_128x1_cuda(const TensorView& x, const QuantizedView& out, ScaleMode mode, cudaStream_t stream,
                         bool check_finite);
// x [T, C] -> rows [T, C] as quantize_1x128_cuda writes it and cols [C, T] as quantize_128x1_cuda
// does (rows and cols e4m3 or e5m2), in one pass over x where the shapes allow (quantize.cu).
void quantize_1x128_and_128x1_cuda(const TensorView& x, const QuantizedView& rows, const QuantizedView& cols,
                                   ScaleMode mode, cudaStream_t stream, bool check_finite);
void requantize_128x1_cuda(const QuantizedView& in, const QuantizedView& out, ScaleMode mode, cudaStream_t stream);
void transpose_128x128_cuda(const QuantizedView& in, const QuantizedView& out, int64_t groups, cudaStream_t stream);
void dequantize_cuda(const QuantizedView& in, const TensorView& out, cudaStream_t stream);
// E5M6 (quantize_e5m6.cu): 1x128 only, the attention-out cache; bit-exact with the CPU codecs.
void quantize_1x128_e5m6_cuda(const TensorView& x, const QuantizedView& out, ScaleMode mode, cudaStream_t stream);
void dequantize_e5m6_cuda(const QuantizedView& in, const TensorView& out, cudaStream_t stream);

// ---- cuBLASLt (cublaslt.cu) ----
// FP8 block-scaled GEMM through cuBLASLt (VEC128_32F x BLK128x128_32F, or VEC128 x VEC128 for a
// 1x128-scaled B); same contract as gemm_fp8_sm90.
void gemm_fp8_cublaslt(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                       cudaStream_t stream);
// The configuration (CTA tile, stages, K splits, cluster) of the algorithm cuBLASLt's heuristic
// picks for that GEMM; launches nothing.
std::string gemm_fp8_cublaslt_algorithm(const QuantizedView& a, const QuantizedView& b, const TensorView& d,
                                        bool accumulate);
// D [M, N] f32 | bf16 = A [M, K] bf16 * B [N, K]^T bf16 (+ D), FP32 accumulation.
void gemm_bf16_cublaslt(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate,
                        cudaStream_t stream);

// ---- test and benchmark inputs (random.cu) ----
// p [n] bf16 <- N(0, stddev), deterministic in (seed, index).
void fill_normal_bf16(void* p, int64_t n, uint64_t seed, float stddev = 1.0f, cudaStream_t stream = nullptr);

}  // namespace fp8moe::cuda
