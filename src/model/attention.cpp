// Multi-head latent attention (DeepSeek-V3 §2.1.1) as a residual sublayer:
//   h   = input_layernorm(x)                                  [T, D]
//   q   = q_b_proj(q_a_layernorm(q_a_proj(h)))                [T, H*(dn+dr)]  (q_proj(h) without q_lora)
//   ckv = kv_a_proj_with_mqa(h)                               [T, rkv + dr]: latent | shared RoPE key
//   kv  = kv_b_proj(kv_a_layernorm(ckv[:, :rkv]))             [T, H*(dn+dv)]: per-head k_nope | v
//   Q = [q_nope, rope(q_pe)], K = [k_nope, rope(k_pe) for every head], V    (scale 1/sqrt(dn+dr))
//   y   = x + o_proj(causal_attention(Q, K, V))
// Memory (report §3.2.3, §3.3.3): the norm outputs and the up-projection outputs q and kv are not
// kept; backward recomputes the norms (the Linear inputs they feed, in the recipe's format) from
// their inputs and rstd, and q and kv from those. Kept: x, the norms' rstd, the norm inputs q_a
// output and ckv (small latents), and the attention output as o_proj's input (E5M6, power-of-two
// scales in the FP8 recipes), which also serves as O in the attention backward.
#include <cmath>

#include "model_internal.hpp"

namespace fp8moe::model {

namespace {

class AttentionLayer final : public Layer {
 public:
  AttentionLayer(Ctx& c, int64_t layer, const ParamLookup& get) : c_(c) {
    const std::string pre = "model.layers." + std::to_string(layer) + ".";
    name_ = "layers." + std::to_string(layer) + ".attn";
    norm_ = get(pre + "input_layernorm.weight");
    if (c.cfg.q_lora_rank > 0) {
      q_a_ = get(pre + "self_attn.q_a_proj.weight");
      q_a_norm_ = get(pre + "self_attn.q_a_layernorm.weight");
      q_b_ = get(pre + "self_attn.q_b_proj.weight");
    } else {
      q_b_ = get(pre + "self_attn.q_proj.weight");
    }
    kv_a_ = get(pre + "self_attn.kv_a_proj_with_mqa.weight");
    kv_a_norm_ = get(pre + "self_attn.kv_a_layernorm.weight");
    kv_b_ = get(pre + "self_attn.kv_b_proj.weight");
    o_ = get(pre + "self_attn.o_proj.weight");
    H_ = c.cfg.num_attention_heads;
    dn_ = c.cfg.qk_nope_head_dim;
    dr_ = c.cfg.qk_rope_head_dim;
    dv_ = c.cfg.v_head_dim;
    dqk_ = dn_ + dr_;
    rkv_ = c.cfg.kv_lora_rank;
    scale_ = 1.0 / std::sqrt(double(dqk_));
  }
  std::string name() const override { return name_; }

  // The norms' outputs (h, cqn, ckvn) are not kept from forward to backward: the backward
  // recomputes them from the norms' inputs and rstd (report §3.2.3), bit for bit.
  struct State : Saved {
    Tensor x, rstd;          // [T, D] layer input (Recipe::residual_cache), [T] input_layernorm
    Cached h;                // [T, D] input of q_a_proj / kv_a_proj (q_proj): recomputed for W
    Tensor cq, rstd_q;       // [T, rq] q_a_proj output (q_a_layernorm input), [T]
    Cached cqn;              // [T, rq] input of q_b_proj: recomputed in B, kept for W
    Tensor ckv, rstd_kv;     // [T, rkv + dr] kv_a_proj_with_mqa output, [T] kv_a_layernorm
    Cached ckvn;             // [T, rkv] input of kv_b_proj: recomputed in B, kept for W
    Cached o;                // [T, H*dv] attention output = o_proj input
    Tensor lse;              // [H, T]
    // Output gradients kept from B for W: the Linears' (as their Wgrads read them), the norms'.
    WgradDy dy, dq, dcq, dkv, dckv;
    Tensor dcqn, dckvn, dh;
  };

  // q [T, H*dqk] and kv [T, H*(dn+dv)] from the cached Linear inputs (the up-projections), then
  // Q, K, V [T, H, *] with RoPE applied.
  void build_qkv(const Batch& b, State& s, Tensor& Q, Tensor& K, Tensor& V) {
    const int64_t T = s.x.size(0);
    Q = c_.empty({T, H_, dqk_});
    K = c_.empty({T, H_, dqk_});
    V = c_.empty({T, H_, dv_});
    linear_forward(c_, q_a_ ? s.cqn : s.h, *q_b_, reshaped(Q, {T, H_ * dqk_}), c_.recipe.linear);
    c_.be.rope(Q.view(), dn_, dr_, b.positions.view(), c_.cfg.rope_theta, false);
    Tensor kv = c_.empty({T, H_ * (dn_ + dv_)});
    linear_forward(c_, s.ckvn, *kv_b_, kv, c_.recipe.linear);
    // Every head's k_nope and v, and the shared RoPE key (rotated) into every head.
    c_.be.mla_split_kv(kv.view(), s.ckv.view(), rkv_, b.positions.view(), c_.cfg.rope_theta, K.view(), V.view());
  }

