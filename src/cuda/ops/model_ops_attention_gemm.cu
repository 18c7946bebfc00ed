// The GEMM path of the CUDA causal attention (model_ops_attention.cu dispatches; the CPU op in
// src/cpu/ops_attention.cpp is the specification): the scores are materialized, so the matrix
// work runs as cuBLASLt GEMMs with FP32 accumulation (CUBLAS_COMPUTE_32F, no TF32), which keep
// the FMA pipes (FP32) or the Tensor Cores (BF16) far busier than the FlashAttention kernels'
// shared-memory-bound loops. Two computes (Backend::attention_forward):
//   f32    FP32 operands (the fp32 recipe), FP32 arithmetic throughout.
//   bf16   BF16 operands, FP32 accumulation and softmax (the bf16 and FP8 recipes): Q, K, V (and
//          dout) of a chunk are converted to BF16 copies first, one elementwise pass each, and the
//          row kernels write bf(P) and bf(dS) (bf = round to nearest even BF16) straight into BF16
//          buffers that the following GEMMs read; the FP32 scores are only read.
// Per chunk of nb sequences, with FP32 score workspaces W [nb, H, S, ldw] (ldw = S rounded up to
// 4, so every row starts 16-byte aligned) and, for bf16, BF16 ones Wb [nb, H, S, ldb] (ldb = S
// rounded up to 8, likewise); operands Q, K, V, dout read as BF16 copies in bf16 (heads padded
// to 8 columns, likewise):
//   forward    W = scale * Q K^T; softmax rows with the causal mask -> P (zeros above the
//              diagonal: in place in f32, bf(P) into Wb in bf16) and lse [H, T] = max + log(sum),
//              the scaled scores' log-sum-exp; out = P V.
//   backward   (Di = rowsum(dout * out) first, by the caller, from the FP32 dout and out)
//              W1 = scale * Q K^T, W2 = dout V^T; P = exp(W1 - lse) and dS = P * (W2 - Di) *
//              scale in one pass (in place in W1, W2 in f32; bf(P), bf(dS) into Wb1, Wb2 in
//              bf16); dv = P^T dout, dq = dS K, dk = dS^T Q.
// The GEMMs cover the whole S x S square (the zeros above the diagonal are multiplied, not
// skipped); the row kernels neither read nor exponentiate above the diagonal.
// Operands are per (sequence, head) views into [T, H, D] tensors (or their BF16 copies [T, H, Dp],
// likewise with Dp): row stride H * D, head h at offset h * D, sequence b at b * S * H * D. Such
// a view is two-dimensional in (sequence, head), so one strided-batched GEMM covers only the
// heads of one sequence (batch stride D) or, when a chunk has more sequences than heads, one head
// of every sequence (batch stride S * H * D), and loops over the other index (`looped`): a few
// dozen blocks per GEMM at small head counts, most SMs idle. `batched` (the default) copies the
// chunk's operands head-major, [nb, H, S, D] (in bf16 the BF16 copies are made so, at no extra
// pass), runs each product as one GEMM over all nb * H matrices, and copies the results back to
// [T, H, D]. It runs the algorithm the looped GEMM's heuristic chose for the same product, so
// every element is the same sum in the same order: the two are bitwise equal (the tests check),
// and where cuBLASLt refuses that algorithm for the batched layouts the product runs looped.
// Alignment prefs are the least of the base pointer's and the strides' alignments, so one plan
// serves every call of the loop; the batched views are at least as aligned. Plans are cached per
// problem.
// Every result is written once, by one GEMM or one row kernel (no atomics), and cuBLASLt's GEMMs
// repeat their bits on one GPU: runs are deterministic (the tests check run to run).
#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <mutex>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kRowThreads = 256;  // one warp per score row, 8 rows per block

int64_t score_ld(int64_t S) { return round_up(S, 4); }
int64_t score_ld_bf16(int64_t S) { return round_up(S, 8); }
// The head stride of the BF16 operand copies [rows, H, Dp]: D rounded up to 8, so that every row
// and head of a BF16 GEMM operand starts 16-byte aligned whatever D.
int64_t head_ld_bf16(int64_t D) { return round_up(D, 8); }

