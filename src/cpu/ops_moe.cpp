// CPU DeepSeekMoE routing and the row movement of expert dispatch/combine:
//   moe_route           sigmoid affinities, group-limited top-k on affinity + balancing bias (the
//                       bias only steers selection; weights use the raw affinities), normalized.
//   moe_route_backward  gradient of the weights (and of a direct score loss) w.r.t. the logits.
//   gather_rows / scatter_add_rows / scatter_rows / rows_dot: dispatch, weighted combine and the combine
//                       weights' gradient.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu_ops.hpp"

namespace fp8moe::cpu {

void moe_route(const TensorView& logits, const TensorView& bias, const TensorView& scores, const TensorView& idx,
               const TensorView& weights, int64_t n_group, int64_t topk_group, bool norm, double scaling) {
  dispatch_float(logits, "moe_route", "logits", [&](auto tag) {
    using T = decltype(tag);
    const DType dt = logits.dtype;
    check_op_tensor(logits, "moe_route", "logits", dt, 2);
    const int64_t N = logits.size(0), E = logits.size(1);
    check_op_tensor(bias, "moe_route", "bias", dt, 1);
    check_shape(bias, "moe_route: bias", {E});
    check_op_tensor(scores, "moe_route", "scores", dt, 2);
    check_shape(scores, "moe_route: scores", {N, E});
    check_op_tensor(idx, "moe_route", "idx", DType::i32, 2);
    const int64_t Kt = idx.size(1);
    check_op_tensor(weights, "moe_route", "weights", dt, 2);
    check_shape(weights, "moe_route: weights", {N, Kt});
    FP8MOE_CHECK(n_group > 0 && E % n_group == 0, "moe_route: n_group = " << n_group << " must divide E = " << E);
    FP8MOE_CHECK(topk_group > 0 && topk_group <= n_group,
                 "moe_route: topk_group = " << topk_group << " must be in [1, n_group = " << n_group << "]");
    const int64_t Gs = E / n_group;
    FP8MOE_CHECK(Kt > 0 && Kt <= topk_group * Gs, "moe_route: top-k = " << Kt << " exceeds the "
                                                      << topk_group * Gs << " experts of topk_group groups");
    const T* B = bias.ptr<const T>();
#pragma omp parallel if (N * E > kParallelWork / 8)
    {
      std::vector<double> choice(static_cast<size_t>(E)), gscore(static_cast<size_t>(n_group));
      std::vector<int64_t> order(size_t(std::max(E, n_group)));
      std::vector<char> allowed(static_cast<size_t>(E));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < N; ++t) {
        const T* x = logits.ptr<const T>() + t * E;
        T* s = scores.ptr<T>() + t * E;
        for (int64_t e = 0; e < E; ++e) {
          s[e] = T(1) / (T(1) + std::exp(-x[e]));
          choice[size_t(e)] = double(s[e]) + double(B[e]);
        }
        // Group score: sum of the group's two best choices (DeepSeek-V3), or its best if size 1.
        for (int64_t g = 0; g < n_group; ++g) {
          double b1 = -INFINITY, b2 = -INFINITY;
          for (int64_t e = g * Gs; e < (g + 1) * Gs; ++e) {
            const double c = choice[size_t(e)];
            if (c > b1) {
              b2 = b1;
              b1 = c;
            } else if (c > b2) {
              b2 = c;
            }
          }
          gscore[size_t(g)] = Gs >= 2 ? b1 + b2 : b1;
        }
        std::iota(order.begin(), order.begin() + n_group, 0);
        std::stable_sort(order.begin(), order.begin() + n_group,
                         [&](int64_t a, int64_t b) { return gscore[size_t(a)] > gscore[size_t(b)]; });
        std::fill(allowed.begin(), allowed.end(), 0);
        for (int64_t r = 0; r < topk_group; ++r)
          for (int64_t e = order[size_t(r)] * Gs; e < (order[size_t(r)] + 1) * Gs; ++e) allowed[size_t(e)] = 1;
        std::iota(order.begin(), order.begin() + E, 0);
        std::stable_sort(order.begin(), order.begin() + E, [&](int64_t a, int64_t b) {
          if (allowed[size_t(a)] != allowed[size_t(b)]) return allowed[size_t(a)] > allowed[size_t(b)];
          return choice[size_t(a)] > choice[size_t(b)];
        });
        double sum = 0;
        for (int64_t j = 0; j < Kt; ++j) sum += double(s[order[size_t(j)]]);
        const double denom = norm ? sum + 1e-20 : 1.0;
        for (int64_t j = 0; j < Kt; ++j) {
          const int64_t e = order[size_t(j)];
          idx.ptr<int32_t>()[t * Kt + j] = int32_t(e);
          weights.ptr<T>()[t * Kt + j] = T(double(s[e]) / denom * scaling);
        }
      }
    }
  });
}

