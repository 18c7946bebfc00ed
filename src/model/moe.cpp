// DeepSeekMoE sublayer (DeepSeek-V3 §2.1.2):
//   h = post_attention_layernorm(x)
//   s = sigmoid(h gate^T) [T, E] (FP32: the gate stays in higher precision)
//   top-k of s + bias within the best topk_group of n_group groups (node-limited routing's analogue);
//   the bias only steers selection (auxiliary-loss-free balancing, moved by update_routing_bias)
//   w = s[top-k] / sum * routed_scaling_factor
//   y = x + shared(h) + sum_k w_k expert_k(h)
// plus the sequence-wise balance loss alpha * sum_i f_i P_i per sequence (mean over sequences).
// FP8: the dispatched activations are cached per expert as FP8 1x128 tiles with power-of-two scales
// (the 1x128 tiles are per token, so quantizing before or after the gather is the same), and the
// output gradients before the routed experts' down projection use power-of-two scales too.
// The combine weight's gradient dy . expert_out is obtained without keeping expert outputs:
// rows_dot(d swiglu_out, swiglu_out) of the expert fed w * dy equals w * (dy . expert_out).
#include <algorithm>

#include "model_internal.hpp"

namespace fp8moe::model {

namespace {

class MoeLayer final : public Layer {
 public:
  MoeLayer(Ctx& c, int64_t layer, const ParamLookup& get) : c_(c) {
    const std::string pre = "model.layers." + std::to_string(layer) + ".";
    name_ = "layers." + std::to_string(layer) + ".moe";
    norm_ = get(pre + "post_attention_layernorm.weight");
    gate_ = get(pre + "mlp.gate.weight");
    bias_ = get(pre + "mlp.gate.e_score_correction_bias");
    if (c.cfg.n_shared_experts > 0)
      shared_ = {get(pre + "mlp.shared_experts.gate_proj.weight"), get(pre + "mlp.shared_experts.up_proj.weight"),
                 get(pre + "mlp.shared_experts.down_proj.weight")};
    for (int64_t e = 0; e < c.cfg.n_routed_experts; ++e) {
      const std::string ep = pre + "mlp.experts." + std::to_string(e) + ".";
      experts_.push_back({get(ep + "gate_proj.weight"), get(ep + "up_proj.weight"), get(ep + "down_proj.weight")});
    }
  }
  std::string name() const override { return name_; }

  struct Expert {
    std::vector<int64_t> slots;  // t * k + j of each routed token
    Tensor ids, w;               // [n] i32 token rows, [n] act combine weights
    MlpState mlp;
  };
  struct State : Saved {
    Tensor x, rstd;              // [T, D], [T]
    Cached h;                    // [T, D] shared expert input (the norm output)
    Tensor scores, idx, w;       // [T, E] act, [T, k] i32, [T, k] act
    MlpState shared;
    std::vector<Expert> experts;
    Tensor dh, dlogits;          // kept from B for W: [T, D], [T, E]
    double aux = 0;
    std::vector<int64_t> loads;
  };

  std::unique_ptr<Saved> forward(const Batch& b, const Tensor& x, Tensor& y) override {
    auto s = std::make_unique<State>();
    const auto& cfg = c_.cfg;
    const int64_t T = x.size(0), D = x.size(1), E = cfg.n_routed_experts, K = cfg.num_experts_per_tok;
    s->x = x;
    s->rstd = c_.zeros({T});
    Tensor h = c_.zeros({T, D});
    rmsnorm(c_, x, *norm_, h, s->rstd);
    y = clone(c_, x.view());
    if (shared_.gate) {
      s->shared.in = linear_input(c_, h.view(), c_.recipe.pow2_mode);
      s->h = s->shared.in;
      Tensor out = c_.zeros({T, D});
      mlp_forward(c_, shared_, s->shared, out, c_.recipe.pow2_mode);
      c_.be.axpy(1.0, out.view(), 1.0, y.view());
    }
    // Router in the activation precision.
    Tensor logits = c_.zeros({T, E});
    c_.be.gemm(h.view(), gate_->weight.view(), logits.view(), false, true, false);
    s->scores = c_.zeros({T, E});
    s->idx = c_.be.empty(DType::i32, {T, K});
    s->w = c_.zeros({T, K});
    c_.be.moe_route(logits.view(), bias_->weight.view(), s->scores.view(), s->idx.view(), s->w.view(), cfg.n_group,
                    cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor);
    build_dispatch(*s, T);
    for (int64_t e = 0; e < E; ++e) {
      Expert& ex = s->experts[size_t(e)];
      const int64_t n = int64_t(ex.slots.size());
      if (n == 0) continue;
      Tensor xe = c_.zeros({n, D});  // dispatched rows
      c_.be.gather_rows(h.view(), ex.ids.view(), TensorView(), xe.view());
      ex.mlp.in = linear_input(c_, xe.view(), c_.recipe.pow2_mode);
      Tensor ye = c_.zeros({n, D});
      mlp_forward(c_, experts_[size_t(e)], ex.mlp, ye, c_.recipe.pow2_mode);
      c_.be.scatter_add_rows(ye.view(), ex.ids.view(), ex.w.view(), y.view());  // weighted combine
    }
    s->aux = balance_loss(b, *s, nullptr);

    auto& k = s->kept;
    k.push_back(account_item(name_, "x", x.view()));
    k.push_back(account_item(name_, "rstd", s->rstd.view()));
    s->h.account(k, name_, "norm_out");
    s->shared.account(k, name_, "shared.");
    k.push_back(account_item(name_, "scores", s->scores.view()));
    k.push_back(account_item(name_, "topk_idx", s->idx.view()));
    k.push_back(account_item(name_, "topk_w", s->w.view()));
    for (const Expert& ex : s->experts) {
      if (ex.slots.empty()) continue;
      ex.mlp.in.account(k, name_, "experts.in");
      ex.mlp.account(k, name_, "experts.");
    }
    return s;
  }

