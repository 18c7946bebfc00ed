// DeepSeekMoE sublayer (DeepSeek-V3 §2.1.2):
//   h = post_attention_layernorm(x)
//   s = sigmoid(h gate^T) [T, E] (FP32: the gate stays in higher precision)
//   top-k of s + bias within the best topk_group of n_group groups (node-limited routing's analogue);
//   the bias only steers selection (auxiliary-loss-free balancing, moved by update_routing_bias)
//   w = s[top-k] / sum * routed_scaling_factor
//   y = x + shared(h) + sum_k w_k expert_k(h)
// plus the sequence-wise balance loss alpha * sum_i f_i P_i per sequence (mean over sequences).
// Dispatch runs on the device over the expert-sorted layout (Backend::moe_layout): the tokens of
// each expert form one segment of rows, padded to 128, with a row per (token, top-k slot);
// moe_permute gathers rows there, moe_combine sums the weighted expert outputs back per token.
// The FP8 recipe runs the experts' Linears as grouped FP8 GEMMs over all segments at once (the
// permuted input quantized to 1x128 tiles with power-of-two scales in the same pass, as the
// report quantizes before dispatch); the BF16 recipe runs its elementwise work over all segments
// at once too, with one BF16 GEMM per expert segment (grouped_linear.cpp); the other recipes
// (fp32/fp64 oracles, the per-tensor ablation) run one MLP per expert on its rows.
// The output gradients before the routed experts' down projection use power-of-two scales too.
// The combine weight's gradient dy . expert_out is obtained without keeping expert outputs:
// rows_dot(d swiglu_out, swiglu_out) of the expert fed w * dy equals w * (dy . expert_out).
// Ctx::routed (Model::set_routed_experts) runs the routed experts elsewhere, expert-parallel over
// ranks: the layer then keeps the gate, the routing, the shared expert and the balance loss.
// The expert loads and the balance loss are computed on the device into Batch::stats, read once
// per step. With the FP8 grouped GEMMs nothing else needs the host either: they run over the
// layout's worst-case bound of rows and find each expert's segment on the device (padding rows
// skipped). The BF16 segment GEMMs and the per-expert MLPs need each expert's rows on the host:
// those recipes read the layout's offsets back, one synchronization per forward.
#include <algorithm>

#include "model_internal.hpp"

namespace fp8moe::model {

namespace {

constexpr int64_t kAlign = 128;  // rows per expert segment: the grouped GEMMs' M tile

class MoeLayer final : public Layer {
 public:
  MoeLayer(Ctx& c, int64_t layer, const ParamLookup& get) : c_(c), layer_(layer) {
    const std::string pre = "model.layers." + std::to_string(layer) + ".";
    name_ = "layers." + std::to_string(layer) + ".moe";
    norm_ = get(pre + "post_attention_layernorm.weight");
    gate_ = get(pre + "mlp.gate.weight");
    bias_ = get(pre + "mlp.gate.e_score_correction_bias");
    if (c.cfg.n_shared_experts > 0)
      shared_ = {get(pre + "mlp.shared_experts.gate_proj.weight"), get(pre + "mlp.shared_experts.up_proj.weight"),
                 get(pre + "mlp.shared_experts.down_proj.weight")};
    for (int64_t e = c.experts.first; e < c.experts.first + c.experts.count; ++e) {
      const std::string ep = pre + "mlp.experts." + std::to_string(e) + ".";
      experts_.push_back({get(ep + "gate_proj.weight"), get(ep + "up_proj.weight"), get(ep + "down_proj.weight")});
    }
    grouped_ = c.recipe.groups_experts();
    device_rows_ = grouped_ && c.recipe.linear != LinearPrecision::bf16;
    for (int64_t l = 0; l < layer; ++l) stats_at_ += c.cfg.is_moe_layer(l) ? 1 + c.cfg.n_routed_experts : 0;
    if (grouped_) {
      std::vector<Parameter*> g, u, d;
      for (const MlpParams& p : experts_) {
        g.push_back(p.gate);
        u.push_back(p.up);
        d.push_back(p.down);
      }
      for (const auto* list : {&g, &u, &d}) check_stacked(*list);
    }
  }
  std::string name() const override { return name_; }

