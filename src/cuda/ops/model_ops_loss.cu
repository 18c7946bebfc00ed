// CUDA fused softmax cross-entropy of the output head (src/cpu/ops_embed_loss.cpp is the
// specification): one block per token computes the row max, the FP64 sum of exponentials, the
// loss and, when asked, the logits gradient in the same launch.
#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kThreads = 256;

// logits [N, V] f32 -> losses [N] f32, dlogits [N, V] f32 (null: skipped); targets [N] i32 (< 0:
// ignored row). One block per row.
__global__ void __launch_bounds__(kThreads) cross_entropy_kernel(const float* __restrict__ logits,
                                                                 const int32_t* __restrict__ targets,
                                                                 float* __restrict__ losses, float* dlogits,
                                                                 int64_t V, double grad_scale) {
  __shared__ double red_d[kThreads / 32];
  __shared__ float red_f[kThreads / 32];
  const int64_t t = blockIdx.x;
  const int32_t tg = targets[t];
  const float* x = logits + t * V;
  float* g = dlogits ? dlogits + t * V : nullptr;
  if (tg < 0 || tg >= V) {  // ignored row; a target >= V (a deferred range check reports it): NaN loss
    if (threadIdx.x == 0) losses[t] = tg < 0 ? 0.0f : NAN;
    if (g)
      for (int64_t v = threadIdx.x; v < V; v += kThreads) g[v] = 0.0f;
    return;
  }
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) mx = fmaxf(mx, x[v]);
  mx = block_max<kThreads>(mx, red_f);
  double sum = 0;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) sum += exp(double(__fsub_rn(x[v], mx)));
  sum = block_sum<kThreads>(sum, red_d);
  const double lse = double(mx) + log(sum);
  if (threadIdx.x == 0) losses[t] = __double2float_rn(lse - double(x[tg]));
  if (g) {
    const float gs = __double2float_rn(grad_scale);
    for (int64_t v = threadIdx.x; v < V; v += kThreads) {
      float gv = __double2float_rn(grad_scale * exp(double(x[v]) - lse));
      if (v == tg) gv = __fsub_rn(gv, gs);
      g[v] = gv;
    }
  }
}

}  // namespace

void cuda_cross_entropy(const TensorView& logits, const TensorView& targets, const TensorView& losses,
                        const TensorView& dlogits, double grad_scale, cudaStream_t stream) {
  check_dev(targets, "cross_entropy", "targets", DType::i32, 1);
  check_f32(logits, "cross_entropy", "logits", 2);
  const int64_t N = logits.size(0), V = logits.size(1);
  check_shape(targets, "cross_entropy: targets", {N});
  check_f32(losses, "cross_entropy", "losses", 1);
  check_shape(losses, "cross_entropy: losses", {N});
  const bool grad = dlogits.defined();
  if (grad) {
    check_f32(dlogits, "cross_entropy", "dlogits", 2);
    check_shape(dlogits, "cross_entropy: dlogits", {N, V});
  }
  int32_t bad = 0;
  const int64_t t = first_out_of_range(targets.ptr<const int32_t>(), N, INT32_MIN, V, &bad, "cross_entropy: targets", stream);
  FP8MOE_CHECK(t < 0, "cross_entropy: targets[" << t << "] = " << bad << " >= vocab " << V);
  if (N == 0) return;
  cross_entropy_kernel<<<unsigned(N), kThreads, 0, stream>>>(logits.ptr<const float>(), targets.ptr<const int32_t>(),
                                                  losses.ptr<float>(), grad ? dlogits.ptr<float>() : nullptr, V,
                                                  grad_scale);
  FP8MOE_CUDA_CHECK_LAUNCH("cross_entropy_kernel");
}

}  // namespace fp8moe::cuda
