// CUDA RMSNorm forward and backward (src/cpu/ops_norm.cpp is the specification): one block per
// row for y, rstd and dx; dw by column over row splits with a second, fixed-order pass over the
// splits, so results do not depend on scheduling. Sums run in FP64 as on the CPU, so the FP32
// results match it except where a sum sits on a rounding tie.
#include <algorithm>

#include "model_ops.hpp"
#include "model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kRowThreads = 128;

// y [N, D] = x * rstd * w, rstd [N]; one block per row.
__global__ void __launch_bounds__(kRowThreads) rmsnorm_forward_kernel(const float* __restrict__ x,
                                                                      const float* __restrict__ w,
                                                                      float* __restrict__ y, float* __restrict__ rstd,
                                                                      int64_t D, double eps) {
  __shared__ double red[kRowThreads / 32];
  const int64_t t = blockIdx.x;
  const float* xr = x + t * D;
  double ss = 0;
  for (int64_t j = threadIdx.x; j < D; j += kRowThreads) ss += double(xr[j]) * double(xr[j]);
  ss = block_sum<kRowThreads>(ss, red);
  const float r = __double2float_rn(1.0 / sqrt(ss / double(D) + eps));
  if (threadIdx.x == 0) rstd[t] = r;
  float* yr = y + t * D;
  for (int64_t j = threadIdx.x; j < D; j += kRowThreads) yr[j] = __fmul_rn(__fmul_rn(xr[j], r), w[j]);
}

// dx [N, D] (+)= r * w * dy - x * r^3 / D * sum(w * dy * x); one block per row.
__global__ void __launch_bounds__(kRowThreads) rmsnorm_backward_dx_kernel(const float* __restrict__ x,
                                                                          const float* __restrict__ w,
                                                                          const float* __restrict__ rstd,
                                                                          const float* __restrict__ dy, float* dx,
                                                                          int64_t D, bool accumulate) {
  __shared__ double red[kRowThreads / 32];
  const int64_t t = blockIdx.x;
  const float* xr = x + t * D;
  const float* g = dy + t * D;
  double dot = 0;
  for (int64_t j = threadIdx.x; j < D; j += kRowThreads) dot += double(w[j]) * double(g[j]) * double(xr[j]);
  dot = block_sum<kRowThreads>(dot, red);
  const double r = rstd[t], c = dot * r * r * r / double(D);
  float* o = dx + t * D;
  for (int64_t j = threadIdx.x; j < D; j += kRowThreads) {
    const float v = __double2float_rn(__dsub_rn(__dmul_rn(__dmul_rn(r, double(w[j])), double(g[j])),
                                                __dmul_rn(double(xr[j]), c)));
    o[j] = accumulate ? __fadd_rn(o[j], v) : v;
  }
}

// partial [S, D] f64: partial[s, j] = sum over rows of split s of dy * x * rstd.
// Grid (ceil(D / 128), S), 128 threads.
__global__ void __launch_bounds__(128) rmsnorm_dw_partial_kernel(const float* __restrict__ x,
                                                                 const float* __restrict__ rstd,
                                                                 const float* __restrict__ dy,
                                                                 double* __restrict__ partial, int64_t N, int64_t D,
                                                                 int64_t rows_per_split) {
  const int64_t j = int64_t(blockIdx.x) * 128 + threadIdx.x;
  if (j >= D) return;
  const int64_t t0 = int64_t(blockIdx.y) * rows_per_split, t1 = min(N, t0 + rows_per_split);
  double acc = 0;
  for (int64_t t = t0; t < t1; ++t) acc += double(dy[t * D + j]) * double(x[t * D + j]) * double(rstd[t]);
  partial[int64_t(blockIdx.y) * D + j] = acc;
}