  struct State : Saved {
    Tensor x, rstd;              // [T, D], [T]
    Tensor scores, idx, w;       // [T, E] act, [T, k] i32, [T, k] act
    MlpState shared;
    Tensor row_slot, slot_row;   // [R], [T, k] i32: the layout (row_slot the table, or its used prefix)
    std::vector<MemoryItem> layout_kept;  // the layout tables as allocated
    ExpertGroups groups;         // row_group [R], offsets [E + 1]
    MlpState experts;            // grouped: all rows at once
    std::vector<MlpState> expert;  // per expert: its rows
    Tensor dh, dlogits;          // kept from B for W: [T, D], [T, E]
    Tensor stats;                // [1 + E] f64: the balance loss and the loads (Batch::stats)
    std::unique_ptr<RoutedExperts::State> routed;  // Ctx::routed's state when it runs the experts
  };

  std::unique_ptr<Saved> forward(const Batch& b, const Tensor& x, Tensor& y) override {
    auto s = std::make_unique<State>();
    const auto& cfg = c_.cfg;
    const int64_t T = x.size(0), D = x.size(1), E = cfg.n_routed_experts, K = cfg.num_experts_per_tok;
    const ScaleMode pow2 = c_.recipe.pow2_mode;
    s->x = keep_residual(c_, x);
    s->rstd = c_.empty({T});
    Tensor h = c_.empty({T, D});
    rmsnorm(c_, norm_input(c_, s->x), *norm_, h, s->rstd);
    if (shared_.gate) {
      s->shared.in = linear_input(c_, h.view(), pow2);
      y = c_.empty({T, D});
      mlp_forward(c_, shared_, s->shared, y, pow2);
      s->shared.in.reset();  // the norm output: recomputed for W
      s->shared.in.rows = T;
      c_.be.axpy(1.0, x.view(), 1.0, y.view());  // the residual, into the shared expert's output
    } else {
      y = clone(c_, x.view());
    }
    // Router in the activation precision.
    Tensor logits = c_.empty({T, E});
    c_.be.gemm(h.view(), gate_->weight.view(), logits.view(), false, true, false);
    s->scores = c_.empty({T, E});
    s->idx = c_.be.empty(DType::i32, {T, K});
    s->w = c_.empty({T, K});
    c_.be.moe_route(logits.view(), bias_->weight.view(), s->scores.view(), s->idx.view(), s->w.view(), cfg.n_group,
                    cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor);
    FP8MOE_CHECK(c_.routed || c_.experts.count == E,
                 name_ << ": the model holds routed experts [" << c_.experts.first << ", "
                       << c_.experts.first + c_.experts.count << ") of " << E
                       << "; the others run on other ranks (Model::set_routed_experts)");
    step_stats(b, *s);
    if (c_.routed) {  // elsewhere (Model::set_routed_experts)
      s->routed = c_.routed->forward(c_, layer_, h, s->idx, s->w, y);
      for (const MemoryItem& m : s->routed->kept) s->kept.push_back(m);
      keep(*s);
      return s;
    }
    layout(*s, T);
    const int64_t R = s->row_slot.size(0);
    Tensor ye = c_.empty({R, D});  // expert outputs, expert-sorted rows
    if (grouped_) {
      MlpParams p = grouped_params(*s);
      if (c_.recipe.is_fp8() && !c_.recipe.f32_cache) {  // gather and quantize in one pass
        s->experts.in.rows = R;
        s->experts.in.q = c_.be.empty_quantized(R, D, DType::e4m3, ScaleKind::tile_1x128);
        c_.be.moe_permute_quantize(h.view(), s->row_slot.view(), K, TensorView(), s->experts.in.q, pow2);
      } else {
        Tensor xe = c_.empty({R, D});
        c_.be.moe_permute(h.view(), s->row_slot.view(), K, TensorView(), xe.view());
        s->experts.in = linear_input(c_, xe.view(), pow2);
      }
      mlp_forward(c_, p, s->experts, ye, pow2);
    } else {
      Tensor xe = c_.empty({R, D});
      c_.be.moe_permute(h.view(), s->row_slot.view(), K, TensorView(), xe.view());
      s->expert.assign(size_t(E), MlpState{});
      for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = s->groups.start[size_t(e)], n = s->groups.count[size_t(e)];
        if (n == 0) continue;
        MlpState& st = s->expert[size_t(e)];
        st.in = linear_input(c_, rows_view(xe.view(), r0, n), pow2);
        mlp_forward(c_, experts_[size_t(e)], st, rows_of(ye, r0, n), pow2);
      }
    }
    c_.be.moe_combine(ye.view(), s->slot_row.view(), s->w.view(), y.view(), true);
    keep(*s);
    return s;
  }

