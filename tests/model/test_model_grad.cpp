// Finite-difference gradient checks of every layer (attention, dense MLP, MoE) and of the whole
// model (embedding, trunk, head, MTP, balance loss) on the CPU backend in the fp64 recipe, with
// central differences; backward-for-input and backward-for-weights are checked separately (dx
// from B alone, weight gradients from W). Routing is discontinuous in the logits, so a sampled
// entry whose +/-eps evaluation changes the top-k choice would be skipped (eps is tiny in FP64).
#include <cmath>

#include "model_testing.hpp"

namespace fp8moe::testing {
namespace {

constexpr double kEps = 1e-6;

struct FdResult {
  std::vector<double> analytic, numeric;
};

// Samples `n` entries of a host f64 tensor (the first, the last and random ones).
std::vector<int64_t> sample(std::mt19937_64& rng, int64_t numel, int n) {
  std::vector<int64_t> idx{0, numel - 1};
  for (int i = 2; i < n && i < numel; ++i) idx.push_back(int64_t(rng() % uint64_t(numel)));
  return idx;
}

void expect_close(const FdResult& r, const std::string& what, double tol = 1e-5) {
  ASSERT_FALSE(r.numeric.empty()) << what;
  double scale = 0;
  for (double v : r.numeric) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < r.numeric.size(); ++i) {
    ASSERT_TRUE(std::isfinite(r.analytic[i])) << what;
    EXPECT_NEAR(r.analytic[i], r.numeric[i], tol * std::max(scale, 1e-6) + 1e-9)
        << what << " entry " << i << " (max |grad| " << scale << ")";
  }
  std::cout << "[ fd       ] " << what << ": rel error " << rel_error(r.analytic, r.numeric) << " over "
            << r.numeric.size() << " entries\n";
}

// Layer-level check: L = sum(y * R) + aux for one sublayer of the trunk.
void check_layer(Model& model, size_t index, const Batch& b, std::mt19937_64& rng) {
  Layer* layer = model.trunk()[index];
  const ModelConfig& c = model.config();
  const int64_t T = b.tokens_count(), D = c.hidden_size;
  Tensor x = random_normal(rng, DType::f32, {T, D});
  Tensor xd = Tensor::host(DType::f64, {T, D});
  for (int64_t i = 0; i < T * D; ++i) xd.ptr<double>()[i] = x.ptr<float>()[i];
  Tensor R = Tensor::host(DType::f64, {T, D});
  std::normal_distribution<double> nd;
  for (int64_t i = 0; i < T * D; ++i) R.ptr<double>()[i] = nd(rng);
  auto loss = [&]() {
    Tensor y;
    auto s = layer->forward(b, xd, y);
    double l = layer->aux_loss(*s);
    for (int64_t i = 0; i < T * D; ++i) l += y.ptr<double>()[i] * R.ptr<double>()[i];
    return l;
  };
  model.zero_grad();
  Tensor y, dx;
  auto s = layer->forward(b, xd, y);
  layer->backward_input(b, *s, R, dx);
  // B alone must not have touched any weight gradient.
  for (auto& p : model.parameters())
    for (int64_t i = 0; i < p.grad.numel(); ++i) ASSERT_EQ(p.grad.ptr<double>()[i], 0.0) << p.name << " after B";
  layer->backward_weight(b, *s);
  FdResult rx;
  for (int64_t i : sample(rng, T * D, 12)) {
    double& v = xd.ptr<double>()[i];
    const double v0 = v;
    v = v0 + kEps;
    const double lp = loss();
    v = v0 - kEps;
    const double lm = loss();
    v = v0;
    rx.analytic.push_back(dx.ptr<double>()[i]);
    rx.numeric.push_back((lp - lm) / (2 * kEps));
  }
  expect_close(rx, layer->name() + " dx (backward-for-input)");
  // Weight gradients of this sublayer's parameters.
  const std::string lname = layer->name();  // layers.<l>.<part>
  const std::string prefix = "model." + lname.substr(0, lname.rfind('.')) + ".";
  const bool attn = lname.ends_with(".attn");
  for (auto& p : model.parameters()) {
    if (!p.name.starts_with(prefix) || !p.trainable) continue;
    const bool is_attn = p.name.find("self_attn") != std::string::npos || p.name.find("input_layernorm") != std::string::npos;
    if (is_attn != attn) continue;
    FdResult r;
    for (int64_t i : sample(rng, p.weight.numel(), 4)) {
      double& v = p.weight.ptr<double>()[i];
      const double v0 = v;
      v = v0 + kEps;
      const double lp = loss();
      v = v0 - kEps;
      const double lm = loss();
      v = v0;
      r.analytic.push_back(p.grad.ptr<double>()[i]);
      r.numeric.push_back((lp - lm) / (2 * kEps));
    }
    expect_close(r, p.name + " (backward-for-weights)");
  }
}

TEST(ModelGrad, EveryLayerFp64) {
  auto rng = make_rng();
  auto be = make_backend("cpu");
  for (int64_t q_lora : {20, 0}) {
    ModelConfig c = fd_config();
    c.q_lora_rank = q_lora;
    Model model(c, Recipe::from_name("fp64"), *be, rng());
    auto [tok, tgt] = random_batch(rng, c);
    Batch b = model.make_batch(tok.view(), tgt.view());
    for (size_t i = 0; i < model.trunk().size(); ++i) check_layer(model, i, b, rng);
  }
}

TEST(ModelGrad, WholeModelFp64) {
  auto rng = make_rng();
  auto be = make_backend("cpu");
  const ModelConfig c = fd_config();
  Model model(c, Recipe::from_name("fp64"), *be, rng());
  // A non-zero routing bias so that it steers selection.
  for (auto& p : model.parameters())
    if (!p.trainable)
      for (int64_t i = 0; i < p.weight.numel(); ++i) p.weight.ptr<double>()[i] = 0.05 * double(i % 3);
  auto [tok, tgt] = random_batch(rng, c);
  tgt.ptr<int32_t>()[3] = -1;  // an ignored target
  const double gs = 0.7;       // gradients are of gs * loss
  model.zero_grad();
  const StepStats st = model.forward_backward(tok.view(), tgt.view(), gs);
  EXPECT_GT(st.mtp_loss, 0);
  EXPECT_GT(st.balance_loss, 0);
  EXPECT_NEAR(st.loss, st.main_loss + c.mtp_loss_weight * st.mtp_loss + st.balance_loss, 1e-12);
  ASSERT_EQ(st.expert_loads.size(), size_t(c.num_moe_layers()));
  for (auto& loads : st.expert_loads) {
    int64_t n = 0;
    for (auto v : loads) n += v;
    EXPECT_EQ(n, st.tokens * c.num_experts_per_tok);
  }
  const double l0 = model.forward(tok.view(), tgt.view()).loss;
  EXPECT_NEAR(l0, st.loss, 1e-12) << "forward and forward_backward disagree";
  for (auto& p : model.parameters()) {
    if (!p.trainable) continue;
    FdResult r;
    for (int64_t i : sample(rng, p.weight.numel(), 3)) {
      double& v = p.weight.ptr<double>()[i];
      const double v0 = v;
      v = v0 + kEps;
      const double lp = model.forward(tok.view(), tgt.view()).loss;
      v = v0 - kEps;
      const double lm = model.forward(tok.view(), tgt.view()).loss;
      v = v0;
      r.analytic.push_back(p.grad.ptr<double>()[i]);
      r.numeric.push_back(gs * (lp - lm) / (2 * kEps));
    }
    expect_close(r, p.name);
  }
}

}  // namespace
}  // namespace fp8moe::testing
