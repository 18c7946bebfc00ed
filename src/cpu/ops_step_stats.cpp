// The statistics of a training step kept on the device until the step's end (contracts:
// include/fp8moe/backend.hpp, "Step statistics"): expert loads, the sequence-wise balance loss and
// its score gradient, a loss sum. Every sum runs in FP64 in index order, so that these ops give
// the bits the model computed on the host before they moved here, and the CUDA ops reproduce them
// (one thread per sum, no contraction into FMAs).
#include <vector>

#include "cpu_ops.hpp"
#include "fp8moe/moe_dispatch_args.hpp"

namespace fp8moe::cpu {

namespace {

double load_as_double(const TensorView& t, int64_t i) {
  return t.dtype == DType::f64 ? t.ptr<const double>()[i] : double(t.ptr<const float>()[i]);
}

}  // namespace

void moe_expert_loads(const TensorView& expert_ids, const TensorView& loads) {
  check_op_tensor(expert_ids, "moe_expert_loads", "expert_ids", DType::i32, 2);
  check_op_tensor(loads, "moe_expert_loads", "loads", DType::f64, 1);
  const int64_t G = loads.size(0);
  std::vector<int64_t> n(size_t(G), 0);
  const int32_t* id = expert_ids.ptr<const int32_t>();
  for (int64_t i = 0; i < expert_ids.numel(); ++i)
    if (id[i] >= 0 && id[i] < G) ++n[size_t(id[i])];
  for (int64_t g = 0; g < G; ++g) loads.ptr<double>()[g] = double(n[size_t(g)]);
}

void moe_balance_loss(const TensorView& scores, const TensorView& idx, int64_t seq_len, double alpha,
                      double grad_scale, const TensorView& loss, const TensorView& dscores) {
  dispatch_float(scores, "moe_balance_loss", "scores", [&](auto tag) {
    using T = decltype(tag);
    const MoeDispatchDims dims = check_moe_balance_loss_args(Device::cpu, scores, idx, seq_len, loss, dscores);
    const int64_t T_ = dims.tokens, E = dims.groups, K = dims.topk, S = seq_len;
    const int32_t* id = idx.ptr<const int32_t>();
    const int64_t B = T_ / S;
    for (int64_t t = 0; t < T_ * K; ++t)
      FP8MOE_CHECK(id[t] >= 0 && id[t] < E, "moe_balance_loss: idx[" << t << "] = " << id[t] << " outside [0, " << E << ")");
    const auto sc = [&](int64_t t, int64_t e) { return load_as_double(scores, t * E + e); };
    double total = 0;
    for (int64_t bi = 0; bi < B; ++bi) {
      std::vector<double> f(size_t(E), 0.0), P(size_t(E), 0.0);
      for (int64_t t = bi * S; t < (bi + 1) * S; ++t) {
        for (int64_t j = 0; j < K; ++j) f[size_t(id[t * K + j])] += double(E) / double(K * S);
        double z = 0;
        for (int64_t e = 0; e < E; ++e) z += sc(t, e);
        for (int64_t e = 0; e < E; ++e) P[size_t(e)] += sc(t, e) / z / double(S);
      }
      for (int64_t e = 0; e < E; ++e) total += alpha * f[size_t(e)] * P[size_t(e)] / double(B);
      if (!dscores.defined()) continue;
      const double c = grad_scale * alpha / double(B * S);
      for (int64_t t = bi * S; t < (bi + 1) * S; ++t) {
        double z = 0, fs = 0;
        for (int64_t e = 0; e < E; ++e) {
          z += sc(t, e);
          fs += f[size_t(e)] * sc(t, e);
        }
        for (int64_t e = 0; e < E; ++e) {
          double d = 0;  // onto +0, as the host's zero-filled gradient was
          d += c * (f[size_t(e)] / z - fs / (z * z));
          dscores.ptr<T>()[t * E + e] = T(d);
        }
      }
    }
    if (loss.defined()) loss.ptr<double>()[0] = total;
  });
}

void sum_in_order(const TensorView& x, const TensorView& out) {
  dispatch_float(x, "sum_in_order", "x", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(x, "sum_in_order", "x", x.dtype, -1);
    check_op_tensor(out, "sum_in_order", "out", DType::f64, 1);
    check_shape(out, "sum_in_order: out", {1});
    double s = 0;
    for (int64_t i = 0; i < x.numel(); ++i) s += double(x.ptr<const T>()[i]);
    out.ptr<double>()[0] = s;
  });
}

}  // namespace fp8moe::cpu