void moe_route_backward(const TensorView& scores, const TensorView& idx, const TensorView& dweights,
                        const TensorView& dscores, const TensorView& dlogits, bool norm, double scaling) {
  dispatch_float(scores, "moe_route_backward", "scores", [&](auto tag) {
    using T = decltype(tag);
    const DType dt = scores.dtype;
    check_op_tensor(scores, "moe_route_backward", "scores", dt, 2);
    const int64_t N = scores.size(0), E = scores.size(1);
    check_op_tensor(idx, "moe_route_backward", "idx", DType::i32, 2);
    const int64_t Kt = idx.size(1);
    check_op_tensor(dweights, "moe_route_backward", "dweights", dt, 2);
    check_shape(dweights, "moe_route_backward: dweights", {N, Kt});
    check_op_tensor(dlogits, "moe_route_backward", "dlogits", dt, 2);
    check_shape(dlogits, "moe_route_backward: dlogits", {N, E});
    if (dscores.defined()) {
      check_op_tensor(dscores, "moe_route_backward", "dscores", dt, 2);
      check_shape(dscores, "moe_route_backward: dscores", {N, E});
    }
#pragma omp parallel for schedule(static) if (N * E > kParallelWork)
    for (int64_t t = 0; t < N; ++t) {
      const T* s = scores.ptr<const T>() + t * E;
      const int32_t* id = idx.ptr<const int32_t>() + t * Kt;
      const T* dw = dweights.ptr<const T>() + t * Kt;
      T* dl = dlogits.ptr<T>() + t * E;
      for (int64_t e = 0; e < E; ++e) dl[e] = dscores.defined() ? dscores.ptr<const T>()[t * E + e] : T(0);
      // w_j = c * s_j / S, S = sum of the selected scores: dL/ds_m = c * (dw_m - sum_j dw_j w_j / c) / S.
      double S = 0, dot = 0;
      for (int64_t j = 0; j < Kt; ++j) {
        S += double(s[id[j]]);
        dot += double(dw[j]) * double(s[id[j]]);
      }
      for (int64_t j = 0; j < Kt; ++j) {
        const double g = norm ? scaling * (double(dw[j]) / (S + 1e-20) - dot / ((S + 1e-20) * (S + 1e-20)))
                              : scaling * double(dw[j]);
        dl[id[j]] += T(g);
      }
      for (int64_t e = 0; e < E; ++e) dl[e] = T(double(dl[e]) * double(s[e]) * (1.0 - double(s[e])));
    }
  });
}

void gather_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst) {
  check_op_tensor(idx, "gather_rows", "idx", DType::i32, 1);
  FP8MOE_CHECK(src.dtype == dst.dtype && src.ndim == 2 && dst.ndim == 2 && src.size(1) == dst.size(1),
               "gather_rows: src " << src.str() << " and dst " << dst.str() << " must be [*, D] of one dtype");
  FP8MOE_CHECK(dst.size(0) >= idx.size(0), "gather_rows: dst " << dst.str() << " has fewer rows than idx "
                                                               << idx.str());
  const int64_t N = idx.size(0), Rs = src.size(0);
  const size_t row = size_t(src.size(1)) * dtype_size(src.dtype);
  const int32_t* id = idx.ptr<const int32_t>();
  for (int64_t i = 0; i < N; ++i)
    FP8MOE_CHECK(id[i] >= 0 && id[i] < Rs, "gather_rows: idx[" << i << "] = " << id[i] << " outside [0, " << Rs << ")");
  if (!w.defined()) {
#pragma omp parallel for schedule(static) if (int64_t(row) * N > 4 * kParallelWork)
    for (int64_t i = 0; i < N; ++i)
      std::copy_n(static_cast<const char*>(src.data) + size_t(id[i]) * row, row,
                  static_cast<char*>(dst.data) + size_t(i) * row);
    return;
  }
  dispatch_float(dst, "gather_rows", "dst", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(w, "gather_rows", "w", dst.dtype, 1);
    check_shape(w, "gather_rows: w", {N});
    const int64_t D = dst.size(1);
#pragma omp parallel for schedule(static) if (N * D > kParallelWork)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < D; ++j) dst.ptr<T>()[i * D + j] = w.ptr<const T>()[i] * src.ptr<const T>()[id[i] * D + j];
  });
}