  // The RMSNorm outputs as the Linears read them, recomputed from the kept norm inputs: h (the
  // layer's norm) and/or the latents' cqn and ckvn, as forward computed them (their rstd is
  // written again, to a scratch tensor: the same values).
  void recompute_norms(State& s, bool h, bool latents) {
    const int64_t T = s.x.size(0);
    const ScaleMode sm = c_.recipe.scale_mode;
    Tensor rstd = c_.empty({T});
    if (h) s.h = rmsnorm_linear_input(c_, norm_input(c_, s.x), *norm_, rstd, sm);
    if (!latents) return;
    if (q_a_) s.cqn = rmsnorm_linear_input(c_, s.cq, *q_a_norm_, rstd, sm);
    Tensor ckv_c = c_.empty({T, rkv_});
    c_.be.copy_cols(s.ckv.view(), 0, ckv_c.view(), 0, rkv_, false);
    s.ckvn = rmsnorm_linear_input(c_, ckv_c, *kv_a_norm_, rstd, sm);
  }

  std::unique_ptr<Saved> forward(const Batch& b, const Tensor& x, Tensor& y) override {
    auto s = std::make_unique<State>();
    const int64_t T = x.size(0), D = x.size(1);
    const ScaleMode sm = c_.recipe.scale_mode;
    s->x = keep_residual(c_, x);
    s->rstd = c_.empty({T});
    s->h = rmsnorm_linear_input(c_, norm_input(c_, s->x), *norm_, s->rstd, sm);
    if (q_a_) {
      const int64_t rq = q_a_->weight.size(0);
      s->cq = c_.empty({T, rq});
      linear_forward(c_, s->h, *q_a_, s->cq, c_.recipe.linear);
      s->rstd_q = c_.empty({T});
      s->cqn = rmsnorm_linear_input(c_, s->cq, *q_a_norm_, s->rstd_q, sm);
    }
    s->ckv = c_.empty({T, rkv_ + dr_});
    linear_forward(c_, s->h, *kv_a_, s->ckv, c_.recipe.linear);
    Tensor ckv_c = c_.empty({T, rkv_});
    c_.be.copy_cols(s->ckv.view(), 0, ckv_c.view(), 0, rkv_, false);
    s->rstd_kv = c_.empty({T});
    s->ckvn = rmsnorm_linear_input(c_, ckv_c, *kv_a_norm_, s->rstd_kv, sm);

    Tensor Q, K, V;
    build_qkv(b, *s, Q, K, V);
    Tensor O = c_.empty({T, H_, dv_});
    s->lse = c_.empty({H_, T});
    c_.be.attention_forward(Q.view(), K.view(), V.view(), O.view(), s->lse.view(), b.seq, scale_,
                           c_.recipe.attn_compute);
    // The attention-out Linear input: E5M6 with power-of-two scales in the FP8 recipes.
    s->o = linear_input(c_, reshape(O.view(), {T, H_ * dv_}), c_.recipe.pow2_mode, c_.recipe.attn_out_cache);
    Tensor out = c_.empty({T, D});
    linear_forward(c_, s->o, *o_, out, c_.recipe.linear);
    c_.be.axpy(1.0, x.view(), 1.0, out.view());  // the residual, into the sublayer output
    y = out;
    s->h.reset();
    s->cqn.reset();
    s->ckvn.reset();

    auto& k = s->kept;
    k.push_back(account_item(name_, "x", s->x.view()));
    k.push_back(account_item(name_, "rstd", s->rstd.view()));
    if (q_a_) {
      k.push_back(account_item(name_, "q_a_out", s->cq.view()));
      k.push_back(account_item(name_, "rstd_q", s->rstd_q.view()));
    }
    k.push_back(account_item(name_, "kv_a_out", s->ckv.view()));
    k.push_back(account_item(name_, "rstd_kv", s->rstd_kv.view()));
    s->o.account(k, name_, "attn_out");
    k.push_back(account_item(name_, "lse", s->lse.view()));
    return s;
  }

