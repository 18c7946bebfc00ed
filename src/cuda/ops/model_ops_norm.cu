// CUDA RMSNorm forward and backward (src/cpu/ops_norm.cpp is the specification), and the FP8
// recipes' forward with the 1x128 quantization of its output (backends.cpp): one block per row for
// y, rstd and dx; dw by column over row splits with a second, fixed-order pass over the
// splits, so results do not depend on scheduling. Sums run in FP64 as on the CPU, so the FP32
// results match it except where a sum sits on a rounding tie.
#include <algorithm>

#include "cuda/runtime/device_checks.hpp"
#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"
#include "cuda/quant/quantize_device.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kRowThreads = 128;

// 1 / sqrt(mean(xr^2) + eps) of a row xr [D]: the FP64 sum in a fixed order; every thread of the
// block calls it.
__device__ __forceinline__ float row_rstd(const float* __restrict__ xr, int64_t D, double eps, double* red) {
  double ss = 0;
  for (int64_t j = threadIdx.x; j < D; j += kRowThreads) ss += double(xr[j]) * double(xr[j]);
  ss = block_sum<kRowThreads>(ss, red);
  return __double2float_rn(1.0 / sqrt(ss / double(D) + eps));
}

// y [N, D] = x * rstd * w, rstd [N]; one block per row.
__global__ void __launch_bounds__(kRowThreads) rmsnorm_forward_kernel(const float* __restrict__ x,
                                                                      const float* __restrict__ w,
                                                                      float* __restrict__ y, float* __restrict__ rstd,
                                                                      int64_t D, double eps) {
  __shared__ double red[kRowThreads / 32];
  const int64_t t = blockIdx.x;
  const float* xr = x + t * D;
  const float r = row_rstd(xr, D, eps, red);
  if (threadIdx.x == 0) rstd[t] = r;
  float* yr = y + t * D;
  for (int64_t j = threadIdx.x; j < D; j += kRowThreads) yr[j] = __fmul_rn(__fmul_rn(xr[j], r), w[j]);
}

__device__ int g_rmsnorm_nonfinite;  // rmsnorm_forward_fp8: a tile's amax was NaN/Inf

// rmsnorm_forward_fp8: one block per row of the scale layout (ld_r >= R >= N rows). Rows < N: rstd
// as rmsnorm_forward_kernel (the same loop and reduction, so the same bits), then each warp takes
// 128-column tiles w, w + 4, ...: four consecutive y = (x * r) * w per lane (16-byte loads when
// kVec: D % 4 == 0, aligned), the tile's amax over the warp, its scale and codes as
// quantize_1x128's (quantize_device.cuh). Rows N..R-1: zero codes and scale 1; rows R..ld_r-1:
// scale 1 (the scale_ld padding the quantizers' fill_padding writes).
template <bool kVec>
__global__ void __launch_bounds__(kRowThreads) rmsnorm_forward_fp8_kernel(const float* __restrict__ x,
                                                                          const float* __restrict__ w,
                                                                          uint8_t* __restrict__ q,
                                                                          float* __restrict__ qs,
                                                                          float* __restrict__ rstd, int64_t N,
                                                                          int64_t R, int64_t D, int64_t ld,
                                                                          double eps, bool pow2) {
  __shared__ double red[kRowThreads / 32];
  const int64_t t = blockIdx.x, G = (D + 127) / 128;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t >= N) {
    for (int64_t g = warp; g < G; g += kRowThreads / 32) {
      const int64_t c0 = g * 128 + lane * 4;
      if (t < R) store_codes4<kVec>(q + t * D + c0, cols4(D, c0), 0);
      if (lane == 0) qs[g * ld + t] = 1.0f;
    }
    return;
  }
  const float* xr = x + t * D;
  const float r = row_rstd(xr, D, eps, red);
  if (threadIdx.x == 0) rstd[t] = r;
  for (int64_t g = warp; g < G; g += kRowThreads / 32) {
    const int64_t c0 = g * 128 + lane * 4;
    const int n = cols4(D, c0);
    float xv[4], wv[4], y[4] = {0, 0, 0, 0};
    load_cols4<kVec>(xr + c0, n, xv);
    load_cols4<kVec>(w + c0, n, wv);
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k < n) y[k] = __fmul_rn(__fmul_rn(xv[k], r), wv[k]);
      amax = amax_nan(amax, y[k]);
    }
    amax = lanes_amax<32>(amax);
    if (lane == 0 && !is_finite_amax(amax)) atomicExch(&g_rmsnorm_nonfinite, 1);
    const float sc = scale_of(amax, 448.0f, pow2);
    store_codes4<kVec>(q + t * D + c0, n, quantize4<false>(y, inv_scale(sc)));
    if (lane == 0) qs[g * ld + t] = sc;
  }
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
                          double eps, cudaStream_t stream) {
  check_f32(x, "rmsnorm_forward", "x", 2);
  const int64_t N = x.size(0), D = x.size(1);
  check_f32(w, "rmsnorm_forward", "w", 1);
  check_shape(w, "rmsnorm_forward: w", {D});
  check_f32(y, "rmsnorm_forward", "y", 2);
  check_shape(y, "rmsnorm_forward: y", {N, D});
  check_f32(rstd, "rmsnorm_forward", "rstd", 1);
  check_shape(rstd, "rmsnorm_forward: rstd", {N});
  if (N == 0) return;
  rmsnorm_forward_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(x.ptr<const float>(), w.ptr<const float>(), y.ptr<float>(),
                                                       rstd.ptr<float>(), D, eps);
  FP8MOE_CUDA_CHECK_LAUNCH("rmsnorm_forward_kernel");
}

