// CUDA dense GEMM of the model ops: d [M, N] (+)= op(a) * op(b) with the CPU op's transpose flags
// (src/cpu/ops_dense.cpp), through cuBLASLt.
//   f32:  a, b, d f32, FP32 arithmetic: CUBLAS_COMPUTE_32F, which for f32 inputs is plain FP32
//         (cuBLASLt uses TF32 only when asked with CUBLAS_COMPUTE_32F_FAST_TF32) and may split K
//         with FP32 partial sums. Not CUBLAS_COMPUTE_32F_PEDANTIC: without split-K the skinny GEMMs
//         of the MoE router (N = experts, or K = tokens for its weight gradient) ran at ~50
//         GFLOPS on an H200, 2.7 ms per call.
//   bf16: a, b bf16 (not accepted by the CPU op), d f32 or bf16, FP32 accumulation.
// Row-major d = op(a) op(b) is column-major d^T = op(b)^T op(a)^T: cuBLAS "A" is our b and "B" our
// a, each transposed iff our flag is set, and d is the column-major N x M matrix with ld N.
// Plans (descriptors + heuristic algorithm) are cached per problem, pointer alignment included.
// gemm_strided_batched is the same f32 call over G matrices at fixed strides (leading dimensions
// and batch strides as the views have them; CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT).
#include <cublasLt.h>

#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

// (in dtype, d dtype, M, N, K, trans_a, trans_b, alignment of a, b, d in bytes)
using GemmKey = std::tuple<int, int, int64_t, int64_t, int64_t, bool, bool, int, int, int>;

// (G, M, N, K, trans_b, lda, ldb, ldd, batch strides of a, b, d, alignment of a, b, d in bytes)
using BatchedKey = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int, int, int>;

struct GemmContext {
  cublasLtHandle_t handle = nullptr;
  // One workspace per stream: GEMMs on two streams may run at the same time.
  std::map<cudaStream_t, void*> workspaces;
  std::map<GemmKey, std::unique_ptr<CublasLtPlan>> plans;
  std::map<BatchedKey, std::unique_ptr<CublasLtPlan>> batched_plans;
  std::mutex mu;
  // Under mu.
  void* workspace(cudaStream_t stream) {
    void*& w = workspaces[stream];
    if (!w) FP8MOE_CUDA_CHECK(cudaMalloc(&w, kWorkspaceBytes));
    return w;
  }
};

GemmContext& gemm_context() {
  // NOTES: one context per device, leaked on purpose: destroying cuBLASLt handles during static
  // destruction can run after the CUDA runtime has shut down.
  static std::mutex mu;
  static std::map<int, GemmContext*> ctxs;
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  GemmContext*& c = ctxs[dev];
  if (!c) {
    auto fresh = std::make_unique<GemmContext>();
    FP8MOE_CUBLAS_CHECK(cublasLtCreate(&fresh->handle));
    c = fresh.release();
  }
  return *c;
}

template <class T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  FP8MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

// A plan for one compute type, or null when cuBLASLt has no algorithm for it (*why says why).
std::unique_ptr<CublasLtPlan> make_plan(GemmContext& ctx, cublasComputeType_t compute, cudaDataType_t in_type,
                                    cudaDataType_t d_type, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                                    const int align[3], std::string* why) {
  auto plan = std::make_unique<CublasLtPlan>();
  const cublasStatus_t created = cublasLtMatmulDescCreate(&plan->op, compute, CUDA_R_32F);
  if (created != CUBLAS_STATUS_SUCCESS) {  // a compute type this cuBLASLt does not know
    *why += std::string(" [compute ") + std::to_string(int(compute)) + ": " + cublasLtGetStatusString(created) + "]";
    plan->op = nullptr;
    return nullptr;
  }
  // cuBLAS A := our b: stored column-major as [N, K] (ld N) without trans_b, [K, N] (ld K) with it.
  const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  // cuBLAS B := our a: stored column-major as [K, M] (ld K) without trans_a, [M, K] (ld M) with it.
  const cublasOperation_t opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_attr(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, opa);
  set_attr(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, opb);
  if (!tb)
    FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, in_type, uint64_t(N), uint64_t(K), N));
  else
    FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, in_type, uint64_t(K), uint64_t(N), K));
  if (!ta)
    FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, in_type, uint64_t(K), uint64_t(M), K));
  else
    FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, in_type, uint64_t(M), uint64_t(K), M));
  FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lc, d_type, uint64_t(N), uint64_t(M), N));

  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st = cublaslt_heuristic(ctx.handle, plan->op, plan->la, plan->lb, plan->lc, kWorkspaceBytes,
                                               uint32_t(align[1]), uint32_t(align[0]), uint32_t(align[2]), &res, &found);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    plan->algo = res.algo;
    return plan;
  }
  *why += std::string(" [compute ") + std::to_string(int(compute)) + ": " +
          (st == CUBLAS_STATUS_SUCCESS ? "no algorithm" : cublasLtGetStatusString(st)) + "]";
  return nullptr;
}

