// CPU token embedding (forward gather, backward scatter-add) and the fused softmax cross-entropy
// of the output head (loss per token and the logits gradient in one pass, as llm.c fuses them).
#include <cmath>
#include <vector>

#include "cpu_ops.hpp"

namespace fp8moe::cpu {

void embedding_forward(const TensorView& ids, const TensorView& table, const TensorView& out) {
  check_op_tensor(ids, "embedding_forward", "ids", DType::i32, 1);
  dispatch_float(table, "embedding_forward", "table", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(table, "embedding_forward", "table", table.dtype, 2);
    check_op_tensor(out, "embedding_forward", "out", table.dtype, 2);
    const int64_t N = ids.size(0), V = table.size(0), D = table.size(1);
    check_shape(out, "embedding_forward: out", {N, D});
    const int32_t* id = ids.ptr<const int32_t>();
    for (int64_t t = 0; t < N; ++t)
      FP8MOE_CHECK(id[t] >= 0 && id[t] < V, "embedding_forward: ids[" << t << "] = " << id[t]
                                                                      << " outside [0, " << V << ")");
#pragma omp parallel for schedule(static) if (N * D > kParallelWork)
    for (int64_t t = 0; t < N; ++t)
      for (int64_t j = 0; j < D; ++j) out.ptr<T>()[t * D + j] = table.ptr<const T>()[id[t] * D + j];
  });
}

void embedding_backward(const TensorView& ids, const TensorView& dout, const TensorView& dtable) {
  check_op_tensor(ids, "embedding_backward", "ids", DType::i32, 1);
  dispatch_float(dtable, "embedding_backward", "dtable", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(dout, "embedding_backward", "dout", dtable.dtype, 2);
    const int64_t N = ids.size(0), D = dtable.size(1);
    check_shape(dout, "embedding_backward: dout", {N, D});
    const int32_t* id = ids.ptr<const int32_t>();
    // Parallel over columns: rows of the same token never race.
#pragma omp parallel for schedule(static) if (N * D > kParallelWork)
    for (int64_t j = 0; j < D; ++j)
      for (int64_t t = 0; t < N; ++t) dtable.ptr<T>()[id[t] * D + j] += dout.ptr<const T>()[t * D + j];
  });
}

void cross_entropy(const TensorView& logits, const TensorView& targets, const TensorView& losses,
                   const TensorView& dlogits, double grad_scale) {
  check_op_tensor(targets, "cross_entropy", "targets", DType::i32, 1);
  dispatch_float(logits, "cross_entropy", "logits", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(logits, "cross_entropy", "logits", logits.dtype, 2);
    const int64_t N = logits.size(0), V = logits.size(1);
    check_shape(targets, "cross_entropy: targets", {N});
    check_op_tensor(losses, "cross_entropy", "losses", logits.dtype, 1);
    check_shape(losses, "cross_entropy: losses", {N});
    const bool grad = dlogits.defined();
    if (grad) {
      check_op_tensor(dlogits, "cross_entropy", "dlogits", logits.dtype, 2);
      check_shape(dlogits, "cross_entropy: dlogits", {N, V});
    }
    const int32_t* tg = targets.ptr<const int32_t>();
    for (int64_t t = 0; t < N; ++t)
      FP8MOE_CHECK(tg[t] < V, "cross_entropy: targets[" << t << "] = " << tg[t] << " >= vocab " << V);
#pragma omp parallel for schedule(static) if (N * V > kParallelWork)
    for (int64_t t = 0; t < N; ++t) {
      const T* x = logits.ptr<const T>() + t * V;
      T* g = grad ? dlogits.ptr<T>() + t * V : nullptr;
      if (tg[t] < 0) {
        losses.ptr<T>()[t] = 0;
        if (g)
          for (int64_t v = 0; v < V; ++v) g[v] = 0;
        continue;
      }
      T mx = x[0];
      for (int64_t v = 1; v < V; ++v) mx = std::max(mx, x[v]);
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(double(x[v] - mx));
      const double lse = double(mx) + std::log(sum);
      losses.ptr<T>()[t] = T(lse - double(x[tg[t]]));
      if (g) {
        for (int64_t v = 0; v < V; ++v) g[v] = T(grad_scale * std::exp(double(x[v]) - lse));
        g[tg[t]] -= T(grad_scale);
      }
    }
  });
}

}  // namespace fp8moe::cpu
