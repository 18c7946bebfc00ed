// Shared pieces of the CUDA model ops (model_ops_*.cu): host-side argument checks that mirror the
// CPU ops' messages (device tensors instead of host ones), index range checks, stream-ordered
// scratch buffers, the shared cuBLASLt handle, the entry points of the attention's GEMM path, a
// stable key sort for deterministic scatter-adds, and device helpers (the BF16 codec of
// src/numerics/codecs.cpp, dtype-generic loads and stores, warp reductions).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/runtime/caching_allocator.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::cuda::ops {

// ---- host checks ----
// `t` is a defined, contiguous device tensor of `dtype` with `ndim` dims (ndim < 0: any).
void check_dev(const TensorView& t, const char* op, const char* arg, DType dtype, int ndim);
// As check_dev with dtype f32; an f64 tensor gets "<op>: <arg> ...: f64 unsupported on cuda".
void check_f32(const TensorView& t, const char* op, const char* arg, int ndim);
// A defined, contiguous 2-D device tensor of f32, f64 or bf16 (the dtypes of copy_cols/transpose).
void check_2d_any(const TensorView& t, const char* op, const char* arg);

// First i < n with idx[i] outside [lo, hi), or -1 (then *value is untouched); *value = idx[i].
// idx [n] i32 device; `what` names it in messages ("gather_rows: idx"). Immediate checks
// synchronize (they read the answer back); deferred ones (device_checks.hpp) return -1 and report
// a failure at the next synchronize. Kernels after a check must still skip out-of-range indices.
// Defined in device_checks.cu.
int64_t first_out_of_range(const int32_t* idx, int64_t n, int64_t lo, int64_t hi, int32_t* value, const char* what,
                           cudaStream_t stream);

// Scratch memory of an op from the caching allocator (runtime/caching_allocator.hpp), ordered on
// `stream`: free again for that stream's next op as soon as the buffer goes out of scope.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t bytes, cudaStream_t stream);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T> T* as() const { return static_cast<T*>(block_.ptr); }

 private:
  CachedBlock block_;
};

// The current device's cuBLASLt handle and the workspace of the model ops' GEMMs on `stream`
// (model_ops_gemm.cu), created on first use and shared with the attention's GEMM path: one
// workspace per stream, whose order keeps its users apart.
struct CublasLtShared {
  cublasLtHandle_t handle;
  void* workspace;
  size_t workspace_bytes;
};
CublasLtShared cublaslt_shared(cudaStream_t stream);
// A cached cuBLASLt problem: descriptors and the chosen algorithm, destroyed with the plan.
struct CublasLtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  CublasLtPlan() = default;
  CublasLtPlan(const CublasLtPlan&) = delete;
  CublasLtPlan& operator=(const CublasLtPlan&) = delete;
  ~CublasLtPlan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};
// The largest power of two (up to 256) dividing an address or a byte offset: the alignment
// cuBLASLt is told.
inline int alignment_of(uintptr_t u) {
  int a = 1;
  while (a < 256 && (u & uintptr_t(2 * a - 1)) == 0) a *= 2;
  return a;
}
// cuBLASLt's first algorithm for a described problem with `workspace` bytes and the operands'
// alignments in bytes (views offset into tensors: cuBLASLt assumes 256 unless told); `found` is 0
// when there is none.
cublasStatus_t cublaslt_heuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                                  cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, uint64_t workspace,
                                  uint32_t align_a, uint32_t align_b, uint32_t align_d,
                                  cublasLtMatmulHeuristicResult_t* res, int* found);

