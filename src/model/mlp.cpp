// SwiGLU MLP: the dense MLP of the first layers, the shared expert and every routed expert.
//   out = down(silu(gate(x)) * up(x))
// Memory (report §3.3.3): the SwiGLU input (gate and up outputs) is cached in the recipe's format
// (FP8 in the fp8 recipes) and the SwiGLU output is recomputed in backward, then cached again as
// down_proj's input for its Wgrad until backward-for-weights.
#include "model_internal.hpp"

namespace fp8moe::model {

namespace {

// One Linear's three GEMMs, per expert or grouped over the experts (MlpParams::grouped).
void fwd(Ctx& c, const MlpParams& p, const Cached& x, Parameter& w, const Tensor& y) {
  if (p.grouped) return grouped_linear_forward(c, *p.grouped, x, w, y);
  linear_forward(c, x, w, y, c.recipe.linear);
}
WgradDy bwd_input(Ctx& c, const MlpParams& p, const Tensor& dy, Parameter& w, const Tensor& dx, bool accumulate,
                  ScaleMode dy_mode = ScaleMode::fp32) {
  if (p.grouped) return grouped_linear_backward_input(c, *p.grouped, dy, w, dx, accumulate, dy_mode);
  return linear_backward_input(c, dy, w, dx, accumulate, c.recipe.linear, dy_mode);
}
void bwd_weight(Ctx& c, const MlpParams& p, const Cached& x, const WgradDy& dy, Parameter& w) {
  if (p.grouped) return grouped_linear_backward_weight(c, *p.grouped, x, dy, w);
  linear_backward_weight(c, x, dy, w, c.recipe.linear);
}

}  // namespace

void MlpState::account(std::vector<MemoryItem>& items, const std::string& layer, const std::string& prefix) const {
  g.account(items, layer, prefix + "gate_out");
  u.account(items, layer, prefix + "up_out");
}

void mlp_forward(Ctx& c, const MlpParams& p, MlpState& st, const Tensor& out, ScaleMode) {
  const int64_t T = st.in.rows, F = p.gate->weight.size(0);
  const LinearPrecision prec = c.recipe.linear;
  Tensor g = c.empty({T, F}), u = c.empty({T, F});  // [T, F] act
  fwd(c, p, st.in, *p.gate, g);
  fwd(c, p, st.in, *p.up, u);
  if (prec == LinearPrecision::fp8 && !c.recipe.per_tensor && !c.recipe.f32_cache && c.act() == DType::f32) {
    // One pass over g and u: their FP8 cache and the down projection's FP8 input, row-padded as
    // linear_input pads it (bit-identical to the path below).
    const auto quantized = [&](int64_t rows) {
      return c.be.empty_quantized(rows, F, DType::e4m3, ScaleKind::tile_1x128);
    };
    Cached a;
    a.rows = st.g.rows = st.u.rows = T;
    st.g.q = quantized(T);
    st.u.q = quantized(T);
    a.q = quantized(round_up(T, kQuantGroup));
    c.be.swiglu_forward_fp8(g.view(), u.view(), st.g.q, st.u.q, a.q, c.recipe.scale_mode);
    fwd(c, p, a, *p.down, out);
    return;
  }
  st.g = cache_activation(c, g.view(), DType::e4m3, c.recipe.scale_mode, false, prec);
  st.u = cache_activation(c, u.view(), DType::e4m3, c.recipe.scale_mode, false, prec);
  Tensor a = c.empty({T, F});  // [T, F] act: SwiGLU output, not kept
  c.be.swiglu_forward(g.view(), u.view(), a.view());
  fwd(c, p, linear_input(c, a.view(), c.recipe.scale_mode), *p.down, out);
}

void mlp_backward_input(Ctx& c, const MlpParams& p, MlpState& st, const Tensor& dy, const Tensor& dx, bool accumulate,
                        ScaleMode dy_mode, const Tensor* combine_grad) {
  const int64_t T = st.in.rows, F = p.gate->weight.size(0);
  Tensor da = c.empty({T, F});  // [T, F]
  st.dy = bwd_input(c, p, dy, *p.down, da, false, dy_mode);
  // Recompute the SwiGLU output from its cached input, and the SwiGLU backward.
  Tensor a = c.empty({T, F});  // [T, F] act
  Tensor dg = c.empty({T, F}), du = c.empty({T, F});
  if (st.g.q.values.defined() && st.u.q.values.defined() && !st.g.full.defined() && c.act() == DType::f32) {
    // FP8 cache: both straight from the FP8 tiles (no f32 copies of g and u), bit-identical to the
    // path below.
    c.be.swiglu_backward_fp8(st.g.q, st.u.q, da.view(), a.view(), dg.view(), du.view());
  } else {
    Tensor g = st.g.restore(c), u = st.u.restore(c);  // [T, F] act
    c.be.swiglu_forward(g.view(), u.view(), a.view());
    c.be.swiglu_backward(g.view(), u.view(), da.view(), dg.view(), du.view());
  }
  st.g.reset();
  st.u.reset();
  st.a = linear_input(c, a.view(), c.recipe.scale_mode);
  if (combine_grad) c.be.rows_dot(da.view(), a.view(), combine_grad->view());
  // Released after their last use: the FP8 Dgrads below add the dy^T they keep for the Wgrads.
  da = Tensor();
  a = Tensor();
  st.dg = bwd_input(c, p, dg, *p.gate, dx, accumulate);
  dg = Tensor();
  st.du = bwd_input(c, p, du, *p.up, dx, true);
}

void mlp_backward_weight(Ctx& c, const MlpParams& p, MlpState& st) {
  bwd_weight(c, p, st.a, st.dy, *p.down);
  bwd_weight(c, p, st.in, st.dg, *p.gate);
  bwd_weight(c, p, st.in, st.du, *p.up);
  st = MlpState{};
}

namespace {

// Dense MLP sublayer of the first layers: y = x + mlp(post_attention_layernorm(x)).
class MlpLayer final : public Layer {
 public:
  MlpLayer(Ctx& c, int64_t layer, const ParamLookup& get) : c_(c) {
    const std::string pre = "model.layers." + std::to_string(layer) + ".";
    name_ = "layers." + std::to_string(layer) + ".mlp";
    norm_ = get(pre + "post_attention_layernorm.weight");
    p_ = {get(pre + "mlp.gate_proj.weight"), get(pre + "mlp.up_proj.weight"), get(pre + "mlp.down_proj.weight")};
  }
  std::string name() const override { return name_; }