  // The memory account of what forward kept.
  void keep(State& st) const {
    State* s = &st;
    auto& k = s->kept;
    k.push_back(account_item(name_, "x", s->x.view()));
    k.push_back(account_item(name_, "rstd", s->rstd.view()));
    s->shared.account(k, name_, "shared.");
    k.push_back(account_item(name_, "scores", s->scores.view()));
    k.push_back(account_item(name_, "topk_idx", s->idx.view()));
    k.push_back(account_item(name_, "topk_w", s->w.view()));
    k.insert(k.end(), s->layout_kept.begin(), s->layout_kept.end());
    if (grouped_) {
      s->experts.in.account(k, name_, "experts.in");
      s->experts.account(k, name_, "experts.");
    }
    for (const MlpState& st : s->expert) {
      if (!st.in.defined()) continue;
      st.in.account(k, name_, "experts.in");
      st.account(k, name_, "experts.");
    }
  }

  void backward_input(const Batch& b, Saved& saved, const Tensor& dy, Tensor& dx) override {
    auto& s = static_cast<State&>(saved);
    const auto& cfg = c_.cfg;
    const int64_t T = dy.size(0), D = dy.size(1), K = cfg.num_experts_per_tok;
    const ScaleMode pow2 = c_.recipe.pow2_mode;
    s.dh = c_.zeros({T, D});  // zero-filled: the shared expert, the combine and the router add into it
    if (shared_.gate) mlp_backward_input(c_, shared_, s.shared, dy, s.dh, true, pow2);
    Tensor dw = c_.empty({T, K});
    if (s.routed) c_.routed->backward_input(c_, *s.routed, dy, s.w, s.dh, dw);
    else routed_backward_input(s, dy, dw);
    route_backward(b, s, dy, dw, dx);
  }

  // The routed experts' part of backward_input, in this process: adds into s.dh, writes dw.
  void routed_backward_input(State& s, const Tensor& dy, const Tensor& dw) {
    const auto& cfg = c_.cfg;
    const int64_t D = dy.size(1), E = cfg.n_routed_experts, K = cfg.num_experts_per_tok;
    const int64_t R = s.row_slot.size(0);
    const ScaleMode pow2 = c_.recipe.pow2_mode;
    Tensor dye = c_.empty({R, D});  // w * dy of the routed rows
    c_.be.moe_permute(dy.view(), s.row_slot.view(), K, s.w.view(), dye.view());
    Tensor dxe = c_.empty({R, D});
    Tensor cg = c_.empty({R});
    if (grouped_) {
      mlp_backward_input(c_, grouped_params(s), s.experts, dye, dxe, false, pow2, &cg);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = s.groups.start[size_t(e)], n = s.groups.count[size_t(e)];
        if (n == 0) continue;
        Tensor cge = rows_of(cg, r0, n);
        mlp_backward_input(c_, experts_[size_t(e)], s.expert[size_t(e)], rows_of(dye, r0, n), rows_of(dxe, r0, n),
                           false, pow2, &cge);
      }
    }
    c_.be.moe_combine(dxe.view(), s.slot_row.view(), TensorView(), s.dh.view(), true);
    // NOTES: w > 0 always (sigmoid affinities, positive scaling factor, validated).
    c_.be.moe_combine_weight_grad(cg.view(), s.slot_row.view(), s.w.view(), dw.view());
  }

