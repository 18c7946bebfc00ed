// The step statistics of the CUDA backend (contracts: include/fp8moe/backend.hpp, "Step
// statistics"; specification: src/cpu/ops_step_stats.cpp): expert loads, the sequence-wise
// balance loss and its score gradient, a loss sum, computed where the step runs so that it reads
// them back once at its end. The FP64 sums are bit-identical to the CPU's: each one is a single
// thread's loop in the CPU's index order, with the products, quotients and sums rounded one by
// one (__dmul_rn, __ddiv_rn, __dadd_rn: nvcc contracts nothing into FMAs). They are small (a
// sequence's tokens, the experts), so that a thread per sum costs microseconds.
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
  for (int64_t e = 0; e < E; ++e) z = __dadd_rn(z, double(s[e]));
  return z;
}

// One block per sequence b: z [T] for its tokens, then f, P [B, E] with one thread per expert,
// then (with ds) the score gradient with one thread per token.
__global__ void __launch_bounds__(kThreads) balance_kernel(const float* __restrict__ scores, const int32_t* __restrict__ idx,
                                                           int64_t S, int64_t E, int64_t K, double f_unit, double c,
                                                           double* __restrict__ z, double* __restrict__ f,
                                                           double* __restrict__ P, float* __restrict__ ds) {
  const int64_t b = blockIdx.x, t0 = b * S;
  for (int64_t t = t0 + threadIdx.x; t < t0 + S; t += kThreads) z[t] = score_sum(scores + t * E, E);
  __syncthreads();
  const double Sd = double(S);
  for (int64_t e = threadIdx.x; e < E; e += kThreads) {
    double fe = 0, pe = 0;
    for (int64_t t = t0; t < t0 + S; ++t) {
      for (int64_t j = 0; j < K; ++j)
        if (idx[t * K + j] == e) fe = __dadd_rn(fe, f_unit);
      pe = __dadd_rn(pe, __ddiv_rn(__ddiv_rn(double(scores[t * E + e]), z[t]), Sd));
    }
    f[b * E + e] = fe;
    P[b * E + e] = pe;
  }
  if (!ds) return;
  __syncthreads();
  const double* fb = f + b * E;
  for (int64_t t = t0 + threadIdx.x; t < t0 + S; t += kThreads) {
    const float* s = scores + t * E;
    const double zt = z[t];
    double fs = 0;
    for (int64_t e = 0; e < E; ++e) fs = __dadd_rn(fs, __dmul_rn(fb[e], double(s[e])));
    const double z2 = __dmul_rn(zt, zt);
    for (int64_t e = 0; e < E; ++e) {
      const double g = __dmul_rn(c, __dsub_rn(__ddiv_rn(fb[e], zt), __ddiv_rn(fs, z2)));
      ds[t * E + e] = __double2float_rn(__dadd_rn(0.0, g));  // onto +0, as the CPU's
    }
  }
}

// loss = sum over b, then e, of alpha * f * P / B, in that order, by one thread.
__global__ void balance_total_kernel(const double* __restrict__ f, const double* __restrict__ P, int64_t B, int64_t E,
                                     double alpha, double* __restrict__ loss) {
  double total = 0;
  const double Bd = double(B);
  for (int64_t i = 0; i < B * E; ++i) total = __dadd_rn(total, __ddiv_rn(__dmul_rn(__dmul_rn(alpha, f[i]), P[i]), Bd));
  *loss = total;
}

__global__ void sum_in_order_kernel(const float* __restrict__ x, int64_t n, double* __restrict__ out) {
  double s = 0;
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
  DeviceBuffer z(sizeof(double) * size_t(T), stream), f(sizeof(double) * size_t(B * E), stream),
      P(sizeof(double) * size_t(B * E), stream);
  // The CPU's constants, computed as it computes them.
  const double f_unit = double(E) / double(K * S), c = grad_scale * alpha / double(B * S);
  balance_kernel<<<unsigned(B), kThreads, 0, stream>>>(scores.ptr<const float>(), idx.ptr<const int32_t>(), S, E, K,
                                                       f_unit, c, z.as<double>(), f.as<double>(), P.as<double>(),
                                                       dscores.defined() ? dscores.ptr<float>() : nullptr);
  FP8MOE_CUDA_CHECK_LAUNCH("balance_kernel");
  if (!loss.defined()) return;
  balance_total_kernel<<<1, 1, 0, stream>>>(f.as<double>(), P.as<double>(), B, E, alpha, loss.ptr<double>());
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
