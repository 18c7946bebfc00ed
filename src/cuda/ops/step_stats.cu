// The step statistics of the CUDA backend (contracts: include/fp8moe/backend.hpp, "Step
// statistics"; specification: src/cpu/ops_step_stats.cpp): expert loads, the sequence-wise
// balance loss and its score gradient, a loss sum, computed where the step runs so that it reads
// them back once at its end. The FP64 sums are bit-identical to the CPU's: each one is a single
// thread's loop in the CPU's index order, with the products, quotients and sums rounded one by
// one (__dmul_rn, __ddiv_rn, __dadd_rn: nvcc contracts nothing into FMAs). They are small (a
// sequence's tokens, the experts), so that a thread per sum costs microseconds; what lies between
// the sums runs a thread per element.
#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"
#include "fp8moe/moe_dispatch_args.hpp"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kThreads = 256;

// loads[g] = count of ids equal to g: integer counts in shared memory (exact in any order).
__global__ void __launch_bounds__(kThreads) expert_loads_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t G,
                                                                double* __restrict__ loads) {
  extern __shared__ unsigned long long count[];
  for (int32_t g = threadIdx.x; g < G; g += kThreads) count[g] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int32_t g = ids[i];
    if (g >= 0 && g < G) atomicAdd(&count[g], 1ull);
  }
  __syncthreads();
  for (int32_t g = threadIdx.x; g < G; g += kThreads) loads[g] = double(count[g]);
}

// z_t = sum_e s_{t,e} in order e = 0..E-1, as the CPU's loop.
__device__ double score_sum(const float* __restrict__ s, int64_t E) {
  double z = 0;
#pragma unroll 8
  for (int64_t e = 0; e < E; ++e) z = __dadd_rn(z, double(s[e]));
  return z;
}

// Tokens per block of the balance kernels: a tile of whole tokens' score rows.
__host__ __device__ inline int64_t tile_tokens(int64_t E) { return E >= kThreads ? 1 : kThreads / E; }

// A tile of tokens: z_t by one thread per token, then q_{t,e} = s_{t,e} / z_t / S by one thread
// per score.
__global__ void __launch_bounds__(kThreads) balance_share_kernel(const float* __restrict__ scores, int64_t T, int64_t E,
                                                                 double Sd, double* __restrict__ z,
                                                                 double* __restrict__ q) {
  __shared__ double zs[kThreads];
  const int64_t n = tile_tokens(E), t0 = int64_t(blockIdx.x) * n, nt = min(n, T - t0);
  if (threadIdx.x < nt) zs[threadIdx.x] = z[t0 + threadIdx.x] = score_sum(scores + (t0 + threadIdx.x) * E, E);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < nt * E; i += kThreads)
    q[t0 * E + i] = __ddiv_rn(__ddiv_rn(double(scores[t0 * E + i]), zs[i / E]), Sd);
}

// A block per sequence b: the picks of each expert counted in shared memory (integers, exact in
// any order), then one thread per expert e: f adds f_unit once per pick of e (the same value each
// time, so only the count matters to the bits), P sums q over the sequence's tokens in order, and
// the loss's term alpha * f * P / B, rounded as the CPU rounds it, for balance_total_kernel's sum.
// NOTES: the unrolled loop keeps several loads in flight ahead of each thread's chain of adds.
__global__ void __launch_bounds__(kThreads) balance_fp_kernel(const int32_t* __restrict__ idx, const double* __restrict__ q,
                                                              int64_t B, int64_t S, int64_t E, int64_t K, double f_unit,
                                                              double alpha, double* __restrict__ f,
                                                              double* __restrict__ P, double* __restrict__ term) {
  extern __shared__ int picks[];  // [E]
  const int64_t b = blockIdx.x, t0 = b * S;
  for (int64_t e = threadIdx.x; e < E; e += kThreads) picks[e] = 0;
  __syncthreads();
  for (int64_t j = t0 * K + threadIdx.x; j < (t0 + S) * K; j += kThreads) {
    const int32_t e = idx[j];
    if (e >= 0 && e < E) atomicAdd(&picks[e], 1);
  }
  __syncthreads();
  const double Bd = double(B);
  for (int64_t e = threadIdx.x; e < E; e += kThreads) {
    double fe = 0, pe = 0;
    for (int n = 0; n < picks[e]; ++n) fe = __dadd_rn(fe, f_unit);
#pragma unroll 8
    for (int64_t t = t0; t < t0 + S; ++t) pe = __dadd_rn(pe, q[t * E + e]);
    const int64_t i = b * E + e;
    f[i] = fe;
    P[i] = pe;
    term[i] = __ddiv_rn(__dmul_rn(__dmul_rn(alpha, fe), pe), Bd);
  }
}

// A tile of tokens: fs_t = sum_e f_{b,e} s_{t,e} in order e by one thread per token, then the
// score gradient by one thread per score.
__global__ void __launch_bounds__(kThreads) balance_grad_kernel(const float* __restrict__ scores, const double* __restrict__ z,
                                                                const double* __restrict__ f, int64_t T, int64_t S,
                                                                int64_t E, double c, float* __restrict__ ds) {
  __shared__ double fss[kThreads];
  const int64_t n = tile_tokens(E), t0 = int64_t(blockIdx.x) * n, nt = min(n, T - t0);
  if (threadIdx.x < nt) {
    const int64_t t = t0 + threadIdx.x;
    const float* s = scores + t * E;
    const double* fb = f + (t / S) * E;
    double fs = 0;
#pragma unroll 8
    for (int64_t e = 0; e < E; ++e) fs = __dadd_rn(fs, __dmul_rn(fb[e], double(s[e])));
    fss[threadIdx.x] = fs;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < nt * E; i += kThreads) {
    const int64_t t = t0 + i / E, e = i % E;
    const double zt = z[t], z2 = __dmul_rn(zt, zt);
    const double g = __dmul_rn(c, __dsub_rn(__ddiv_rn(f[(t / S) * E + e], zt), __ddiv_rn(fss[i / E], z2)));
    ds[t * E + e] = __double2float_rn(__dadd_rn(0.0, g));  // onto +0, as the CPU's
  }
}