// One column-major layout of `batch` matrices rows x cols (ld) `stride` elements apart.
cublasLtMatrixLayout_t batched_layout(int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, uint64_t(rows), uint64_t(cols), ld));
  const int32_t count = int32_t(batch);
  FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  FP8MOE_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  return l;
}

// The byte alignment every matrix of a strided view keeps: its start's, its rows' and its batch
// stride's.
int batched_alignment(const TensorView& t) {
  return alignment_of(reinterpret_cast<uintptr_t>(t.data) | uintptr_t(t.strides[1] * 4) | uintptr_t(t.strides[0] * 4));
}

}  // namespace

void cuda_gemm_strided_batched(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_b,
                               bool accumulate, cudaStream_t stream) {
  const BatchedGemmDims g = check_gemm_strided_batched(Device::cuda, a, b, d, trans_b);
  if (g.G == 0 || g.M == 0 || g.N == 0) return;
  FP8MOE_CHECK(g.K > 0, "gemm_strided_batched: K = 0 is unsupported");
  FP8MOE_CHECK(g.G <= std::numeric_limits<int32_t>::max(), "gemm_strided_batched: " << g.G << " matrices exceed i32");
  const int align[3] = {batched_alignment(a), batched_alignment(b), batched_alignment(d)};
  GemmContext& ctx = gemm_context();
  std::lock_guard<std::mutex> lock(ctx.mu);
  const BatchedKey key{g.G,          g.M,          g.N,          g.K,          trans_b,  a.strides[1], b.strides[1],
                       d.strides[1], a.strides[0], b.strides[0], d.strides[0], align[0], align[1],     align[2]};
  auto it = ctx.batched_plans.find(key);
  if (it == ctx.batched_plans.end()) {
    auto plan = std::make_unique<CublasLtPlan>();
    FP8MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // cuBLAS A := our b (column-major N x K, or K x N transposed), B := our a (K x M), C := d (N x M).
    const cublasOperation_t opa = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, opb = CUBLAS_OP_N;
    set_attr(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, opa);
    set_attr(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, opb);
    plan->la = trans_b ? batched_layout(g.K, g.N, b.strides[1], g.G, b.strides[0])
                       : batched_layout(g.N, g.K, b.strides[1], g.G, b.strides[0]);
    plan->lb = batched_layout(g.K, g.M, a.strides[1], g.G, a.strides[0]);
    plan->lc = batched_layout(g.N, g.M, d.strides[1], g.G, d.strides[0]);
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const cublasStatus_t st = cublaslt_heuristic(ctx.handle, plan->op, plan->la, plan->lb, plan->lc, kWorkspaceBytes,
                                                 uint32_t(align[1]), uint32_t(align[0]), uint32_t(align[2]), &res, &found);
    FP8MOE_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
                 "gemm_strided_batched: cuBLASLt has no algorithm for G=" << g.G << " M=" << g.M << " N=" << g.N
                                                                         << " K=" << g.K << " trans_b=" << trans_b);
    plan->algo = res.algo;
    it = ctx.batched_plans.emplace(key, std::move(plan)).first;
  }
  CublasLtPlan& plan = *it->second;
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  FP8MOE_CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan.op, &alpha, b.data, plan.la, a.data, plan.lb, &beta, d.data,
                                     plan.lc, d.data, plan.lc, &plan.algo, ctx.workspace(stream), kWorkspaceBytes, stream));
}