  void backward_input(const Batch& b, Saved& saved, const Tensor& dy, Tensor& dx) override {
    auto& s = static_cast<State&>(saved);
    const auto& cfg = c_.cfg;
    const int64_t T = dy.size(0), D = dy.size(1), E = cfg.n_routed_experts, K = cfg.num_experts_per_tok;
    s.dh = c_.zeros({T, D});
    if (shared_.gate) mlp_backward_input(c_, shared_, s.shared, dy, s.dh, true, c_.recipe.pow2_mode);
    const std::vector<double> w = to_doubles(c_, s.w);
    std::vector<double> dw(size_t(T * K), 0.0);
    for (int64_t e = 0; e < E; ++e) {
      Expert& ex = s.experts[size_t(e)];
      const int64_t n = int64_t(ex.slots.size());
      if (n == 0) continue;
      Tensor dye = c_.zeros({n, D});  // w * dy of the routed rows
      c_.be.gather_rows(dy.view(), ex.ids.view(), ex.w.view(), dye.view());
      Tensor dxe = c_.zeros({n, D});
      Tensor cg = c_.zeros({n});
      mlp_backward_input(c_, experts_[size_t(e)], ex.mlp, dye, dxe, false, c_.recipe.pow2_mode, &cg);
      c_.be.scatter_add_rows(dxe.view(), ex.ids.view(), TensorView(), s.dh.view());
      const std::vector<double> cgh = to_doubles(c_, cg);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = ex.slots[size_t(i)];
        // NOTES: w > 0 always (sigmoid affinities, positive scaling factor, validated).
        dw[size_t(slot)] = cgh[size_t(i)] / w[size_t(slot)];
      }
    }
    Tensor dscores;
    if (cfg.aux_loss_alpha > 0) {
      std::vector<double> ds(size_t(T * E), 0.0);
      balance_loss(b, s, &ds);
      dscores = c_.zeros({T, E});
      c_.be.copy(dscores.view(), reshape(act_vector(c_, ds).view(), {T, E}));
    }
    s.dlogits = c_.zeros({T, E});
    c_.be.moe_route_backward(s.scores.view(), s.idx.view(), reshape(act_vector(c_, dw).view(), {T, K}),
                             dscores.defined() ? dscores.view() : TensorView(), s.dlogits.view(),
                             cfg.norm_topk_prob, cfg.routed_scaling_factor);
    c_.be.gemm(s.dlogits.view(), gate_->weight.view(), s.dh.view(), false, false, true);
    dx = clone(c_, dy.view());
    c_.be.rmsnorm_backward(s.x.view(), norm_->weight.view(), s.rstd.view(), s.dh.view(), dx.view(), TensorView(), true);
  }

