// cuBLASLt paths of the CUDA backend: the vendor baseline and fallback.
//   FP8 block-scaled GEMM: CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (A, 1x128) x BLK128x128_32F
//   (B, weights) or VEC128_32F x VEC128_32F (Wgrad); BF16 GEMM with FP32 accumulation.
//
// Row-major D [M, N] = A [M, K] * B [N, K]^T is computed as the column-major product
// D^T [N, M] = op(B)^T... i.e. cuBLAS "A" := our B viewed as K x N column-major with TRANSA = T,
// cuBLAS "B" := our A viewed as K x M column-major with TRANSB = N (the "TN" layout FP8 needs),
// cuBLAS D := our D viewed as N x M column-major (ld = row stride of D).
// Scales: VEC128 wants [K/128, rows] with the rows contiguous (our 1x128 layout, but with the
// leading dimension equal to the row count: padded ld(R) = round_up(R, 4) is repacked when
// R % 4 != 0); BLK128x128 wants [ceil(rows/128), K/128] row-major (our 128x128 layout).
// Plans (descriptors + heuristic algorithm) are cached per problem so that repeated calls cost
// one cublasLtMatmul; the cache is guarded by a mutex.
#include <cublasLt.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "cuda_check.hpp"
#include "kernel_api.hpp"

namespace fp8moe::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// (device, fp8?, a scale mode, b scale mode, M, N, K, ldd, d dtype, accumulate)
using PlanKey = std::tuple<int, bool, int, int, int64_t, int64_t, int64_t, int64_t, int, bool>;

struct Context {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::mutex mu;
};

Context& context() {
  // NOTES: one context per device, leaked on purpose: destroying cuBLASLt handles during static
  // destruction can run after the CUDA runtime has shut down.
  static std::mutex mu;
  static std::map<int, Context*> ctxs;
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  Context*& c = ctxs[dev];
  if (!c) {
    auto fresh = std::make_unique<Context>();
    FP8MOE_CUBLAS_CHECK(cublasLtCreate(&fresh->handle));
    FP8MOE_CUDA_CHECK(cudaMalloc(&fresh->workspace, kWorkspaceBytes));
    c = fresh.release();
  }
  return *c;
}

void check_device(const TensorView& t, const char* arg) {
  FP8MOE_CHECK(t.device == Device::cuda, arg << ": expected a GPU tensor, got " << t.str());
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// A [K/128, ld] 1x128 scale tensor with ld == rows, repacked into `tmp` when ld != rows.
const float* vec128_scales(const TensorView& scales, int64_t rows, std::shared_ptr<void>& tmp, cudaStream_t stream) {
  const int64_t G = scales.size(0), ld = scales.size(1);
  if (ld == rows) return scales.ptr<const float>();
  void* p = nullptr;
  FP8MOE_CUDA_CHECK(cudaMallocAsync(&p, size_t(G * rows) * sizeof(float), stream));
  tmp = std::shared_ptr<void>(p, [stream](void* q) { cudaFreeAsync(q, stream); });
  FP8MOE_CUDA_CHECK(cudaMemcpy2DAsync(p, size_t(rows) * 4, scales.data, size_t(ld) * 4, size_t(rows) * 4, size_t(G),
                                      cudaMemcpyDeviceToDevice, stream));
  return static_cast<const float*>(p);
}

template <class T>
void set_attr(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const T& v) {
  FP8MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &v, sizeof(v)));
}

// Builds (or fetches) the plan; the caller sets the scale pointers.
Plan& get_plan(Context& ctx, const PlanKey& key, cudaDataType_t in_type, cudaDataType_t d_type, int64_t M, int64_t N,
               int64_t K, int64_t ldd, int a_mode, int b_mode, bool fp8) {
  auto it = ctx.plans.find(key);
  if (it != ctx.plans.end()) return *it->second;
  auto plan = std::make_unique<Plan>();
  FP8MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  set_attr(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, ta);
  set_attr(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, tb);
  if (fp8) {
    set_attr(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(a_mode));
    set_attr(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(b_mode));
  }
  // cuBLAS A: our B as K x N (ld K); cuBLAS B: our A as K x M (ld K); C = D: N x M (ld ldd).
  FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, in_type, uint64_t(K), uint64_t(N), K));
  FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, in_type, uint64_t(K), uint64_t(M), K));
  FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lc, d_type, uint64_t(N), uint64_t(M), ldd));
  cublasLtMatmulPreference_t pref = nullptr;
  FP8MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  cublasLtMatmulHeuristicResult_t res{};
  int n = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(ctx.handle, plan->op, plan->la, plan->lb, plan->lc, plan->lc, pref, 1, &res, &n);
  cublasLtMatmulPreferenceDestroy(pref);
  FP8MOE_CUBLAS_CHECK(st);
  FP8MOE_CHECK(n > 0, "cublasLtMatmulAlgoGetHeuristic: no algorithm for " << (fp8 ? "FP8 block-scaled" : "BF16")
                                                                          << " GEMM M=" << M << " N=" << N << " K=" << K);
  plan->algo = res.algo;
  return *ctx.plans.emplace(key, std::move(plan)).first->second;
}

