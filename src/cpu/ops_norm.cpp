// CPU RMSNorm forward and backward. The backward is split so the model can run the input
// gradient (backward-for-input) and the weight gradient (backward-for-weights) separately.
#include <cmath>
#include <vector>

#include <omp.h>

#include "cpu_ops.hpp"

namespace fp8moe::cpu {

void rmsnorm_forward(const TensorView& x, const TensorView& w, const TensorView& y, const TensorView& rstd,
                     double eps) {
  dispatch_float(x, "rmsnorm_forward", "x", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(x, "rmsnorm_forward", "x", x.dtype, 2);
    const int64_t N = x.size(0), D = x.size(1);
    check_op_tensor(w, "rmsnorm_forward", "w", x.dtype, 1);
    check_shape(w, "rmsnorm_forward: w", {D});
    check_op_tensor(y, "rmsnorm_forward", "y", x.dtype, 2);
    check_shape(y, "rmsnorm_forward: y", {N, D});
    check_op_tensor(rstd, "rmsnorm_forward", "rstd", x.dtype, 1);
    check_shape(rstd, "rmsnorm_forward: rstd", {N});
#pragma omp parallel for schedule(static) if (N * D > kParallelWork)
    for (int64_t t = 0; t < N; ++t) {
      const T* xr = x.ptr<const T>() + t * D;
      double ss = 0;
      for (int64_t j = 0; j < D; ++j) ss += double(xr[j]) * double(xr[j]);
      const T r = T(1.0 / std::sqrt(ss / double(D) + eps));
      rstd.ptr<T>()[t] = r;
      T* yr = y.ptr<T>() + t * D;
      for (int64_t j = 0; j < D; ++j) yr[j] = xr[j] * r * w.ptr<const T>()[j];
    }
  });
}

void rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                      const TensorView& dx, const TensorView& dw, bool accumulate_dx) {
  dispatch_float(x, "rmsnorm_backward", "x", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(x, "rmsnorm_backward", "x", x.dtype, 2);
    const int64_t N = x.size(0), D = x.size(1);
    check_op_tensor(w, "rmsnorm_backward", "w", x.dtype, 1);
    check_op_tensor(rstd, "rmsnorm_backward", "rstd", x.dtype, 1);
    check_op_tensor(dy, "rmsnorm_backward", "dy", x.dtype, 2);
    check_shape(dy, "rmsnorm_backward: dy", {N, D});
    const T* X = x.ptr<const T>();
    const T* W = w.ptr<const T>();
    const T* R = rstd.ptr<const T>();
    const T* DY = dy.ptr<const T>();
    if (dx.defined()) {
      check_op_tensor(dx, "rmsnorm_backward", "dx", x.dtype, 2);
      check_shape(dx, "rmsnorm_backward: dx", {N, D});
      // dx = r * w * dy - x * r^3 / D * sum(w * dy * x)
#pragma omp parallel for schedule(static) if (N * D > kParallelWork)
      for (int64_t t = 0; t < N; ++t) {
        const T* xr = X + t * D;
        const T* g = DY + t * D;
        double dot = 0;
        for (int64_t j = 0; j < D; ++j) dot += double(W[j]) * double(g[j]) * double(xr[j]);
        const double r = R[t], c = dot * r * r * r / double(D);
        T* o = dx.ptr<T>() + t * D;
        for (int64_t j = 0; j < D; ++j) {
          const T v = T(r * double(W[j]) * double(g[j]) - double(xr[j]) * c);
          o[j] = accumulate_dx ? T(o[j] + v) : v;
        }
      }
    }
    if (dw.defined()) {
      check_op_tensor(dw, "rmsnorm_backward", "dw", x.dtype, 1);
      check_shape(dw, "rmsnorm_backward: dw", {D});
      // Parallel over columns: each thread owns its slice of dw.
#pragma omp parallel for schedule(static) if (N * D > kParallelWork)
      for (int64_t j = 0; j < D; ++j) {
        double acc = 0;
        for (int64_t t = 0; t < N; ++t) acc += double(DY[t * D + j]) * double(X[t * D + j]) * double(R[t]);
        dw.ptr<T>()[j] += T(acc);
      }
    }
  });
}

}  // namespace fp8moe::cpu