  struct State : Saved {
    Tensor x, rstd;  // [T, D] layer input (Recipe::residual_cache; the norm is recomputed from it for W), [T]
    MlpState mlp;    // mlp.in: the norm output, not kept from forward to backward
    Tensor dh;  // [T, D] gradient of the norm output, kept from B for W
  };

  std::unique_ptr<Saved> forward(const Batch&, const Tensor& x, Tensor& y) override {
    auto s = std::make_unique<State>();
    const int64_t T = x.size(0), D = x.size(1);
    s->x = keep_residual(c_, x);
    s->rstd = c_.empty({T});
    s->mlp.in = rmsnorm_linear_input(c_, norm_input(c_, s->x), *norm_, s->rstd, c_.recipe.scale_mode);
    Tensor out = c_.empty({T, D});
    mlp_forward(c_, p_, s->mlp, out, c_.recipe.scale_mode);
    c_.be.axpy(1.0, x.view(), 1.0, out.view());  // the residual, into the sublayer output
    y = out;
    s->mlp.in.reset();
    s->mlp.in.rows = T;
    s->kept.push_back(account_item(name_, "x", s->x.view()));
    s->kept.push_back(account_item(name_, "rstd", s->rstd.view()));
    s->mlp.account(s->kept, name_, "");
    return s;
  }

  void backward_input(const Batch&, Saved& saved, const Tensor& dy, Tensor& dx) override {
    auto& s = static_cast<State&>(saved);
    const int64_t T = dy.size(0), D = dy.size(1);
    s.dh = c_.empty({T, D});  // written by the gate's Dgrad (accumulate = false), then the up's adds
    mlp_backward_input(c_, p_, s.mlp, dy, s.dh, false, c_.recipe.scale_mode);
    dx = clone(c_, dy.view());
    c_.be.rmsnorm_backward(norm_input(c_, s.x).view(), norm_->weight.view(), s.rstd.view(), s.dh.view(), dx.view(),
                           TensorView(),
                           true);
  }

  void backward_weight(const Batch&, Saved& saved) override {
    auto& s = static_cast<State&>(saved);
    // The gate and up Wgrads' input: the norm recomputed as forward ran it (rstd again, the same).
    Tensor rstd = c_.empty({s.x.size(0)});
    const Tensor xn = norm_input(c_, s.x);
    s.mlp.in = rmsnorm_linear_input(c_, xn, *norm_, rstd, c_.recipe.scale_mode);
    mlp_backward_weight(c_, p_, s.mlp);
    c_.be.rmsnorm_backward(xn.view(), norm_->weight.view(), s.rstd.view(), s.dh.view(), TensorView(),
                           norm_->grad.view(), false);
    s = State{};
  }

 private:
  Ctx& c_;
  std::string name_;
  Parameter* norm_;
  MlpParams p_;
};

}  // namespace

std::unique_ptr<Layer> make_mlp_layer(Ctx& c, int64_t layer, const ParamLookup& get) {
  return std::make_unique<MlpLayer>(c, layer, get);
}

}  // namespace fp8moe::model
