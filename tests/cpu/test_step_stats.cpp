// The CPU step-statistics ops (moe_expert_loads, moe_balance_loss, sum_in_order), the
// specification the CUDA ones match bit for bit: loads counted by hand, the balance loss against
// its formula written out per sequence and its score gradient against central differences, the
// sum in index order where another order gives another answer, and undefined outputs left alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "fp8moe/backend.hpp"
#include "testing.hpp"

namespace fp8moe {
namespace {

Tensor ids_tensor(const std::vector<int32_t>& v, int64_t k) {
  Tensor t = Tensor::host(DType::i32, {int64_t(v.size()) / k, k});
  for (size_t i = 0; i < v.size(); ++i) t.ptr<int32_t>()[i] = v[i];
  return t;
}

TEST(StepStats, ExpertLoadsCountTheSlotsOfEachExpert) {
  auto be = make_backend("cpu");
  // -1 (a dropped slot) and ids past the experts are not counted.
  const Tensor ids = ids_tensor({0, 2, 2, -1, 5, 1, 2, 0}, 2);
  Tensor loads = Tensor::host(DType::f64, {4});
  be->moe_expert_loads(ids.view(), loads.view());
  EXPECT_EQ(std::vector<double>(loads.ptr<double>(), loads.ptr<double>() + 4), (std::vector<double>{2, 1, 3, 0}));
}

// B sequences of S tokens, E experts, top-k distinct per token; scores in (0, 1).
struct Routing {
  Tensor scores, idx;
};
Routing random_routing(std::mt19937_64& rng, int64_t B, int64_t S, int64_t E, int64_t K, DType dt) {
  Routing r{Tensor::host(dt, {B * S, E}), Tensor::host(DType::i32, {B * S, K})};
  std::uniform_real_distribution<double> u(0.05, 0.95);
  for (int64_t i = 0; i < B * S * E; ++i) {
    if (dt == DType::f64) r.scores.ptr<double>()[i] = u(rng);
    else r.scores.ptr<float>()[i] = float(u(rng));
  }
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < B * S; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = int32_t(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < K; ++j) r.idx.ptr<int32_t>()[t * K + j] = perm[size_t(j)];
  }
  return r;
}

// alpha / B * sum_b sum_e f_e P_e from the definition (DeepSeek-V3 eq. 17-20), another order.
double balance_formula(const Routing& r, int64_t S, double alpha) {
  const int64_t T = r.scores.size(0), E = r.scores.size(1), K = r.idx.size(1), B = T / S;
  double total = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> n(size_t(E), 0);
    std::vector<double> P(size_t(E), 0.0);
    for (int64_t t = b * S; t < (b + 1) * S; ++t) {
      for (int64_t j = 0; j < K; ++j) ++n[size_t(r.idx.ptr<int32_t>()[t * K + j])];
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += r.scores.ptr<double>()[t * E + e];
      for (int64_t e = 0; e < E; ++e) P[size_t(e)] += r.scores.ptr<double>()[t * E + e] / z;
    }
    for (int64_t e = 0; e < E; ++e) total += double(E) * double(n[size_t(e)]) / double(K * S) * P[size_t(e)] / double(S);
  }
  return alpha * total / double(B);
}

double balance_loss(Backend& be, const Routing& r, int64_t S, double alpha) {
  Tensor loss = Tensor::host(DType::f64, {1});
  be.moe_balance_loss(r.scores.view(), r.idx.view(), S, alpha, 1.0, loss.view(), TensorView());
  return loss.ptr<double>()[0];
}

TEST(StepStats, BalanceLossIsTheFormulaAndItsGradientTheDerivative) {
  auto be = make_backend("cpu");
  std::mt19937_64 rng(3);
  const int64_t B = 3, S = 5, E = 6, K = 2;
  const double alpha = 0.01, grad_scale = 0.5;
  Routing r = random_routing(rng, B, S, E, K, DType::f64);
  EXPECT_NEAR(balance_loss(*be, r, S, alpha), balance_formula(r, S, alpha), 1e-15);
  Tensor ds = Tensor::host(DType::f64, {B * S, E});
  be->moe_balance_loss(r.scores.view(), r.idx.view(), S, alpha, grad_scale, TensorView(), ds.view());
  const double eps = 1e-6;
  for (int64_t i = 0; i < B * S * E; ++i) {
    double& s = r.scores.ptr<double>()[i];
    const double s0 = s;
    s = s0 + eps;
    const double up = balance_loss(*be, r, S, alpha);
    s = s0 - eps;
    const double down = balance_loss(*be, r, S, alpha);
    s = s0;
    EXPECT_NEAR(ds.ptr<double>()[i], grad_scale * (up - down) / (2 * eps), 1e-10) << "score " << i;
  }
}

TEST(StepStats, BalanceLossLeavesUndefinedOutputsAndChecksItsArguments) {
  auto be = make_backend("cpu");
  std::mt19937_64 rng(4);
  const Routing r = random_routing(rng, 2, 4, 4, 2, DType::f32);
  Tensor loss = Tensor::host(DType::f64, {1});
  loss.ptr<double>()[0] = 7;
  Tensor ds = Tensor::host(DType::f32, {8, 4});
  be->moe_balance_loss(r.scores.view(), r.idx.view(), 4, 0.1, 1.0, TensorView(), ds.view());
  be->moe_balance_loss(r.scores.view(), r.idx.view(), 4, 0.1, 1.0, TensorView(), TensorView());
  EXPECT_EQ(loss.ptr<double>()[0], 7);
  testing::expect_error([&] { be->moe_balance_loss(r.scores.view(), r.idx.view(), 3, 0.1, 1.0, loss.view(), TensorView()); },
                        "not whole sequences of 3");
  Tensor bad = r.idx;
  bad.ptr<int32_t>()[5] = 4;
  testing::expect_error([&] { be->moe_balance_loss(r.scores.view(), bad.view(), 4, 0.1, 1.0, loss.view(), TensorView()); },
                        "idx[5] = 4 outside [0, 4)");
}

TEST(StepStats, SumInOrderAddsFromTheFirstElement) {
  auto be = make_backend("cpu");
  // In order: ((1e16 + 1) - 1e16) + 1 = 1 (1e16 + 1 rounds to 1e16); pairwise it is 0.
  Tensor x = Tensor::host(DType::f64, {4});
  const double v[] = {1e16, 1, -1e16, 1};
  for (int i = 0; i < 4; ++i) x.ptr<double>()[i] = v[i];
  Tensor out = Tensor::host(DType::f64, {1});
  be->sum_in_order(x.view(), out.view());
  EXPECT_EQ(out.ptr<double>()[0], 1.0);
  Tensor f = Tensor::host(DType::f32, {3});
  for (int i = 0; i < 3; ++i) f.ptr<float>()[i] = 0.1f;
  be->sum_in_order(f.view(), out.view());
  EXPECT_EQ(out.ptr<double>()[0], (0.0 + double(0.1f)) + double(0.1f) + double(0.1f));
}

}  // namespace
}  // namespace fp8moe