void scatter_add_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst) {
  check_op_tensor(idx, "scatter_add_rows", "idx", DType::i32, 1);
  dispatch_float(dst, "scatter_add_rows", "dst", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(src, "scatter_add_rows", "src", dst.dtype, 2);
    check_op_tensor(dst, "scatter_add_rows", "dst", dst.dtype, 2);
    const int64_t N = idx.size(0), D = dst.size(1), R = dst.size(0);
    FP8MOE_CHECK(src.size(1) == D && src.size(0) >= N, "scatter_add_rows: src " << src.str() << " must be [>= "
                                                                                << N << ", " << D << "]");
    if (w.defined()) {
      check_op_tensor(w, "scatter_add_rows", "w", dst.dtype, 1);
      check_shape(w, "scatter_add_rows: w", {N});
    }
    const int32_t* id = idx.ptr<const int32_t>();
    for (int64_t i = 0; i < N; ++i)
      FP8MOE_CHECK(id[i] >= 0 && id[i] < R, "scatter_add_rows: idx[" << i << "] = " << id[i] << " outside [0, "
                                                                     << R << ")");
    // Parallel over columns: several i may target one row.
#pragma omp parallel for schedule(static) if (N * D > kParallelWork)
    for (int64_t j = 0; j < D; ++j)
      for (int64_t i = 0; i < N; ++i) {
        const T wi = w.defined() ? w.ptr<const T>()[i] : T(1);
        dst.ptr<T>()[id[i] * D + j] += wi * src.ptr<const T>()[i * D + j];
      }
  });
}

void scatter_rows(const TensorView& src, const TensorView& idx, const TensorView& dst) {
  check_op_tensor(idx, "scatter_rows", "idx", DType::i32, 1);
  FP8MOE_CHECK(src.dtype == dst.dtype && src.ndim == 2 && dst.ndim == 2 && src.size(1) == dst.size(1) &&
                   src.size(0) >= idx.size(0) && src.is_contiguous() && dst.is_contiguous(),
               "scatter_rows: src " << src.str() << " and dst " << dst.str() << " must be contiguous [*, C] of one "
                                                                                "dtype, src of >= "
                                    << idx.size(0) << " rows");
  const int64_t N = idx.size(0), R = dst.size(0);
  const size_t row = size_t(src.size(1)) * dtype_size(src.dtype);
  const int32_t* id = idx.ptr<const int32_t>();
  for (int64_t i = 0; i < N; ++i)
    FP8MOE_CHECK(id[i] >= 0 && id[i] < R, "scatter_rows: idx[" << i << "] = " << id[i] << " outside [0, " << R << ")");
  for (int64_t i = 0; i < N; ++i)
    std::copy_n(static_cast<const char*>(src.data) + size_t(i) * row, row, static_cast<char*>(dst.data) + size_t(id[i]) * row);
}

void rows_dot(const TensorView& a, const TensorView& b, const TensorView& out) {
  dispatch_float(out, "rows_dot", "out", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(a, "rows_dot", "a", out.dtype, 2);
    check_op_tensor(b, "rows_dot", "b", out.dtype, 2);
    check_op_tensor(out, "rows_dot", "out", out.dtype, 1);
    const int64_t N = out.size(0), D = a.size(1);
    FP8MOE_CHECK(b.size(1) == D && a.size(0) >= N && b.size(0) >= N,
                 "rows_dot: a " << a.str() << ", b " << b.str() << " must both be [>= " << N << ", D]");
#pragma omp parallel for schedule(static) if (N * D > kParallelWork)
    for (int64_t i = 0; i < N; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < D; ++j) acc += double(a.ptr<const T>()[i * D + j]) * double(b.ptr<const T>()[i * D + j]);
      out.ptr<T>()[i] = T(acc);
    }
  });
}

}  // namespace fp8moe::cpu