  void backward_input(const Batch& b, Saved& saved, const Tensor& dy, Tensor& dx) override {
    auto& s = static_cast<State&>(saved);
    const int64_t T = dy.size(0), D = dy.size(1);
    const LinearPrecision prec = c_.recipe.linear;
    Tensor dO = c_.empty({T, H_, dv_});
    s.dy = linear_backward_input(c_, dy, *o_, reshaped(dO, {T, H_ * dv_}), false, prec);
    recompute_norms(s, /*h=*/!q_a_, /*latents=*/true);
    Tensor Q, K, V;
    build_qkv(b, s, Q, K, V);  // recomputation of the up-projections
    Tensor O = s.o.restore(c_);  // [T, H*dv]
    Tensor dQ = c_.empty({T, H_, dqk_}), dK = c_.empty({T, H_, dqk_}), dV = c_.empty({T, H_, dv_});
    c_.be.attention_backward(Q.view(), K.view(), V.view(), reshape(O.view(), {T, H_, dv_}), s.lse.view(), dO.view(),
                             dQ.view(), dK.view(), dV.view(), b.seq, scale_, c_.recipe.attn_compute);
    // RoPE backward: the inverse rotation of the gradient.
    c_.be.rope(dQ.view(), dn_, dr_, b.positions.view(), c_.cfg.rope_theta, true);
    const Tensor dq = reshaped(dQ, {T, H_ * dqk_});  // [T, H, dqk] row-major is [T, H*dqk]
    // dkv = [dK's k_nope | dV] of every head; the shared key's gradient (summed over the heads,
    // rotated back) into dckv's last dr columns, its latent's gradient below.
    Tensor dkv = c_.empty({T, H_ * (dn_ + dv_)}), dckv = c_.empty({T, rkv_ + dr_});
    c_.be.mla_split_kv_backward(dK.view(), dV.view(), b.positions.view(), c_.cfg.rope_theta, dkv.view(), dckv.view(), rkv_);

    s.dh = c_.empty({T, D});  // written by the first Dgrad below, then accumulated into
    if (q_a_) {
      const int64_t rq = q_a_->weight.size(0);
      s.dcqn = c_.empty({T, rq});
      s.dq = linear_backward_input(c_, dq, *q_b_, s.dcqn, false, prec);
      Tensor dcq = c_.empty({T, rq});
      c_.be.rmsnorm_backward(s.cq.view(), q_a_norm_->weight.view(), s.rstd_q.view(), s.dcqn.view(), dcq.view(),
                             TensorView(), false);
      s.dcq = linear_backward_input(c_, dcq, *q_a_, s.dh, false, prec);
    } else {
      s.dq = linear_backward_input(c_, dq, *q_b_, s.dh, false, prec);
    }
    s.dckvn = c_.empty({T, rkv_});
    s.dkv = linear_backward_input(c_, dkv, *kv_b_, s.dckvn, false, prec);
    Tensor ckv_c = c_.empty({T, rkv_});
    c_.be.copy_cols(s.ckv.view(), 0, ckv_c.view(), 0, rkv_, false);
    Tensor dckv_c = c_.empty({T, rkv_});
    c_.be.rmsnorm_backward(ckv_c.view(), kv_a_norm_->weight.view(), s.rstd_kv.view(), s.dckvn.view(), dckv_c.view(),
                           TensorView(), false);
    c_.be.copy_cols(dckv_c.view(), 0, dckv.view(), 0, rkv_, false);
    s.dckv = linear_backward_input(c_, dckv, *kv_a_, s.dh, true, prec);
    dx = clone(c_, dy.view());
    c_.be.rmsnorm_backward(norm_input(c_, s.x).view(), norm_->weight.view(), s.rstd.view(), s.dh.view(), dx.view(),
                           TensorView(), true);
  }

  void backward_weight(const Batch&, Saved& saved) override {
    auto& s = static_cast<State&>(saved);
    const LinearPrecision prec = c_.recipe.linear;
    if (!s.h.defined()) recompute_norms(s, /*h=*/true, /*latents=*/false);
    linear_backward_weight(c_, s.o, s.dy, *o_, prec);
    if (q_a_) {
      linear_backward_weight(c_, s.cqn, s.dq, *q_b_, prec);
      c_.be.rmsnorm_backward(s.cq.view(), q_a_norm_->weight.view(), s.rstd_q.view(), s.dcqn.view(), TensorView(),
                             q_a_norm_->grad.view(), false);
      linear_backward_weight(c_, s.h, s.dcq, *q_a_, prec);
    } else {
      linear_backward_weight(c_, s.h, s.dq, *q_b_, prec);
    }
    linear_backward_weight(c_, s.ckvn, s.dkv, *kv_b_, prec);
    const int64_t T = s.x.size(0);
    Tensor ckv_c = c_.empty({T, rkv_});
    c_.be.copy_cols(s.ckv.view(), 0, ckv_c.view(), 0, rkv_, false);
    c_.be.rmsnorm_backward(ckv_c.view(), kv_a_norm_->weight.view(), s.rstd_kv.view(), s.dckvn.view(), TensorView(),
                           kv_a_norm_->grad.view(), false);
    linear_backward_weight(c_, s.h, s.dckv, *kv_a_, prec);
    c_.be.rmsnorm_backward(norm_input(c_, s.x).view(), norm_->weight.view(), s.rstd.view(), s.dh.view(), TensorView(),
                           norm_->grad.view(), false);
    s = State{};
  }

 private:
  Ctx& c_;
  std::string name_;
  Parameter *norm_ = nullptr, *q_a_ = nullptr, *q_a_norm_ = nullptr, *q_b_ = nullptr;
  Parameter *kv_a_ = nullptr, *kv_a_norm_ = nullptr, *kv_b_ = nullptr, *o_ = nullptr;
  int64_t H_, dn_, dr_, dv_, dqk_, rkv_;
  double scale_;
};

}  // namespace

std::unique_ptr<Layer> make_attention_layer(Ctx& c, int64_t layer, const ParamLookup& get) {
  return std::make_unique<AttentionLayer>(c, layer, get);
}

}  // namespace fp8moe::model