void cuda_rmsnorm_forward_fp8(const TensorView& x, const TensorView& w, const QuantizedView& out,
                              const TensorView& rstd, double eps, ScaleMode mode, cudaStream_t stream) {
  const char* op = "rmsnorm_forward_fp8";
  check_f32(x, op, "x", 2);
  const int64_t N = x.size(0), D = x.size(1);
  check_f32(w, op, "w", 1);
  check_shape(w, "rmsnorm_forward_fp8: w", {D});
  check_f32(rstd, op, "rstd", 1);
  check_shape(rstd, "rmsnorm_forward_fp8: rstd", {N});
  check_quantized(out, "out", ScaleKind::tile_1x128);
  check_dev(out.values, op, "out", DType::e4m3, 2);
  check_dev(out.scales, op, "out", DType::f32, 2);
  check_covers_rows(out, op, "out", N, D, "x " + x.str());
  const int64_t R = out.rows(), ld = out.scales.size(1);
  if (ld == 0 || D == 0) return;
  int* flag = nullptr;
  FP8MOE_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&flag), g_rmsnorm_nonfinite));
  clear_flag(flag, stream);
  auto al = [](const void* p, int n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; };
  const bool vec = D % 4 == 0 && al(x.data, 16) && al(w.data, 16) && al(out.values.data, 4);
  const bool pow2 = mode == ScaleMode::pow2;
  auto go = [&](auto kernel) {
    kernel<<<unsigned(ld), kRowThreads, 0, stream>>>(x.ptr<const float>(), w.ptr<const float>(), out.values.ptr<uint8_t>(),
                                          out.scales.ptr<float>(), rstd.ptr<float>(), N, R, D, ld, eps, pow2);
  };
  if (vec) go(rmsnorm_forward_fp8_kernel<true>);
  else go(rmsnorm_forward_fp8_kernel<false>);
  FP8MOE_CUDA_CHECK_LAUNCH("rmsnorm_forward_fp8_kernel");
  raise_if_flag_set(flag, stream, "x", "non-finite value (NaN/Inf input is refused by the quantizers)");
}

void cuda_rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                           const TensorView& dx, const TensorView& dw, bool accumulate_dx, cudaStream_t stream) {
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
      rmsnorm_backward_dx_kernel<<<unsigned(N), kRowThreads, 0, stream>>>(x.ptr<const float>(), w.ptr<const float>(),
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
      DeviceBuffer partial(size_t(S * D) * sizeof(double), stream);
      rmsnorm_dw_partial_kernel<<<dim3(unsigned(ceil_div(D, 128)), unsigned(S)), 128, 0, stream>>>(
          x.ptr<const float>(), rstd.ptr<const float>(), dy.ptr<const float>(), partial.as<double>(), N, D, rows);
      FP8MOE_CUDA_CHECK_LAUNCH("rmsnorm_dw_partial_kernel");
      rmsnorm_dw_final_kernel<<<grid_for(D, 128), 128, 0, stream>>>(partial.as<double>(), dw.ptr<float>(), S, D);
      FP8MOE_CUDA_CHECK_LAUNCH("rmsnorm_dw_final_kernel");
    }
  }
}

}  // namespace fp8moe::cuda