// loss = the sum over b, then e, of the terms alpha * f * P / B, in that order, by one thread.
__global__ void balance_total_kernel(const double* __restrict__ term, int64_t n, double* __restrict__ loss) {
  double total = 0;
#pragma unroll 8
  for (int64_t i = 0; i < n; ++i) total = __dadd_rn(total, term[i]);
  *loss = total;
}

__global__ void sum_in_order_kernel(const float* __restrict__ x, int64_t n, double* __restrict__ out) {
  double s = 0;
#pragma unroll 8
  for (int64_t i = 0; i < n; ++i) s = __dadd_rn(s, double(x[i]));
  *out = s;
}

}  // namespace

void cuda_moe_expert_loads(const TensorView& expert_ids, const TensorView& loads, cudaStream_t stream) {
  check_dev(expert_ids, "moe_expert_loads", "expert_ids", DType::i32, 2);
  check_dev(loads, "moe_expert_loads", "loads", DType::f64, 1);
  const int64_t G = loads.size(0);
  if (G == 0) return;
  const size_t shm = sizeof(unsigned long long) * size_t(G);
  FP8MOE_CHECK(shm <= 48 * 1024, "moe_expert_loads: " << G << " experts exceed the kernel's shared memory");
  expert_loads_kernel<<<1, kThreads, shm, stream>>>(expert_ids.ptr<const int32_t>(), expert_ids.numel(), int32_t(G),
                                                    loads.ptr<double>());
  FP8MOE_CUDA_CHECK_LAUNCH("expert_loads_kernel");
}

void cuda_moe_balance_loss(const TensorView& scores, const TensorView& idx, int64_t seq_len, double alpha,
                           double grad_scale, const TensorView& loss, const TensorView& dscores, cudaStream_t stream) {
  const MoeDispatchDims dims = check_moe_balance_loss_args(Device::cuda, scores, idx, seq_len, loss, dscores);
  const int64_t T = dims.tokens, E = dims.groups, K = dims.topk, S = seq_len;
  const int64_t B = T / S;
  if (B == 0 || (!loss.defined() && !dscores.defined())) return;
  // Every sum of the CPU's loops is one thread's, in its order; the work between the sums (the
  // quotients, the gradient's terms) is spread one thread per score.
  DeviceBuffer z(sizeof(double) * size_t(T), stream), q(sizeof(double) * size_t(T * E), stream),
      f(sizeof(double) * size_t(B * E), stream), P(sizeof(double) * size_t(B * E), stream),
      term(sizeof(double) * size_t(B * E), stream);
  // The CPU's constants, computed as it computes them.
  const double f_unit = double(E) / double(K * S), c = grad_scale * alpha / double(B * S);
  const unsigned tiles = unsigned(ceil_div(T, tile_tokens(E)));
  balance_share_kernel<<<tiles, kThreads, 0, stream>>>(scores.ptr<const float>(), T, E, double(S), z.as<double>(),
                                                       q.as<double>());
  FP8MOE_CUDA_CHECK_LAUNCH("balance_share_kernel");
  const size_t picks_bytes = sizeof(int) * size_t(E);
  FP8MOE_CHECK(picks_bytes <= 48 * 1024 && B <= INT32_MAX,
               "moe_balance_loss: " << E << " experts or " << B << " sequences exceed the kernel's limits");
  balance_fp_kernel<<<unsigned(B), kThreads, picks_bytes, stream>>>(idx.ptr<const int32_t>(), q.as<double>(), B, S, E,
                                                                    K, f_unit, alpha, f.as<double>(), P.as<double>(),
                                                                    term.as<double>());
  FP8MOE_CUDA_CHECK_LAUNCH("balance_fp_kernel");
  if (dscores.defined()) {
    balance_grad_kernel<<<tiles, kThreads, 0, stream>>>(scores.ptr<const float>(), z.as<double>(), f.as<double>(), T, S,
                                                        E, c, dscores.ptr<float>());
    FP8MOE_CUDA_CHECK_LAUNCH("balance_grad_kernel");
  }
  if (!loss.defined()) return;
  balance_total_kernel<<<1, 1, 0, stream>>>(term.as<double>(), B * E, loss.ptr<double>());
  FP8MOE_CUDA_CHECK_LAUNCH("balance_total_kernel");
}

void cuda_sum_in_order(const TensorView& x, const TensorView& out, cudaStream_t stream) {
  check_f32(x, "sum_in_order", "x", -1);
  check_dev(out, "sum_in_order", "out", DType::f64, 1);
  check_shape(out, "sum_in_order: out", {1});
  sum_in_order_kernel<<<1, 1, 0, stream>>>(x.ptr<const float>(), x.numel(), out.ptr<double>());
  FP8MOE_CUDA_CHECK_LAUNCH("sum_in_order_kernel");
}

}  // namespace fp8moe::cuda