// dw [D] += sum over s of partial [S, D], in split order.
__global__ void rmsnorm_dw_final_kernel(const double* __restrict__ partial, float* dw, int64_t S, int64_t D) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= D) return;
  double acc = 0;
  for (int64_t s = 0; s < S; ++s) acc += partial[s * D + j];
  dw[j] = __fadd_rn(dw[j], __double2float_rn(acc));
}

}  // namespace

void cuda_rmsnorm_forward(const TensorView& x, const TensorView& w, const TensorView& y, const TensorView& rstd,
                          double eps) {
  check_f32(x, "rmsnorm_forward", "x", 2);
  const int64_t N = x.size(0), D = x.size(1);
  check_f32(w, "rmsnorm_forward", "w", 1);
  check_shape(w, "rmsnorm_forward: w", {D});
  check_f32(y, "rmsnorm_forward", "y", 2);
  check_shape(y, "rmsnorm_forward: y", {N, D});
  check_f32(rstd, "rmsnorm_forward", "rstd", 1);
  check_shape(rstd, "rmsnorm_forward: rstd", {N});
  if (N == 0) return;
  rmsnorm_forward_kernel<<<unsigned(N), kRowThreads>>>(x.ptr<const float>(), w.ptr<const float>(), y.ptr<float>(),
                                                       rstd.ptr<float>(), D, eps);
  FP8MOE_CUDA_CHECK_LAUNCH("rmsnorm_forward_kernel");
}

void cuda_rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                           const TensorView& dx, const TensorView& dw, bool accumulate_dx) {
  check_f32(x, "rmsnorm_backward", "x", 2);
  const int64_t N = x.size(0), D = x.size(1);
  check_f32(w, "rmsnorm_backward", "w", 1);
  check_shape(w, "rmsnorm_backward: w", {D});
  check_f32(rstd, "rmsnorm_backward", "rstd", 1);
  check_shape(rstd, "rmsnorm_backward: rstd", {N});
  check_f32(dy, "rmsnorm_backward", "dy", 2);
  check_shape(dy, "rmsnorm_backward: dy", {N, D});
  if (dx.defined()) {
    check_f32(dx, "rmsnorm_backward", "dx", 2);
    check_shape(dx, "rmsnorm_backward: dx", {N, D});
    if (N > 0) {
      rmsnorm_backward_dx_kernel<<<unsigned(N), kRowThreads>>>(x.ptr<const float>(), w.ptr<const float>(),
                                                               rstd.ptr<const float>(), dy.ptr<const float>(),
                                                               dx.ptr<float>(), D, accumulate_dx);
      FP8MOE_CUDA_CHECK_LAUNCH("rmsnorm_backward_dx_kernel");
    }
  }
  if (dw.defined()) {
    check_f32(dw, "rmsnorm_backward", "dw", 1);
    check_shape(dw, "rmsnorm_backward: dw", {D});
    if (N > 0 && D > 0) {
      // NOTES: enough splits to fill the GPU for small D, each long enough to amortize its load.
      const int64_t splits = std::clamp<int64_t>(ceil_div(N, 64), 1, std::max<int64_t>(1, 1024 / ceil_div(D, 128)));
      const int64_t rows = ceil_div(N, splits), S = ceil_div(N, rows);
      DeviceBuffer partial(size_t(S * D) * sizeof(double));
      rmsnorm_dw_partial_kernel<<<dim3(unsigned(ceil_div(D, 128)), unsigned(S)), 128>>>(
          x.ptr<const float>(), rstd.ptr<const float>(), dy.ptr<const float>(), partial.as<double>(), N, D, rows);
      FP8MOE_CUDA_CHECK_LAUNCH("rmsnorm_dw_partial_kernel");
      rmsnorm_dw_final_kernel<<<grid_for(D, 128), 128>>>(partial.as<double>(), dw.ptr<float>(), S, D);
      FP8MOE_CUDA_CHECK_LAUNCH("rmsnorm_dw_final_kernel");
    }
  }
}

}  // namespace fp8moe::cuda