  void backward_weight(const Batch&, Saved& saved) override {
    auto& s = static_cast<State&>(saved);
    if (shared_.gate) mlp_backward_weight(c_, shared_, s.shared, c_.recipe.pow2_mode);
    for (size_t e = 0; e < s.experts.size(); ++e)
      if (!s.experts[e].slots.empty()) mlp_backward_weight(c_, experts_[e], s.experts[e].mlp, c_.recipe.pow2_mode);
    // The gate's Wgrad needs h in full precision: recompute the norm.
    const int64_t T = s.x.size(0), D = s.x.size(1);
    Tensor h = c_.zeros({T, D}), rstd = c_.zeros({T});
    rmsnorm(c_, s.x, *norm_, h, rstd);
    c_.be.gemm(s.dlogits.view(), h.view(), gate_->grad.view(), true, false, true);
    c_.be.rmsnorm_backward(s.x.view(), norm_->weight.view(), s.rstd.view(), s.dh.view(), TensorView(),
                           norm_->grad.view(), false);
    const double aux = s.aux;
    auto loads = std::move(s.loads);
    s = State{};
    s.aux = aux;
    s.loads = std::move(loads);
  }

  double aux_loss(const Saved& saved) const override { return static_cast<const State&>(saved).aux; }
  std::vector<int64_t> expert_loads(const Saved& saved) const override {
    return static_cast<const State&>(saved).loads;
  }

 private:
  // Per-expert token lists from the top-k indices (host), as backend index/weight vectors.
  void build_dispatch(State& s, int64_t T) {
    const int64_t E = c_.cfg.n_routed_experts, K = c_.cfg.num_experts_per_tok;
    const Tensor idx = c_.be.to_host(s.idx);
    const std::vector<double> w = to_doubles(c_, s.w);
    s.experts.assign(size_t(E), Expert{});
    s.loads.assign(size_t(E), 0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = idx.ptr<int32_t>()[t * K + j];
        s.experts[size_t(e)].slots.push_back(t * K + j);
        ++s.loads[size_t(e)];
      }
    for (auto& ex : s.experts) {
      const int64_t n = int64_t(ex.slots.size());
      if (n == 0) continue;
      Tensor ids = Tensor::host(DType::i32, {n});
      std::vector<double> we(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        ids.ptr<int32_t>()[i] = int32_t(ex.slots[size_t(i)] / K);
        we[size_t(i)] = w[size_t(ex.slots[size_t(i)])];
      }
      ex.ids = to_backend(c_, ids);
      ex.w = act_vector(c_, we);
    }
  }

  // Sequence-wise balance loss alpha * mean_b sum_i f_i P_i; with ds, adds grad_scale * dL/ds [T, E].
  double balance_loss(const Batch& b, const State& s, std::vector<double>* ds) const {
    const auto& cfg = c_.cfg;
    if (cfg.aux_loss_alpha <= 0) return 0;
    const int64_t E = cfg.n_routed_experts, K = cfg.num_experts_per_tok, S = b.seq, B = b.batch;
    const std::vector<double> sc = to_doubles(c_, s.scores);
    const Tensor idx = c_.be.to_host(s.idx);
    double total = 0;
    for (int64_t bi = 0; bi < B; ++bi) {
      std::vector<double> f(size_t(E), 0.0), P(size_t(E), 0.0);
      for (int64_t t = bi * S; t < (bi + 1) * S; ++t) {
        for (int64_t j = 0; j < K; ++j) f[size_t(idx.ptr<int32_t>()[t * K + j])] += double(E) / double(K * S);
        double z = 0;
        for (int64_t e = 0; e < E; ++e) z += sc[size_t(t * E + e)];
        for (int64_t e = 0; e < E; ++e) P[size_t(e)] += sc[size_t(t * E + e)] / z / double(S);
      }
      for (int64_t e = 0; e < E; ++e) total += cfg.aux_loss_alpha * f[size_t(e)] * P[size_t(e)] / double(B);
      if (ds) {
        const double c = b.grad_scale * cfg.aux_loss_alpha / double(B * S);
        for (int64_t t = bi * S; t < (bi + 1) * S; ++t) {
          double z = 0, fs = 0;
          for (int64_t e = 0; e < E; ++e) {
            z += sc[size_t(t * E + e)];
            fs += f[size_t(e)] * sc[size_t(t * E + e)];
          }
          for (int64_t e = 0; e < E; ++e) (*ds)[size_t(t * E + e)] += c * (f[size_t(e)] / z - fs / (z * z));
        }
      }
    }
    return total;
  }

  Ctx& c_;
  std::string name_;
  Parameter *norm_ = nullptr, *gate_ = nullptr, *bias_ = nullptr;
  MlpParams shared_;
  std::vector<MlpParams> experts_;
};

}  // namespace

std::unique_ptr<Layer> make_moe_layer(Ctx& c, int64_t layer, const ParamLookup& get) {
  return std::make_unique<MoeLayer>(c, layer, get);
}

}  // namespace fp8moe::model