// The workspace of a chunk of nb sequences, carved from one stream-ordered allocation in
// 256-byte aligned pieces (byte offsets): the FP32 score buffers (one forward, two backward) and,
// in bf16, their BF16 counterparts and the BF16 copies of the chunk's Q, K, V (and dout).
// Batched in f32, also the head-major FP32 copies of the operands and the head-major results
// (out; dq, dk, dv), which are then copied back.
struct Workspace {
  size_t bytes = 0;
  size_t scores[2] = {}, scores_bf16[2] = {}, q = 0, k = 0, v = 0, dout = 0, res[3] = {};
  Workspace(int64_t nb, int64_t S, int64_t H, int64_t Dk, int64_t Dv, bool bf16, bool backward, bool batched) {
    const auto take = [this](int64_t n) {
      const size_t at = bytes;
      bytes += size_t(round_up(n, 256));
      return at;
    };
    const int buffers = backward ? 2 : 1;
    for (int i = 0; i < buffers; ++i) scores[i] = take(nb * H * S * score_ld(S) * 4);
    if (bf16)
      for (int i = 0; i < buffers; ++i) scores_bf16[i] = take(nb * H * S * score_ld_bf16(S) * 2);
    if (bf16 || batched) {  // operand copies: BF16 with padded heads, or FP32
      const auto copy = [&](int64_t D) { return take(nb * S * H * (bf16 ? head_ld_bf16(D) * 2 : D * 4)); };
      q = copy(Dk);
      k = copy(Dk);
      v = copy(Dv);
      if (backward) dout = copy(Dv);
    }
    if (!batched) return;
    if (backward) {
      res[0] = take(nb * S * H * Dk * 4);  // dq
      res[1] = take(nb * S * H * Dk * 4);  // dk
      res[2] = take(nb * S * H * Dv * 4);  // dv
    } else {
      res[0] = take(nb * S * H * Dv * 4);  // out
    }
  }
};

// ---- row kernels ----

// Row r of W [nb, H, S, ldw] is query i = r % S of head h = (r / S) % H of sequence b0 + r / (S * H).
struct RowIndex {
  int64_t i, lse;  // query row in its sequence; index into lse / di [H, T]
};
__device__ __forceinline__ RowIndex row_index(int64_t r, int64_t S, int64_t H, int64_t T, int64_t b0) {
  const int64_t i = r % S, bh = r / S, h = bh % H, b = b0 + bh / H;
  return {i, h * T + b * S + i};
}

// P = softmax of the row's keys 0..i (zeros after i) and its lse: P in place (f32) or bf(P) into
// the row of wb [rows, ldb] (kBf16).
template <bool kBf16>
__global__ void __launch_bounds__(kRowThreads) attention_softmax_kernel(float* __restrict__ w,
                                                                        uint16_t* __restrict__ wb, int64_t ldb,
                                                                        float* __restrict__ lse, int64_t rows,
                                                                        int64_t S, int64_t ldw, int64_t H, int64_t T,
                                                                        int64_t b0) {
  const int64_t r = (int64_t(blockIdx.x) * kRowThreads + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const RowIndex at = row_index(r, S, H, T, b0);
  float* row = w + r * ldw;
  // Online max and sum per lane (one exp per score), then across the warp.
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = lane; j <= at.i; j += 32) {
    const float s = row[j];
    if (s > m) {
      l = l * expf(m - s) + 1.0f;
      m = s;
    } else {
      l += expf(s - m);
    }
  }
  const float mx = warp_max(m);
  const float sum = warp_sum(m == -INFINITY ? 0.0f : l * expf(m - mx));
  const float inv = 1.0f / sum;
  if constexpr (kBf16) {
    uint16_t* prow = wb + r * ldb;
    for (int64_t j = lane; j < S; j += 32) prow[j] = j <= at.i ? f32_to_bf16(expf(row[j] - mx) * inv) : 0;
  } else {
    for (int64_t j = lane; j < S; j += 32) row[j] = j <= at.i ? expf(row[j] - mx) * inv : 0.0f;
  }
  if (lane == 0) lse[at.lse] = mx + logf(sum);
}