// ---- the attention's GEMM path (model_ops_attention_gemm.cu; model_ops_attention.cu checks the
// arguments and dispatches) ----
// Sequences per chunk such that a chunk's workspace (per_sequence bytes a sequence,
// cuda_attention_workspace_bytes) fits in `cap` bytes, balanced over the chunks; 0 when one
// sequence does not fit.
int64_t attention_gemm_chunk(int64_t B, size_t per_sequence, size_t cap);
// cuda_attention_forward / _backward's contracts with checked arguments, T > 0, H > 0, BF16
// operands when bf16, and `chunk` from attention_gemm_chunk (with the forward's or the
// backward's workspace, batched or looped as `batched` says); di [H, T] = rowsum(dout * out).
// batched: one GEMM per product over a chunk's sequences and heads, bitwise equal to the looped
// GEMMs (AttentionPath::gemm_batched); otherwise those (AttentionPath::gemm_looped).
void attention_gemm_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, int64_t seq_len, double scale, bool bf16, int64_t chunk,
                            bool batched, cudaStream_t stream);
void attention_gemm_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& lse,
                             const float* di, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                             const TensorView& dv, int64_t seq_len, double scale, bool bf16, int64_t chunk,
                             bool batched, cudaStream_t stream);

// Stable sort of the positions 0..n-1 by key: keys_out [n] = sorted keys, pos_out [n] = the
// positions, ascending within one key. keys [n] i32 device, each in [0, nkeys). Queued on
// `stream` without host synchronization.
// NOTES: scatter-adds run over this order (one thread per (key, column), positions in ascending
// order), which reproduces the CPU's sequential float sums bit for bit and needs no atomics.
void stable_sort_by_key(const int32_t* keys, int64_t n, int64_t nkeys, int32_t* keys_out, int32_t* pos_out,
                        cudaStream_t stream);

inline unsigned grid_for(int64_t n, int threads, int64_t cap = int64_t(1) << 20) {
  int64_t g = (n + threads - 1) / threads;
  if (g > cap) g = cap;
  return unsigned(g < 1 ? 1 : g);
}

// ---- device helpers ----
__device__ __forceinline__ float bf16_to_f32(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
// Round to nearest even; NaN -> 0x7FFF | sign (codecs.cpp bf16_encode, Saturate::none).
__device__ __forceinline__ uint16_t f32_to_bf16(float x) {
  const uint32_t u = __float_as_uint(x);
  if (isnan(x)) return uint16_t(((u >> 16) & 0x8000u) | 0x7FFFu);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// x rounded to BF16 and back (codecs.hpp bf16_round).
__device__ __forceinline__ float bf16_rounded(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Element i of a f32 | f64 | bf16 array as double, and its store from double (via float for f32
// and bf16), the CPU's load_any / store_any.
__device__ __forceinline__ double load_any(const void* p, int dt, int64_t i) {
  if (dt == int(DType::f32)) return double(static_cast<const float*>(p)[i]);
  if (dt == int(DType::f64)) return static_cast<const double*>(p)[i];
  return double(bf16_to_f32(static_cast<const uint16_t*>(p)[i]));
}
__device__ __forceinline__ void store_any(void* p, int dt, int64_t i, double v) {
  if (dt == int(DType::f32))
    static_cast<float*>(p)[i] = __double2float_rn(v);
  else if (dt == int(DType::f64))
    static_cast<double*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(__double2float_rn(v));
}

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of kThreads (a multiple of 32) in a fixed order; every thread gets the result.
// `red` holds kThreads / 32 values.
template <int kThreads, class T>
__device__ __forceinline__ T block_sum(T v, T* red) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // `red` may still be read from a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T s = T(0);
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) s += red[w];
  return s;
}
template <int kThreads>
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float m = red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, red[w]);
  return m;
}

}  // namespace fp8moe::cuda::ops

namespace fp8moe::cuda::ops {

// dst [R, D] f32: for each run of equal keys (keys, pos [n] from stable_sort_by_key),
// dst[key, j] += w[i] * src[i, j] over the run's positions i in ascending order (w null: 1);
// src [>= n, D] f32. Keys outside [0, R) are skipped (a deferred range check reports them).
void sorted_scatter_add(const int32_t* keys, const int32_t* pos, int64_t n, const float* w, const float* src,
                        float* dst, int64_t D, int64_t R, cudaStream_t stream);

}  // namespace fp8moe::cuda::ops
