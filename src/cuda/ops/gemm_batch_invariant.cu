// Backend::gemm_batch_invariant on the GPU: d [M, N] f32 = a [M, K] b [N, K]^T with a, b both f32
// or both bf16, every element summed in an order set by K alone. cuBLASLt (cuda_gemm) picks its
// algorithm, its tiles and its K split by M, so a decode token's Linear rounds differently with
// one or two tokens beside it; here one instantiation serves every M, and a row's arithmetic
// never depends on the rows beside it:
//   a CTA of 8 warps covers 8 rows of a (blockIdx.y) and 32 rows of b (4 per warp); lane l of a
//   warp takes the elements k = 32 V i + V l + [0, V) (16-byte vectors, V = 4 f32 or 8 bf16 when
//   K and the pointers allow it, else V = 1), FMA in ascending i, then the tail k = K_main + l +
//   32 j, and the 32 lanes' sums meet in a fixed xor-shuffle tree. Rows past M load zeros and
//   are not stored; the same instructions run for a row whatever M is.
// A decode step streams b once per 8 rows of a: the weights' bytes bound it, as cuBLASLt's are.
// 3-D strided views (Backend::gemm_strided_batched's, b [G, N, K]) run their G matrices as
// blockIdx.z, each row with the arithmetic of a 2-D call: the vector width is set by K, the row
// strides and the alignments, none of which depend on M.
#include <cuda_bf16.h>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kWarps = 8, kRows = 8, kCols = 4;

template <class T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[V]) {
  if constexpr (V == 1) {
    if constexpr (sizeof(T) == 4) out[0] = *reinterpret_cast<const float*>(p);
    else out[0] = bf16_to_f32(*reinterpret_cast<const uint16_t*>(p));
  } else if constexpr (sizeof(T) == 4) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

// acc[c][r] += a[r][k + v] * b[c][k + v], v ascending, for the warp's rows of a and of b.
template <class T, int V>
__device__ __forceinline__ void fma_step(const T* a, const T* b, int64_t k, int rows, int cols, int64_t lda,
                                         int64_t ldb, float (&acc)[kCols][kRows]) {
  float av[kRows][V];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < rows) load_vec<T, V>(a + int64_t(r) * lda + k, av[r]);
    else
#pragma unroll
      for (int v = 0; v < V; ++v) av[r][v] = 0.f;
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    if (c >= cols) break;
    float bv[V];
    load_vec<T, V>(b + int64_t(c) * ldb + k, bv);
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[c][r] = fmaf(av[r][v], bv[v], acc[c][r]);
  }
}

// Row strides (lda, ldb, ldd) and matrix strides (sa, sb, sd) in elements; matrix blockIdx.z.
struct Strides {
  int64_t lda, ldb, ldd, sa, sb, sd;
};

template <class T, int V>
__global__ void __launch_bounds__(kWarps * 32)
    gemm_batch_invariant_kernel(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ d, int M, int N,
                                int K, Strides st) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n0 = (int(blockIdx.x) * kWarps + warp) * kCols, m0 = int(blockIdx.y) * kRows;
  if (n0 >= N) return;  // whole warps: the shuffles below see all 32 lanes
  const int rows = min(kRows, M - m0), cols = min(kCols, N - n0);
  const int64_t g = blockIdx.z;
  const T* ar = a + g * st.sa + int64_t(m0) * st.lda;
  const T* br = b + g * st.sb + int64_t(n0) * st.ldb;
  d += g * st.sd;
  float acc[kCols][kRows];
#pragma unroll
  for (int c = 0; c < kCols; ++c)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[c][r] = 0.f;
  const int64_t k_main = int64_t(K) / (32 * V) * (32 * V);
  for (int64_t k = int64_t(lane) * V; k < k_main; k += 32 * V)
    fma_step<T, V>(ar, br, k, rows, cols, st.lda, st.ldb, acc);
  for (int64_t k = k_main + lane; k < K; k += 32) fma_step<T, 1>(ar, br, k, rows, cols, st.lda, st.ldb, acc);