// w1: scaled scores -> P = exp(s - lse); w2: dP = dout V^T -> dS = P * (dP - Di) * scale; both
// zero after the diagonal, in place (f32) or as bf(P), bf(dS) into the rows of wb1, wb2 [rows,
// ldb] (kBf16).
template <bool kBf16>
__global__ void __launch_bounds__(kRowThreads) attention_dscores_kernel(float* __restrict__ w1, float* __restrict__ w2,
                                                                        uint16_t* __restrict__ wb1,
                                                                        uint16_t* __restrict__ wb2, int64_t ldb,
                                                                        const float* __restrict__ lse,
                                                                        const float* __restrict__ di, int64_t rows,
                                                                        int64_t S, int64_t ldw, int64_t H, int64_t T,
                                                                        int64_t b0, float scale) {
  const int64_t r = (int64_t(blockIdx.x) * kRowThreads + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const RowIndex at = row_index(r, S, H, T, b0);
  const float l = lse[at.lse], d = di[at.lse];
  float* p = w1 + r * ldw;
  float* ds = w2 + r * ldw;
  for (int64_t j = lane; j < S; j += 32) {
    if constexpr (kBf16) {
      const float pj = j <= at.i ? expf(p[j] - l) : 0.0f;
      wb1[r * ldb + j] = f32_to_bf16(pj);
      wb2[r * ldb + j] = j <= at.i ? f32_to_bf16(pj * (ds[j] - d) * scale) : 0;
    } else if (j <= at.i) {
      const float pj = expf(p[j] - l);
      p[j] = pj;
      ds[j] = pj * (ds[j] - d) * scale;
    } else {
      p[j] = 0.0f;
      ds[j] = 0.0f;
    }
  }
}

// ---- head-major copies (the batched GEMMs' operands and results) ----

__device__ __forceinline__ void store_operand(float& d, float x) { d = x; }
__device__ __forceinline__ void store_operand(uint16_t& d, float x) { d = f32_to_bf16(x); }

// Between the rows of nb sequences of x [nb * S, H, D] (token-major) and hm [nb, H, S, ld]
// (head-major, ld >= D; the padding columns are neither read nor written): kToHeads copies x to
// hm, converted to Out (f32, or bf16 rounded as cuda_convert rounds); otherwise hm (f32) to x.
template <bool kToHeads, class Out>
__global__ void head_major_kernel(const float* __restrict__ src, Out* __restrict__ dst, int64_t S, int64_t H,
                                  int64_t D, int64_t ld, int64_t n) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = e % D, r = e / D, s = r % S, bh = r / S, h = bh % H, b = bh / H;  // e in [nb, H, S, D]
    const int64_t token = ((b * S + s) * H + h) * D + d, head = r * ld + d;
    if constexpr (kToHeads)
      store_operand(dst[head], src[token]);
    else
      dst[token] = src[head];
  }
}

// ---- strided-batched GEMMs: FP32 or BF16 operands, FP32 accumulation and output ----

// One strided-batched row-major GEMM, d_i [M, N] = alpha * op(a_i) op(b_i) for i < batch, with
// a_i = a + i * sa (op(a_i) [M, K], stored [K, M] when ta), b_i likewise ([K, N], stored [N, K]
// when tb), d_i = d + i * sd; leading dimensions and strides in elements, alignments in bytes;
// a and b FP32, or BF16 when bf16; d FP32.
struct Problem {
  int64_t M, N, K, ta, tb, lda, ldb, ldd, batch, sa, sb, sd, align_a, align_b, align_d, bf16;
  std::array<int64_t, 16> key() const {
    return {M, N, K, ta, tb, lda, ldb, ldd, batch, sa, sb, sd, align_a, align_b, align_d, bf16};
  }
};

// Plans per (device, problem) for the looped GEMMs (the heuristic's algorithm; the second half of
// the key zero) and per (device, looped problem, batched problem) for the batched ones (the looped
// problem's algorithm; nullptr where cuBLASLt refuses it).
struct PlanCache {
  std::mutex mu;
  std::map<std::pair<int, std::array<int64_t, 32>>, std::unique_ptr<CublasLtPlan>> plans;
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache;  // leaked on purpose, as model_ops_gemm.cu's context
  return *cache;
}

std::array<int64_t, 32> plan_key(const Problem& looped, const Problem* batched) {
  std::array<int64_t, 32> k{};
  const auto a = looped.key();
  std::copy(a.begin(), a.end(), k.begin());
  if (batched) {
    const auto b = batched->key();
    std::copy(b.begin(), b.end(), k.begin() + 16);
  }
  return k;
}

// Column-major layout of `type`, rows x cols (ld) with `batch` matrices `stride` elements apart.
cublasLtMatrixLayout_t layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld, int64_t batch,
                              int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  FP8MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  const int32_t count = int32_t(batch);
  cublasStatus_t st = cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride));
  if (st != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatrixLayoutDestroy(l);
    FP8MOE_CUBLAS_CHECK(st);
  }
  return l;
}