  // The router's and the norm's backward from dw [T, k]: into s.dh, then dx.
  void route_backward(const Batch& b, State& s, const Tensor& dy, const Tensor& dw, Tensor& dx) {
    const auto& cfg = c_.cfg;
    const int64_t T = dy.size(0), E = cfg.n_routed_experts;
    Tensor dscores;
    if (cfg.aux_loss_alpha > 0) {
      dscores = c_.empty({T, E});
      c_.be.moe_balance_loss(s.scores.view(), s.idx.view(), b.seq, cfg.aux_loss_alpha, b.grad_scale, TensorView(),
                             dscores.view());
    }
    s.dlogits = c_.empty({T, E});
    c_.be.moe_route_backward(s.scores.view(), s.idx.view(), dw.view(), dscores.defined() ? dscores.view() : TensorView(),
                             s.dlogits.view(), cfg.norm_topk_prob, cfg.routed_scaling_factor);
    c_.be.gemm(s.dlogits.view(), gate_->weight.view(), s.dh.view(), false, false, true);
    dx = clone(c_, dy.view());
    c_.be.rmsnorm_backward(norm_input(c_, s.x).view(), norm_->weight.view(), s.rstd.view(), s.dh.view(), dx.view(),
                           TensorView(), true);
  }

  void backward_weight(const Batch&, Saved& saved) override {
    auto& s = static_cast<State&>(saved);
    // The norm output is not kept from forward: recomputed here, as forward ran it, for the gate's
    // Wgrad (in full precision) and the shared expert's (its Linear input).
    const int64_t T = s.x.size(0), D = s.x.size(1);
    Tensor h = c_.empty({T, D}), rstd = c_.empty({T});
    const Tensor xn = norm_input(c_, s.x);
    rmsnorm(c_, xn, *norm_, h, rstd);
    if (shared_.gate) {
      s.shared.in = linear_input(c_, h.view(), c_.recipe.pow2_mode);
      mlp_backward_weight(c_, shared_, s.shared);
    }
    if (s.routed) c_.routed->backward_weight(c_, *s.routed);
    else if (grouped_) mlp_backward_weight(c_, grouped_params(s), s.experts);
    for (size_t e = 0; e < s.expert.size(); ++e)
      if (s.expert[e].in.defined()) mlp_backward_weight(c_, experts_[e], s.expert[e]);
    c_.be.gemm(s.dlogits.view(), h.view(), gate_->grad.view(), true, false, true);
    c_.be.rmsnorm_backward(xn.view(), norm_->weight.view(), s.rstd.view(), s.dh.view(), TensorView(),
                           norm_->grad.view(), false);
    Tensor stats = std::move(s.stats);
    s = State{};
    s.stats = std::move(stats);
  }

  double aux_loss(const Saved& saved) const override {
    return c_.be.to_host(prefix_rows(static_cast<const State&>(saved).stats, 1)).ptr<double>()[0];
  }
  std::vector<int64_t> expert_loads(const Saved& saved) const override {
    const Tensor h = c_.be.to_host(static_cast<const State&>(saved).stats);
    std::vector<int64_t> loads(size_t(h.numel() - 1));
    for (size_t e = 0; e < loads.size(); ++e) loads[e] = int64_t(h.ptr<double>()[e + 1]);
    return loads;
  }