void run(Context& ctx, Plan& plan, const void* a_ptr, const void* b_ptr, void* d, bool accumulate, cudaStream_t stream) {
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  FP8MOE_CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan.op, &alpha, b_ptr, plan.la, a_ptr, plan.lb, &beta, d, plan.lc, d,
                                     plan.lc, &plan.algo, ctx.workspace, kWorkspaceBytes, stream));
}

void check_d(const TensorView& d, int64_t M, int64_t N, bool accumulate) {
  check_tensor(d, "d", {DType::f32, DType::bf16}, 2);
  check_shape(d, "d", {M, N});
  check_device(d, "d");
  FP8MOE_CHECK(!accumulate || d.dtype == DType::f32, "d: accumulate needs an f32 output, got " << d.str());
  FP8MOE_CHECK(d.strides[1] == 1 && d.strides[0] >= N, "d: expected row-major rows, got " << d.str());
  FP8MOE_CHECK(aligned16(d.data), "d: must be 16-byte aligned for cuBLASLt");
}

}  // namespace

void gemm_fp8_cublaslt(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                       cudaStream_t stream) {
  check_quantized(a, "a", ScaleKind::tile_1x128);
  check_quantized(b, "b", b.kind);
  FP8MOE_CHECK(a.values.dtype == DType::e4m3 && b.values.dtype == DType::e4m3,
               "gemm_fp8 (cublaslt): a and b must be e4m3, got " << a.values.str() << " and " << b.values.str());
  check_device(a.values, "a.values");
  check_device(b.values, "b.values");
  check_device(a.scales, "a.scales");
  check_device(b.scales, "b.scales");
  const int64_t M = a.rows(), K = a.cols(), N = b.rows();
  FP8MOE_CHECK(b.cols() == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.values.str());
  FP8MOE_CHECK(K % 128 == 0 && K > 0, "a: K = " << K << " must be a positive multiple of 128 (pad K with zeros)");
  check_d(d, M, N, accumulate);
  FP8MOE_CHECK(a.values.is_contiguous() && b.values.is_contiguous(), "gemm_fp8 (cublaslt): a and b must be contiguous");
  FP8MOE_CHECK(aligned16(a.values.data) && aligned16(b.values.data), "gemm_fp8 (cublaslt): a and b must be 16-byte aligned");
  if (M == 0 || N == 0) return;

  Context& ctx = context();
  const bool b_vec = b.kind == ScaleKind::tile_1x128;
  const int a_mode = b_vec ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  std::shared_ptr<void> tmp_a, tmp_b;
  const float* sa = vec128_scales(a.scales, M, tmp_a, stream);
  const float* sb = b_vec ? vec128_scales(b.scales, N, tmp_b, stream) : b.scales.ptr<const float>();
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  const cudaDataType_t dt = d.dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  const PlanKey key{dev, true, a_mode, b_mode, M, N, K, d.strides[0], int(dt), accumulate};
  std::lock_guard<std::mutex> lock(ctx.mu);
  Plan& plan = get_plan(ctx, key, CUDA_R_8F_E4M3, dt, M, N, K, d.strides[0], a_mode, b_mode, true);
  // cuBLAS A is our B, cuBLAS B is our A.
  set_attr(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(sb));
  set_attr(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(sa));
  run(ctx, plan, a.values.data, b.values.data, d.data, accumulate, stream);
}

void gemm_bf16_cublaslt(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate,
                        cudaStream_t stream) {
  check_tensor(a, "a", DType::bf16, 2);
  check_tensor(b, "b", DType::bf16, 2);
  check_device(a, "a");
  check_device(b, "b");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  FP8MOE_CHECK(b.size(1) == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.str());
  check_d(d, M, N, accumulate);
  FP8MOE_CHECK(a.is_contiguous() && b.is_contiguous(), "gemm_bf16: a and b must be contiguous");
  if (M == 0 || N == 0) return;
  Context& ctx = context();
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  const cudaDataType_t dt = d.dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  const PlanKey key{dev, false, 0, 0, M, N, K, d.strides[0], int(dt), accumulate};
  std::lock_guard<std::mutex> lock(ctx.mu);
  Plan& plan = get_plan(ctx, key, CUDA_R_16BF, dt, M, N, K, d.strides[0], 0, 0, false);
  run(ctx, plan, a.data, b.data, d.data, accumulate, stream);
}

}  // namespace fp8moe::cuda