// The descriptors of a problem. Row-major d = op(a) op(b) is column-major d^T = op(b)^T op(a)^T
// (as in model_ops_gemm.cu): cuBLAS "A" is our b, "B" our a, and d the column-major N x M matrix.
std::unique_ptr<CublasLtPlan> describe(const Problem& p) {
  auto plan = std::make_unique<CublasLtPlan>();
  FP8MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opa = p.tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = p.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  FP8MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  FP8MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  const cudaDataType_t in = p.bf16 ? CUDA_R_16BF : CUDA_R_32F;
  // cuBLAS A := our b, column-major [N, K] without tb, [K, N] with it.
  plan->la = p.tb ? layout(in, uint64_t(p.K), uint64_t(p.N), p.ldb, p.batch, p.sb)
                  : layout(in, uint64_t(p.N), uint64_t(p.K), p.ldb, p.batch, p.sb);
  // cuBLAS B := our a, column-major [K, M] without ta, [M, K] with it.
  plan->lb = p.ta ? layout(in, uint64_t(p.M), uint64_t(p.K), p.lda, p.batch, p.sa)
                  : layout(in, uint64_t(p.K), uint64_t(p.M), p.lda, p.batch, p.sa);
  plan->lc = layout(CUDA_R_32F, uint64_t(p.N), uint64_t(p.M), p.ldd, p.batch, p.sd);
  return plan;
}

std::unique_ptr<CublasLtPlan> make_plan(const CublasLtShared& lt, const Problem& p) {
  auto plan = describe(p);
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  // NOTES: head views are offset by h * D elements; the alignments say so (cuBLASLt assumes 256 bytes).
  const cublasStatus_t st = cublaslt_heuristic(lt.handle, plan->op, plan->la, plan->lb, plan->lc, lt.workspace_bytes,
                                               uint32_t(p.align_b), uint32_t(p.align_a), uint32_t(p.align_d), &res,
                                               &found);
  FP8MOE_CUBLAS_CHECK(st);
  FP8MOE_CHECK(found > 0, "attention: cuBLASLt has no " << (p.bf16 ? "BF16" : "FP32")
                              << " algorithm for the batched GEMM M=" << p.M << " N=" << p.N << " K=" << p.K
                              << " ta=" << p.ta << " tb=" << p.tb << " lda=" << p.lda << " ldb=" << p.ldb
                              << " ldd=" << p.ldd << " batch=" << p.batch << " alignments " << p.align_a << "/"
                              << p.align_b << "/" << p.align_d << " bytes");
  plan->algo = res.algo;
  return plan;
}

// The batched problem's plan with the looped one's algorithm, or nullptr where cuBLASLt does not
// run that algorithm on these layouts or within the shared workspace.
std::unique_ptr<CublasLtPlan> make_pinned_plan(const CublasLtShared& lt, const CublasLtPlan& looped,
                                               const Problem& p) {
  auto plan = describe(p);
  cublasLtMatmulHeuristicResult_t res{};
  const cublasStatus_t st =
      cublasLtMatmulAlgoCheck(lt.handle, plan->op, plan->la, plan->lb, plan->lc, plan->lc, &looped.algo, &res);
  if (st != CUBLAS_STATUS_SUCCESS || res.workspaceSize > lt.workspace_bytes) return nullptr;
  plan->algo = looped.algo;
  return plan;
}

// The cached plan of a looped problem, and (batched given) of the batched problem pinned to its
// algorithm (nullptr when refused). Under the cache's lock.
const CublasLtPlan* cached_plan(PlanCache& cache, const CublasLtShared& lt, int dev, const Problem& looped,
                                const Problem* batched) {
  auto& slot = cache.plans[{dev, plan_key(looped, nullptr)}];
  if (!slot) slot = make_plan(lt, looped);
  if (!batched) return slot.get();
  const auto key = std::make_pair(dev, plan_key(looped, batched));
  auto it = cache.plans.find(key);
  if (it == cache.plans.end()) it = cache.plans.emplace(key, make_pinned_plan(lt, *slot, *batched)).first;
  return it->second.get();
}

