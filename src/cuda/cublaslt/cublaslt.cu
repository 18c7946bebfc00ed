// cuBLASLt paths of the CUDA backend: the vendor baseline and fallback.
//   FP8 block-scaled GEMM: CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (A, 1x128) x BLK128x128_32F
//   (B, weights) or VEC128_32F x VEC128_32F (Wgrad); BF16 GEMM with FP32 accumulation.
//
// Row-major D [M, N] = A [M, K] * B [N, K]^T in cuBLAS's column-major terms: both operands are
// K-major ("TN", what FP8 needs); either cuBLAS "A" := our B and D is written as the column-major
// N x M matrix D^T (orientation 0), or cuBLAS "A" := our A and D is row-major (orientation 1).
// get_plan takes the first one cuBLASLt supports for the scale modes at hand.
// Scales: VEC128 wants [K/128, rows] with the rows contiguous (our 1x128 layout, but with the
// leading dimension equal to the row count: padded ld(R) = round_up(R, 4) is repacked when
// R % 4 != 0); BLK128x128 wants [ceil(rows/128), K/128] row-major (our 128x128 layout).
// Plans (descriptors + heuristic algorithm) are cached per problem so that repeated calls cost
// one cublasLtMatmul; the cache is guarded by a mutex.
#include <cublasLt.h>

#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

namespace {

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  int orient = 0;    // see get_plan
  std::string desc;  // the algorithm's configuration (describe)
  ~Plan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// The configuration cuBLASLt's heuristic picked: CTA tile (in its M x N, i.e. for orientation 0
// over our N x M), stages, K splits, thread-block cluster.
std::string describe(const cublasLtMatmulAlgo_t& algo, int orient) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr, auto zero) {
    decltype(zero) v = zero;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) v = zero;
    return v;
  };
  // cublasLtMatmulTile_t 0..35 and cublasLtClusterShape_t 0..16 by name (cublasLt.h); others by id.
  static const char* const kTiles[] = {"undefined", "8x8", "8x16", "16x8", "8x32", "16x16", "32x8", "8x64", "16x32",
                                       "32x16", "64x8", "32x32", "32x64", "64x32", "32x128", "64x64", "128x32",
                                       "64x128", "128x64", "64x256", "128x128", "256x64", "64x512", "128x256",
                                       "256x128", "512x64", "64x96", "96x64", "96x128", "128x160", "160x128",
                                       "192x128", "128x192", "128x96", "32x256", "256x32"};
  static const char* const kClusters[] = {"auto", "?", "1x1x1", "2x1x1", "4x1x1", "1x2x1", "2x2x1", "4x2x1", "1x4x1",
                                          "2x4x1", "4x4x1", "8x1x1", "1x8x1", "8x2x1", "2x8x1", "16x1x1", "1x16x1"};
  const uint32_t tile = get(CUBLASLT_ALGO_CONFIG_TILE_ID, uint32_t(0));
  const uint16_t cluster = get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, uint16_t(0));
  std::string s = "algo " + std::to_string(get(CUBLASLT_ALGO_CONFIG_ID, int32_t(0))) + ", tile ";
  s += tile < std::size(kTiles) ? kTiles[tile] : "#" + std::to_string(tile);
  s += orient == 0 ? " (N x M)" : " (M x N)";
  s += ", stages #" + std::to_string(get(CUBLASLT_ALGO_CONFIG_STAGES_ID, uint32_t(0)));
  s += ", split-K " + std::to_string(get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, int32_t(1)));
  s += " (reduction " + std::to_string(get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, uint32_t(0))) + ")";
  s += ", cluster ";
  s += cluster < std::size(kClusters) ? kClusters[cluster] : "#" + std::to_string(cluster);
  s += ", swizzle " + std::to_string(get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, uint32_t(0)));
  return s;
}

// (device, fp8?, a scale mode, b scale mode, M, N, K, ldd, d dtype, accumulate)
using PlanKey = std::tuple<int, bool, int, int, int64_t, int64_t, int64_t, int64_t, int, bool>;

// The plans of the current device. The handle and the workspaces (one per stream: GEMMs on two
// streams, a step's Wgrads beside its Dgrads, may run at the same time) are the model ops' own
// (ops::cublaslt_shared).
struct Context {
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::mutex mu;
};

Context& context() {
  // NOTES: one context per device, leaked on purpose, as the handle it plans with.
  static std::mutex mu;
  static std::map<int, Context*> ctxs;
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  Context*& c = ctxs[dev];
  if (!c) c = new Context;
  return *c;
}

void check_device(const TensorView& t, const char* arg) {
  FP8MOE_CHECK(t.device == Device::cuda, arg << ": expected a GPU tensor, got " << t.str());
}

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