#pragma unroll
  for (int c = 0; c < kCols; ++c)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float s = acc[c][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0 && r < rows && c < cols) d[int64_t(m0 + r) * st.ldd + n0 + c] = s;
    }
}

template <class T, int V>
void launch(const TensorView& a, const TensorView& b, const TensorView& d, int64_t G, int M, int N, int K,
            const Strides& st, cudaStream_t stream) {
  const dim3 grid(unsigned((N + kWarps * kCols - 1) / (kWarps * kCols)), unsigned((M + kRows - 1) / kRows),
                  unsigned(G));
  gemm_batch_invariant_kernel<T, V><<<grid, kWarps * 32, 0, stream>>>(a.ptr<const T>(), b.ptr<const T>(),
                                                                      d.ptr<float>(), M, N, K, st);
  FP8MOE_CUDA_CHECK_LAUNCH("gemm_batch_invariant_kernel");
}

}  // namespace

void cuda_gemm_batch_invariant(const TensorView& a, const TensorView& b, const TensorView& d, cudaStream_t stream) {
  const char* op = "gemm_batch_invariant";
  int64_t G = 1, M, N, K;
  Strides st{};
  if (a.ndim == 3) {  // G matrices: the checks of gemm_strided_batched (f32, b [G, N, K])
    const BatchedGemmDims g = check_gemm_strided_batched(Device::cuda, a, b, d, /*trans_b=*/true);
    G = g.G, M = g.M, N = g.N, K = g.K;
    st = {a.strides[1], b.strides[1], d.strides[1], a.strides[0], b.strides[0], d.strides[0]};
    FP8MOE_CHECK(G <= 65535, op << ": " << G << " matrices exceed the grid's 65535");
  } else {
    FP8MOE_CHECK(a.dtype == DType::f32 || a.dtype == DType::bf16, op << ": a must be f32 or bf16, got " << a.str());
    check_dev(a, op, "a", a.dtype, 2);
    check_dev(b, op, "b", a.dtype, 2);
    check_f32(d, op, "d", 2);
    M = a.size(0), K = a.size(1), N = b.size(0);
    FP8MOE_CHECK(b.size(1) == K, op << ": b must be [N, " << K << "], got " << b.str());
    FP8MOE_CHECK(d.size(0) == M && d.size(1) == N, op << ": d must be [" << M << ", " << N << "], got " << d.str());
    st = {K, K, N, 0, 0, 0};
  }
  FP8MOE_CHECK(M < (int64_t(1) << 31) / kRows * kRows && N < (int64_t(1) << 31) && K < (int64_t(1) << 31),
               op << ": M, N, K must be below 2^31");
  FP8MOE_CHECK((M + kRows - 1) / kRows <= 65535, op << ": M = " << M << " exceeds " << 65535 * kRows << " rows");
  if (G == 0 || M == 0 || N == 0) return;
  // The vector width depends on K, the row and matrix strides and the operands' alignment, never
  // on M: a row view of a at any row offset keeps the alignment of its tensor when K fills whole
  // vectors.
  auto aligned = [](const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; };
  const bool bf16 = a.dtype == DType::bf16;
  const int64_t v = bf16 ? 8 : 4;
  const bool vec = K % v == 0 && st.lda % v == 0 && st.ldb % v == 0 && st.sa % v == 0 && st.sb % v == 0 &&
                   aligned(a) && aligned(b);
  if (bf16) {
    if (vec) launch<__nv_bfloat16, 8>(a, b, d, G, int(M), int(N), int(K), st, stream);
    else launch<__nv_bfloat16, 1>(a, b, d, G, int(M), int(N), int(K), st, stream);
  } else if (vec) {
    launch<float, 4>(a, b, d, G, int(M), int(N), int(K), st, stream);
  } else {
    launch<float, 1>(a, b, d, G, int(M), int(N), int(K), st, stream);
  }
}

}  // namespace fp8moe::cuda