// The (sequence, head) matrices of an FP32 or (bf16) BF16 array: matrix (b, h) of the chunk starts
// at base + b * seq + h * head, rows ld apart (all in elements).
struct Operand {
  const void* base;
  int64_t ld, seq, head;
  bool bf16;
  int64_t element_bytes() const { return bf16 ? 2 : 4; }
  // The alignment every matrix of the chunk has, in bytes.
  int64_t align() const {
    const auto bytes = [this](int64_t n) { return uintptr_t(n * element_bytes()); };
    return std::min({alignment_of(reinterpret_cast<uintptr_t>(base)), alignment_of(bytes(ld)),
                     alignment_of(bytes(seq)), alignment_of(bytes(head))});
  }
  // The address `elements` elements past base.
  const void* at(int64_t elements) const { return static_cast<const char*>(base) + elements * element_bytes(); }
};

// A product of a chunk of nb sequences and H heads, d(b, h) [M, N] = alpha * op(a(b, h))
// op(b(b, h)) (a and b both FP32 or both BF16; d FP32), in its looped views and, for the batched
// GEMM, its head-major ones (matrix (b, h) at (b * H + h) * head: seq = H * head).
struct Product {
  int64_t M, N, K;
  bool ta, tb;
  float alpha;
  Operand a, b, d;     // looped
  Operand ha, hb, hd;  // head-major
};

// The looped GEMM: batched over the heads and looping over the sequences, or the other way when
// nb > H.
struct Looped {
  Problem p;
  bool over_heads;
  int64_t loops;
};
Looped looped_problem(const Product& g, int64_t nb, int64_t H) {
  const bool over_heads = H >= nb;
  const int64_t batch = over_heads ? H : nb, loops = over_heads ? nb : H;
  const auto stride = [&](const Operand& o) { return over_heads ? o.head : o.seq; };
  FP8MOE_CHECK(batch <= INT32_MAX, "attention: " << batch << " batched GEMMs exceed cuBLASLt's batch count");
  return {Problem{g.M, g.N, g.K, g.ta, g.tb, g.a.ld, g.b.ld, g.d.ld, batch, stride(g.a), stride(g.b), stride(g.d),
                  g.a.align(), g.b.align(), g.d.align(), g.a.bf16},
          over_heads, loops};
}
Problem batched_problem(const Product& g, int64_t nb, int64_t H) {
  return Problem{g.M,    g.N,          g.K,          g.ta,         g.tb,         g.ha.ld,     g.hb.ld,    g.hd.ld,
                 nb * H, g.ha.head,    g.hb.head,    g.hd.head,    g.ha.align(), g.hb.align(), g.hd.align(),
                 g.ha.bf16};
}

// The batched plans of a chunk's products, or an empty vector when one of them is refused (then
// the chunk runs looped) or nb * H is over cuBLASLt's batch count.
std::vector<const CublasLtPlan*> batched_plans(const std::vector<Product>& gs, int64_t nb, int64_t H,
                                               cudaStream_t stream) {
  if (nb * H > INT32_MAX) return {};
  const CublasLtShared lt = cublaslt_shared(stream);
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  std::vector<const CublasLtPlan*> plans;
  for (const Product& g : gs) {
    const Problem b = batched_problem(g, nb, H);
    const CublasLtPlan* plan = cached_plan(cache, lt, dev, looped_problem(g, nb, H).p, &b);
    if (!plan) return {};
    plans.push_back(plan);
  }
  return plans;
}

void run_looped(const Product& g, int64_t nb, int64_t H, cudaStream_t stream) {
  const Looped lp = looped_problem(g, nb, H);
  const CublasLtShared lt = cublaslt_shared(stream);
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  const CublasLtPlan& plan = *cached_plan(cache, lt, dev, lp.p, nullptr);
  const auto stride = [&](const Operand& o) { return lp.over_heads ? o.seq : o.head; };
  const float beta = 0.0f;
  for (int64_t l = 0; l < lp.loops; ++l) {
    void* dl = const_cast<void*>(g.d.at(l * stride(g.d)));
    FP8MOE_CUBLAS_CHECK(cublasLtMatmul(lt.handle, plan.op, &g.alpha, g.b.at(l * stride(g.b)), plan.la,
                                       g.a.at(l * stride(g.a)), plan.lb, &beta, dl, plan.lc, dl, plan.lc, &plan.algo,
                                       lt.workspace, lt.workspace_bytes, stream));
  }
}