// Builds (or fetches) the plan. Two orientations are tried, the first one cuBLASLt accepts wins:
//   0: cuBLAS A := our B (K x N, TRANSA = T), cuBLAS B := our A (K x M), D column-major N x M;
//   1: cuBLAS A := our A (K x M, TRANSA = T), cuBLAS B := our B (K x N), D row-major M x N
//      (CUBLASLT_ORDER_ROW).
// NOTES: block-scaled FP8 validates the scale pointers in the heuristic query, so they are set
// before it (and again on every call, since the plan is shared).
Plan& get_plan(Context& ctx, const ops::CublasLtShared& lt, const PlanKey& key, cudaDataType_t in_type,
               cudaDataType_t d_type, int64_t M, int64_t N, int64_t K, int64_t ldd, int a_mode, int b_mode, bool fp8,
               const void* sa, const void* sb) {
  auto it = ctx.plans.find(key);
  if (it != ctx.plans.end()) return *it->second;
  std::string failures;
  for (int orient = 0; orient < (fp8 ? 2 : 1); ++orient) {
    auto plan = std::make_unique<Plan>();
    plan->orient = orient;
    FP8MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    set_attr(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, ta);
    set_attr(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, tb);
    if (fp8) {
      // a_mode / b_mode are the modes of our A and our B.
      set_attr(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(orient == 0 ? b_mode : a_mode));
      set_attr(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(orient == 0 ? a_mode : b_mode));
      set_attr(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, orient == 0 ? sb : sa);
      set_attr(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, orient == 0 ? sa : sb);
    }
    if (orient == 0) {
      FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, in_type, uint64_t(K), uint64_t(N), K));
      FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, in_type, uint64_t(K), uint64_t(M), K));
      FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lc, d_type, uint64_t(N), uint64_t(M), ldd));
    } else {
      FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, in_type, uint64_t(K), uint64_t(M), K));
      FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, in_type, uint64_t(K), uint64_t(N), K));
      FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lc, d_type, uint64_t(M), uint64_t(N), ldd));
      const int32_t row = CUBLASLT_ORDER_ROW;
      FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(plan->lc, CUBLASLT_MATRIX_LAYOUT_ORDER, &row, sizeof(row)));
    }
    cublasLtMatmulPreference_t pref = nullptr;
    FP8MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = lt.workspace_bytes;
    cublasLtMatmulHeuristicResult_t res{};
    int n = 0;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(lt.handle, plan->op, plan->la, plan->lb, plan->lc, plan->lc, pref, 1, &res,
                                          &n);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st == CUBLAS_STATUS_SUCCESS && n > 0) {
      plan->algo = res.algo;
      plan->desc = describe(res.algo, orient);
      return *ctx.plans.emplace(key, std::move(plan)).first->second;
    }
    failures += std::string(" [orientation ") + std::to_string(orient) + ": " +
                (st == CUBLAS_STATUS_SUCCESS ? "no algorithm" : cublasLtGetStatusString(st)) + "]";
  }
  throw Error(std::string("cublasLtMatmulAlgoGetHeuristic: no ") + (fp8 ? "FP8 block-scaled" : "BF16") +
              " GEMM for M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) + failures);
}

void run(const ops::CublasLtShared& lt, Plan& plan, const void* a_ptr, const void* b_ptr, void* d, bool accumulate,
         cudaStream_t stream) {
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const void* first = plan.orient == 0 ? b_ptr : a_ptr;
  const void* second = plan.orient == 0 ? a_ptr : b_ptr;
  FP8MOE_CUBLAS_CHECK(cublasLtMatmul(lt.handle, plan.op, &alpha, first, plan.la, second, plan.lb, &beta, d, plan.lc, d,
                                     plan.lc, &plan.algo, lt.workspace, lt.workspace_bytes, stream));
}

void check_d(const TensorView& d, int64_t M, int64_t N, bool accumulate) {
  check_tensor(d, "d", {DType::f32, DType::bf16}, 2);
  check_shape(d, "d", {M, N});
  check_device(d, "d");
  FP8MOE_CHECK(!accumulate || d.dtype == DType::f32, "d: accumulate needs an f32 output, got " << d.str());
  FP8MOE_CHECK(d.strides[1] == 1 && d.strides[0] >= N, "d: expected row-major rows, got " << d.str());
  FP8MOE_CHECK(aligned16(d.data), "d: must be 16-byte aligned for cuBLASLt");
}

// The FP8 GEMM through its cached plan (checked arguments); with `desc`, only the plan's
// algorithm description (no launch).
void run_fp8(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate, cudaStream_t stream,
             std::string* desc) {
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
  // Scale modes of our A (1x128 activations) and our B (weights, or 1x128 for Wgrad).
  const int a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int b_mode = b_vec ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  // The description alone launches nothing: the scale pointers only fill the plan's descriptor.
  std::shared_ptr<void> tmp_a, tmp_b;
  const float* sa = desc ? a.scales.ptr<const float>() : vec128_scales(a.scales, M, tmp_a, stream);
  const float* sb =
      b_vec && !desc ? vec128_scales(b.scales, N, tmp_b, stream) : b.scales.ptr<const float>();
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  const cudaDataType_t dt = d.dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  const PlanKey key{dev, true, a_mode, b_mode, M, N, K, d.strides[0], int(dt), accumulate};
  const ops::CublasLtShared lt = ops::cublaslt_shared(stream);
  std::lock_guard<std::mutex> lock(ctx.mu);
  Plan& plan = get_plan(ctx, lt, key, CUDA_R_8F_E4M3, dt, M, N, K, d.strides[0], a_mode, b_mode, true, sa, sb);
  set_attr(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(plan.orient == 0 ? sb : sa));
  set_attr(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(plan.orient == 0 ? sa : sb));
  if (desc) *desc = plan.desc;
  else run(lt, plan, a.values.data, b.values.data, d.data, accumulate, stream);
}

}  // namespace

void gemm_fp8_cublaslt(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                       cudaStream_t stream) {
  run_fp8(a, b, d, accumulate, stream, nullptr);
}

std::string gemm_fp8_cublaslt_algorithm(const QuantizedView& a, const QuantizedView& b, const TensorView& d,
                                        bool accumulate) {
  std::string desc;
  run_fp8(a, b, d, accumulate, nullptr, &desc);
  return desc;
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
  const ops::CublasLtShared lt = ops::cublaslt_shared(stream);
  std::lock_guard<std::mutex> lock(ctx.mu);
  Plan& plan = get_plan(ctx, lt, key, CUDA_R_16BF, dt, M, N, K, d.strides[0], 0, 0, false, nullptr, nullptr);
  run(lt, plan, a.data, b.data, d.data, accumulate, stream);
}

}  // namespace fp8moe::cuda