namespace ops {

CublasLtShared cublaslt_shared(cudaStream_t stream) {
  GemmContext& ctx = gemm_context();
  std::lock_guard<std::mutex> lock(ctx.mu);
  return {ctx.handle, ctx.workspace(stream), kWorkspaceBytes};
}

cublasStatus_t cublaslt_heuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                                  cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, uint64_t workspace,
                                  uint32_t align_a, uint32_t align_b, uint32_t align_d,
                                  cublasLtMatmulHeuristicResult_t* res, int* found) {
  *found = 0;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
  st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                            sizeof(workspace));
  for (const auto& [attr, v] : aligns)
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof(v));
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulAlgoGetHeuristic(handle, op, la, lb, lc, lc, pref, 1, res, found);
  cublasLtMatmulPreferenceDestroy(pref);
  return st;
}

}  // namespace ops

void cuda_gemm(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_a, bool trans_b,
               bool accumulate, cudaStream_t stream) {
  const bool bf16_in = a.dtype == DType::bf16;
  if (bf16_in) {
    check_dev(a, "gemm", "a", DType::bf16, 2);
    check_dev(b, "gemm", "b", DType::bf16, 2);
    FP8MOE_CHECK(d.dtype == DType::f32 || d.dtype == DType::bf16,
                 "gemm: d must be f32 or bf16 for bf16 inputs, got " << d.str());
    check_dev(d, "gemm", "d", d.dtype, 2);
  } else {
    check_f32(d, "gemm", "d", 2);
    check_f32(a, "gemm", "a", 2);
    check_f32(b, "gemm", "b", 2);
  }
  const int64_t M = d.size(0), N = d.size(1);
  const int64_t K = trans_a ? a.size(0) : a.size(1);
  FP8MOE_CHECK((trans_a ? a.size(1) : a.size(0)) == M, "gemm: a " << a.str() << " does not give M = " << M);
  FP8MOE_CHECK((trans_b ? b.size(1) : b.size(0)) == K && (trans_b ? b.size(0) : b.size(1)) == N,
               "gemm: b " << b.str() << " does not match K = " << K << ", N = " << N);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // the empty sum: d = 0, or d unchanged when accumulating
    if (!accumulate) FP8MOE_CUDA_CHECK(cudaMemsetAsync(d.data, 0, d.nbytes(), stream));
    return;
  }
  const cudaDataType_t in_type = bf16_in ? CUDA_R_16BF : CUDA_R_32F;
  const cudaDataType_t d_type = d.dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const int align[3] = {alignment_of(reinterpret_cast<uintptr_t>(a.data)), alignment_of(reinterpret_cast<uintptr_t>(b.data)),
                       alignment_of(reinterpret_cast<uintptr_t>(d.data))};
  GemmContext& ctx = gemm_context();
  std::lock_guard<std::mutex> lock(ctx.mu);
  const GemmKey key{int(a.dtype), int(d.dtype), M, N, K, trans_a, trans_b, align[0], align[1], align[2]};
  auto it = ctx.plans.find(key);
  if (it == ctx.plans.end()) {
    std::string why;
    std::unique_ptr<CublasLtPlan> plan =
        make_plan(ctx, CUBLAS_COMPUTE_32F, in_type, d_type, M, N, K, trans_a, trans_b, align, &why);
    FP8MOE_CHECK(plan, "gemm: cuBLASLt has no algorithm for M=" << M << " N=" << N << " K=" << K << " trans_a="
                                                                << trans_a << " trans_b=" << trans_b << " "
                                                                << dtype_name(a.dtype) << why);
    it = ctx.plans.emplace(key, std::move(plan)).first;
  }
  CublasLtPlan& plan = *it->second;
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  FP8MOE_CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan.op, &alpha, b.data, plan.la, a.data, plan.lb, &beta, d.data,
                                     plan.lc, d.data, plan.lc, &plan.algo, ctx.workspace(stream), kWorkspaceBytes, stream));
}

}  // namespace fp8moe::cuda