void run_batched(const Product& g, const CublasLtPlan& plan, cudaStream_t stream) {
  const CublasLtShared lt = cublaslt_shared(stream);
  const float beta = 0.0f;
  void* d = const_cast<void*>(g.hd.base);
  FP8MOE_CUBLAS_CHECK(cublasLtMatmul(lt.handle, plan.op, &g.alpha, g.hb.base, plan.la, g.ha.base, plan.lb, &beta, d,
                                     plan.lc, d, plan.lc, &plan.algo, lt.workspace, lt.workspace_bytes, stream));
}

// ---- operand views and copies ----

// The looped view of sequences b0.. of x [T, H, D] f32: the tensor itself, or (bf16) its BF16
// copy at `copy`, [nb * S, H, Dp] (Dp = head_ld_bf16(D); the padding columns are never read).
Operand token_major(const TensorView& x, int64_t b0, int64_t S, bool bf16, const void* copy) {
  const int64_t H = x.size(1), D = x.size(2);
  if (!bf16) return {x.ptr<const float>() + b0 * S * H * D, H * D, S * H * D, D, false};
  const int64_t Dp = head_ld_bf16(D);
  return {copy, H * Dp, S * H * Dp, Dp, true};
}
// A head-major array [nb, H, S, ld] at `base` as an operand (or result) of the batched GEMMs.
Operand head_major(const void* base, int64_t S, int64_t H, int64_t ld, bool bf16) {
  return {base, ld, H * S * ld, S * ld, bf16};
}
Operand scores(const float* w, int64_t S, int64_t H) { return head_major(w, S, H, score_ld(S), false); }
Operand scores_bf16(const uint16_t* w, int64_t S, int64_t H) {
  return head_major(w, S, H, score_ld_bf16(S), true);
}

// The BF16 copy of sequences b0 .. b0 + nb - 1 of x [T, H, D] f32 into dst [nb * S, H, Dp] (the
// looped operand): one elementwise pass.
void copy_token_major_bf16(const TensorView& x, int64_t b0, int64_t nb, int64_t S, void* dst, cudaStream_t stream) {
  const int64_t H = x.size(1), D = x.size(2), Dp = head_ld_bf16(D), rows = nb * S * H;
  float* src = const_cast<float*>(x.ptr<const float>()) + b0 * S * H * D;
  if (Dp == D)
    cuda_convert(TensorView(src, DType::f32, {rows * D}, Device::cuda),
                 TensorView(dst, DType::bf16, {rows * D}, Device::cuda), stream);
  else
    cuda_copy_cols(TensorView(src, DType::f32, {rows, D}, Device::cuda), 0,
                   TensorView(dst, DType::bf16, {rows, Dp}, Device::cuda), 0, D, false, stream);
}

// Sequences b0 .. b0 + nb - 1 of x [T, H, D] f32 copied head-major into dst [nb, H, S, ld]: FP32,
// or BF16 (ld = Dp), the batched operand.
void copy_head_major(const TensorView& x, int64_t b0, int64_t nb, int64_t S, bool bf16, void* dst,
                     cudaStream_t stream) {
  const int64_t H = x.size(1), D = x.size(2), n = nb * S * H * D;
  const float* src = x.ptr<const float>() + b0 * S * H * D;
  constexpr int kThreads = 256;
  if (bf16)
    head_major_kernel<true, uint16_t><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        src, static_cast<uint16_t*>(dst), S, H, D, head_ld_bf16(D), n);
  else
    head_major_kernel<true, float><<<grid_for(n, kThreads), kThreads, 0, stream>>>(src, static_cast<float*>(dst), S,
                                                                                   H, D, D, n);
  FP8MOE_CUDA_CHECK_LAUNCH("head_major_kernel");
}

// The head-major result src [nb, H, S, D] back into sequences b0.. of x [T, H, D].
void copy_back_head_major(const float* src, const TensorView& x, int64_t b0, int64_t nb, int64_t S, cudaStream_t stream) {
  const int64_t H = x.size(1), D = x.size(2), n = nb * S * H * D;
  constexpr int kThreads = 256;
  head_major_kernel<false, float><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      src, x.ptr<float>() + b0 * S * H * D, S, H, D, D, n);
  FP8MOE_CUDA_CHECK_LAUNCH("head_major_kernel");
}