 private:
  // The balance loss and the expert loads, into the layer's part of b.stats (a tensor of its own
  // where the batch has none).
  void step_stats(const Batch& b, State& s) const {
    const int64_t E = c_.cfg.n_routed_experts;
    s.stats = b.stats.defined() ? rows_of(b.stats, stats_at_, 1 + E) : c_.be.zeros(DType::f64, {1 + E});
    if (c_.cfg.aux_loss_alpha > 0)
      c_.be.moe_balance_loss(s.scores.view(), s.idx.view(), b.seq, c_.cfg.aux_loss_alpha, b.grad_scale,
                             rows_view(s.stats.view(), 0, 1), TensorView());
    c_.be.moe_expert_loads(s.idx.view(), rows_view(s.stats.view(), 1, E));
  }

  // The expert-sorted layout on the device, in tables of the bound's size (the loads stay on the
  // device); the rows past the last segment are padding (-1).
  void layout(State& s, int64_t T) {
    const int64_t E = c_.cfg.n_routed_experts, K = c_.cfg.num_experts_per_tok;
    const int64_t R = moe_layout_rows(T * K, E, kAlign);
    // moe_layout writes every entry of its tables (-1 where no row or slot).
    Tensor row_slot = c_.be.empty(DType::i32, {R}), row_group = c_.be.empty(DType::i32, {R});
    s.slot_row = c_.be.empty(DType::i32, {T, K});
    s.groups.groups = E;
    s.groups.offsets = c_.be.empty(DType::i32, {E + 1});
    c_.be.moe_layout(s.idx.view(), kAlign, row_slot.view(), row_group.view(), s.slot_row.view(),
                     s.groups.offsets.view());
    s.layout_kept = {account_item(name_, "layout", row_slot.view()), account_item(name_, "layout", s.slot_row.view()),
                     account_item(name_, "layout", row_group.view()),
                     account_item(name_, "layout", s.groups.offsets.view())};
    if (device_rows_) {  // all R rows: the grouped FP8 GEMMs skip the padding past the segments
      s.row_slot = row_slot;
      s.groups.row_group = row_group;
      return;
    }
    // Each expert runs on its whole padded segment (the padding rows are zeros and add nothing, and
    // GEMM shapes repeat across steps), the activations on the rows the segments use.
    const Tensor off = c_.be.to_host(s.groups.offsets);
    s.groups.start.assign(size_t(E), 0);
    s.groups.count.assign(size_t(E), 0);
    for (int64_t e = 0; e < E; ++e) {
      s.groups.start[size_t(e)] = off.ptr<int32_t>()[e];
      s.groups.count[size_t(e)] = off.ptr<int32_t>()[e + 1] - off.ptr<int32_t>()[e];
    }
    const int64_t used = off.ptr<int32_t>()[E];
    s.row_slot = prefix_rows(row_slot, used);
    s.groups.row_group = prefix_rows(row_group, used);
  }

  MlpParams grouped_params(const State& s) const {
    MlpParams p = experts_[0];
    p.grouped = &s.groups;
    return p;
  }

  Ctx& c_;
  int64_t layer_ = 0;
  std::string name_;
  Parameter *norm_ = nullptr, *gate_ = nullptr, *bias_ = nullptr;
  MlpParams shared_;
  std::vector<MlpParams> experts_;
  bool grouped_ = false;  // Recipe::groups_experts
  bool device_rows_ = false;  // the grouped FP8 GEMMs: segments found on the device
  int64_t stats_at_ = 2;      // where this layer's balance loss and loads are in Batch::stats
};

}  // namespace

std::unique_ptr<Layer> make_moe_layer(Ctx& c, int64_t layer, const ParamLookup& get) {
  return std::make_unique<MoeLayer>(c, layer, get);
}

}  // namespace fp8moe::model