// The views of a chunk's operand x [T, H, D] whose copy (the BF16 one, or the head-major one) is
// at `copy`: looped and head-major, known before the copy is made.
std::pair<Operand, Operand> operand_views(const TensorView& x, int64_t b0, int64_t S, bool bf16, const void* copy) {
  const int64_t H = x.size(1), D = x.size(2);
  return {token_major(x, b0, S, bf16, copy), head_major(copy, S, H, bf16 ? head_ld_bf16(D) : D, bf16)};
}
// The views of a result x [T, H, D] f32: the tensor itself, and the head-major result at `res`.
std::pair<Operand, Operand> result_views(const TensorView& x, int64_t b0, int64_t S, const void* res) {
  return {token_major(x, b0, S, false, nullptr), head_major(res, S, x.size(1), x.size(2), false)};
}
Product product(int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha, std::pair<Operand, Operand> a,
                std::pair<Operand, Operand> b, std::pair<Operand, Operand> d) {
  return {M, N, K, ta, tb, alpha, a.first, b.first, d.first, a.second, b.second, d.second};
}

// A chunk of nb sequences from b0, run batched (plans: the products' batched plans) or looped.
struct Chunk {
  int64_t b0, nb, S, H;
  bool bf16;
  std::vector<const CublasLtPlan*> plans;  // empty: looped
  char* base;                              // the workspace
  cudaStream_t stream;
  bool batched() const { return !plans.empty(); }
  // Makes the copy of operand x at `at` of the workspace that the chunk's GEMMs read (none for a
  // looped FP32 chunk: it reads the tensor).
  void copy(const TensorView& x, size_t at) const {
    if (batched())
      copy_head_major(x, b0, nb, S, bf16, base + at, stream);
    else if (bf16)
      copy_token_major_bf16(x, b0, nb, S, base + at, stream);
  }
  void run(const Product& g, size_t i) const {
    if (batched())
      run_batched(g, *plans[i], stream);
    else
      run_looped(g, nb, H, stream);
  }
  // A result of the batched GEMMs, at `at`, into x (the looped ones wrote x).
  void copy_back(size_t at, const TensorView& x) const {
    if (batched()) copy_back_head_major(reinterpret_cast<const float*>(base + at), x, b0, nb, S, stream);
  }
};

}  // namespace

size_t cuda_attention_workspace_bytes(int64_t seq_len, int64_t H, int64_t Dk, int64_t Dv, DType compute,
                                      bool backward, bool batched) {
  return Workspace(1, seq_len, H, Dk, Dv, compute == DType::bf16, backward, batched).bytes;
}

namespace ops {

int64_t attention_gemm_chunk(int64_t B, size_t per_sequence, size_t cap) {
  if (per_sequence == 0 || per_sequence > cap) return 0;
  const int64_t most = std::min<int64_t>(B, int64_t(cap / per_sequence));
  const int64_t chunks = (B + most - 1) / most;
  return (B + chunks - 1) / chunks;  // balanced chunks: the least workspace for that many chunks
}

void attention_gemm_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, int64_t seq_len, double scale, bool bf16, int64_t chunk,
                            bool batched, cudaStream_t stream) {
  const int64_t T = q.size(0), H = q.size(1), S = seq_len, B = T / S, Dk = q.size(2), Dv = v.size(2);
  const int64_t ldw = score_ld(S), ldb = score_ld_bf16(S);
  const Workspace ws(chunk, S, H, Dk, Dv, bf16, false, batched);
  DeviceBuffer buf(ws.bytes, stream);
  char* base = buf.as<char>();
  float* w = reinterpret_cast<float*>(base + ws.scores[0]);
  uint16_t* wb = bf16 ? reinterpret_cast<uint16_t*>(base + ws.scores_bf16[0]) : nullptr;
  const Operand W = scores(w, S, H), P = bf16 ? scores_bf16(wb, S, H) : W;  // scores are head-major already
  auto* softmax = bf16 ? attention_softmax_kernel<true> : attention_softmax_kernel<false>;
  for (int64_t b0 = 0; b0 < B; b0 += chunk) {
    const int64_t nb = std::min(chunk, B - b0), rows = nb * H * S;
    const auto view = [&](const TensorView& x, size_t at) { return operand_views(x, b0, S, bf16, base + at); };
    const std::vector<Product> gs{
        product(S, S, Dk, false, true, float(scale), view(q, ws.q), view(k, ws.k), {W, W}),
        product(S, Dv, S, false, false, 1.0f, {P, P}, view(v, ws.v), result_views(out, b0, S, base + ws.res[0]))};
    const Chunk c{b0, nb, S, H, bf16, batched ? batched_plans(gs, nb, H, stream) : std::vector<const CublasLtPlan*>{},
                  base, stream};
    c.copy(q, ws.q);
    c.copy(k, ws.k);
    c.copy(v, ws.v);
    c.run(gs[0], 0);
    softmax<<<grid_for(rows * 32, kRowThreads, INT32_MAX), kRowThreads, 0, stream>>>(w, wb, ldb, lse.ptr<float>(),
                                                                                      rows, S, ldw, H, T, b0);
    FP8MOE_CUDA_CHECK_LAUNCH("attention_softmax_kernel");
    c.run(gs[1], 1);
    c.copy_back(ws.res[0], out);
  }
}

void attention_gemm_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& lse,
                             const float* di, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                             const TensorView& dv, int64_t seq_len, double scale, bool bf16, int64_t chunk,
                             bool batched, cudaStream_t stream) {
  const int64_t T = q.size(0), H = q.size(1), S = seq_len, B = T / S, Dk = q.size(2), Dv = v.size(2);
  const int64_t ldw = score_ld(S), ldb = score_ld_bf16(S);
  const Workspace ws(chunk, S, H, Dk, Dv, bf16, true, batched);
  DeviceBuffer buf(ws.bytes, stream);
  char* base = buf.as<char>();
  float* w1 = reinterpret_cast<float*>(base + ws.scores[0]);
  float* w2 = reinterpret_cast<float*>(base + ws.scores[1]);
  uint16_t* wb1 = bf16 ? reinterpret_cast<uint16_t*>(base + ws.scores_bf16[0]) : nullptr;
  uint16_t* wb2 = bf16 ? reinterpret_cast<uint16_t*>(base + ws.scores_bf16[1]) : nullptr;
  const Operand W1 = scores(w1, S, H), W2 = scores(w2, S, H);
  const Operand P = bf16 ? scores_bf16(wb1, S, H) : W1, dS = bf16 ? scores_bf16(wb2, S, H) : W2;
  auto* dscores = bf16 ? attention_dscores_kernel<true> : attention_dscores_kernel<false>;
  for (int64_t b0 = 0; b0 < B; b0 += chunk) {
    const int64_t nb = std::min(chunk, B - b0), rows = nb * H * S;
    const auto view = [&](const TensorView& x, size_t at) { return operand_views(x, b0, S, bf16, base + at); };
    const auto result = [&](const TensorView& x, size_t at) { return result_views(x, b0, S, base + at); };
    const auto Q = view(q, ws.q), K = view(k, ws.k), V = view(v, ws.v), G = view(dout, ws.dout);
    const std::vector<Product> gs{
        product(S, S, Dk, false, true, float(scale), Q, K, {W1, W1}),         // scaled scores
        product(S, S, Dv, false, true, 1.0f, G, V, {W2, W2}),                 // dP = dout V^T
        product(S, Dv, S, true, false, 1.0f, {P, P}, G, result(dv, ws.res[2])),     // dv = P^T dout
        product(S, Dk, S, false, false, 1.0f, {dS, dS}, K, result(dq, ws.res[0])),  // dq = dS K
        product(S, Dk, S, true, false, 1.0f, {dS, dS}, Q, result(dk, ws.res[1]))};  // dk = dS^T Q
    const Chunk c{b0, nb, S, H, bf16, batched ? batched_plans(gs, nb, H, stream) : std::vector<const CublasLtPlan*>{},
                  base, stream};
    c.copy(q, ws.q);
    c.copy(k, ws.k);
    c.copy(v, ws.v);
    c.copy(dout, ws.dout);
    c.run(gs[0], 0);
    c.run(gs[1], 1);
    dscores<<<grid_for(rows * 32, kRowThreads, INT32_MAX), kRowThreads, 0, stream>>>(
        w1, w2, wb1, wb2, ldb, lse.ptr<const float>(), di, rows, S, ldw, H, T, b0, float(scale));
    FP8MOE_CUDA_CHECK_LAUNCH("attention_dscores_kernel");
    for (size_t i = 2; i < gs.size(); ++i) c.run(gs[i], i);
    c.copy_back(ws.res[2], dv);
    c.copy_back(ws.res[0], dq);
    c.copy_back(ws.res[1], dk);
  }
}

}  // namespace ops

}  // namespace fp8moe::cuda
