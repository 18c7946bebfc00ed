// The DeepSeek-V3-mini Model: parameters by Hugging Face name, the trunk of attention and MLP/MoE
// sublayers, embedding, output head with cross-entropy, the depth-1 MTP module sharing embedding
// and head, forward_backward over one micro-batch, and the auxiliary-loss-free bias update.
//
// MTP (DeepSeek-V3 §2.2), for position t of a sequence:
//   h'_t = eh_proj([enorm(embed(token t+1)); hnorm(h_t)])   (h_t: the main trunk output, pre-norm)
//   then one transformer block (layers.L), shared_head.norm and the shared lm_head predict token t+2.
// Its loss (mean over positions that have a t+2 in the sequence) enters with mtp_loss_weight.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <random>

#include "model_internal.hpp"

namespace fp8moe {

using model::Cached;
using model::Ctx;

int64_t MemoryAccount::total_bytes() const {
  int64_t n = 0;
  for (const auto& i : items) n += i.bytes;
  return n;
}

std::map<std::string, int64_t> MemoryAccount::bytes_per_layer() const {
  std::map<std::string, int64_t> m;
  for (const auto& i : items) m[i.layer] += i.bytes;
  return m;
}

bool StageShard::whole() const {
  return embedding && head && std::find(sublayers.begin(), sublayers.end(), false) == sublayers.end();
}

bool StageShard::holds(const ModelConfig& cfg, std::string_view name) const {
  if (name == "model.embed_tokens.weight") return embedding || (head && cfg.num_nextn_predict_layers > 0);
  if (name == "model.norm.weight" || name == "lm_head.weight") return head;
  constexpr std::string_view layers = "model.layers.";
  FP8MOE_CHECK(name.starts_with(layers), "model: no parameter named '" << name << "'");
  const size_t dot = name.find('.', layers.size());
  FP8MOE_CHECK(dot != std::string_view::npos, "model: no parameter named '" << name << "'");
  const int64_t l = std::stoll(std::string(name.substr(layers.size(), dot - layers.size())));
  if (l >= cfg.num_hidden_layers) return head;
  if (sublayers.empty()) return true;
  const std::string_view rest = name.substr(dot + 1);
  const bool attention = rest.starts_with("input_layernorm.") || rest.starts_with("self_attn.");
  return sublayers[size_t(2 * l + (attention ? 0 : 1))];
}

struct Model::Impl {
  ModelConfig cfg;
  Recipe recipe;
  Backend& be;
  Ctx ctx;
  std::vector<Parameter> params;
  std::vector<size_t> spec_of;  // of each parameter: its place in parameter_specs (the init order)
  std::map<std::string, size_t, std::less<>> index;
  std::vector<std::unique_ptr<Layer>> trunk;  // [layer 0 attn, layer 0 mlp|moe, ...]
  std::vector<std::unique_ptr<Layer>> mtp;    // the MTP block's two sublayers
  Parameter *embed = nullptr, *norm = nullptr, *head = nullptr;
  Parameter *enorm = nullptr, *hnorm = nullptr, *eh = nullptr, *mtp_norm = nullptr;
  Tensor last_logits;
  MemoryAccount memory;
  std::shared_ptr<RoutedExperts> routed;  // set_routed_experts
  // The gradient storage, each block once: a parameter's own, or a stack of routed experts'.
  std::vector<Tensor> grad_blocks;
  bool recording = false;  // record_sublayers
  // Inside forward_backward: the MTP module's kept tensors join the trunk's in `memory`. Outside
  // (head_forward_backward alone, once per micro-batch in a pipeline) each call replaces it.
  bool accounting = false;
  std::vector<std::pair<std::string, Tensor>> records;

  StageShard stages;                          // the parts held (Model's constructor)

  Impl(const ModelConfig& c, const Recipe& r, Backend& b) : cfg(c), recipe(r), be(b), ctx{be, recipe, cfg} {}

  // A parameter the part running needs: a clear error where a stage shard left it out.
  Parameter* held(const char* part, Parameter* p) {
    FP8MOE_CHECK(p, "model: " << part << " is not held by this stage shard");
    return p;
  }
  Parameter* find(const std::string& name) {
    auto it = index.find(name);
    return it == index.end() ? nullptr : &params[it->second];
  }

  // Embedding, trunk forward, head (+ MTP) and, when backward, the trunk's B and W in reverse.
  StepStats run(Model& model, const TensorView& tokens, const TensorView& targets, double grad_scale, bool backward);

  // Host copies for record_sublayers: sub.<i>.<layer>.<what>.
  void record(size_t i, const std::string& layer, const char* what, const Tensor& t) {
    if (!recording) return;
    Tensor h = Tensor::host_like(t.view());
    be.copy(h.view(), t.view());
    be.synchronize();
    records.emplace_back("sub." + std::to_string(i) + "." + layer + "." + what, std::move(h));
  }
  void record(size_t i, const std::string& layer, const char* what, double v) {
    if (!recording) return;
    Tensor h = Tensor::host(DType::f64, {1});
    h.ptr<double>()[0] = v;
    records.emplace_back("sub." + std::to_string(i) + "." + layer + "." + what, std::move(h));
  }

  LinearPrecision head_prec() const { return recipe.head_bf16 ? LinearPrecision::bf16 : LinearPrecision::full; }

  Parameter* get(const std::string& name) {
    auto it = index.find(name);
    FP8MOE_CHECK(it != index.end(), "model: no parameter named '" << name << "'");
    return &params[it->second];
  }

  // Final norm + head + cross-entropy over `targets` (`count` of them not ignored, at least 1);
  // adds d loss / d h into dh when backward; the sum of the per-token losses into sum [1] f64.
  void head_loss(const Tensor& h, Parameter& norm_w, const Tensor& targets, int64_t count, double weight,
                 double grad_scale, bool backward, const Tensor& dh, Tensor* logits_out, const TensorView& sum) {
    const int64_t T = h.size(0), D = h.size(1), V = cfg.vocab_size;
    Tensor rstd = ctx.empty({T}), hn = ctx.empty({T, D});
    model::rmsnorm(ctx, h, norm_w, hn, rstd);
    const Cached hin = model::cache_activation(ctx, hn.view(), DType::e4m3, ScaleMode::fp32, false, head_prec());
    Tensor logits = ctx.empty({T, V});
    model::linear_forward(ctx, hin, *head, logits, head_prec());
    if (logits_out) *logits_out = logits;
    const double n = double(count);
    Tensor losses = ctx.empty({T});
    Tensor dlogits = backward ? ctx.empty({T, V}) : Tensor();
    be.cross_entropy(logits.view(), targets.view(), losses.view(), backward ? dlogits.view() : TensorView(),
                     grad_scale * weight / n);
    be.sum_in_order(losses.view(), sum);
    if (backward) {
      Tensor dhn = ctx.empty({T, D});
      const model::WgradDy dl = model::linear_backward_input(ctx, dlogits, *head, dhn, false, head_prec());
      model::linear_backward_weight(ctx, hin, dl, *head, head_prec());
      be.rmsnorm_backward(h.view(), norm_w.weight.view(), rstd.view(), dhn.view(), dh.view(), norm_w.grad.view(), true);
    }
  }

  // eh_proj's input [enorm(embed(ids)); hnorm(h)] as the Linear caches it, from the token ids and
  // the MTP's kept trunk output hk; writes the norms' rstd and, when asked, the embedding e.
  // Deterministic, so the backward recomputes it bit for bit instead of keeping it.
  Cached mtp_eh_input(const Tensor& ids, const Tensor& hk, const Tensor& rstd_e, const Tensor& rstd_h, Tensor* e_out) {
    const int64_t T = ids.size(0), D = cfg.hidden_size;
    Tensor e = ctx.empty({T, D}), en = ctx.empty({T, D}), hn = ctx.empty({T, D});
    be.embedding_forward(ids.view(), embed->weight.view(), e.view());
    model::rmsnorm(ctx, e, *enorm, en, rstd_e);
    model::rmsnorm(ctx, model::norm_input(ctx, hk), *hnorm, hn, rstd_h);
    Tensor cat = ctx.empty({T, 2 * D});
    be.copy_cols(en.view(), 0, cat.view(), 0, D, false);
    be.copy_cols(hn.view(), 0, cat.view(), D, D, false);
    if (e_out) *e_out = e;
    return model::linear_input(ctx, cat.view(), recipe.scale_mode);
  }

  // The MTP module on the trunk output h [T, D]; adds its gradient into dh. It keeps h as the
  // sublayers keep their inputs (Recipe::residual_cache: BF16 in the FP8 recipes, hnorm then reads
  // bf16(h) in forward too), the token ids and the norms' rstd; the embedding and eh_proj's input
  // are recomputed for the backward (as the sublayers recompute their norm outputs). h is taken
  // by value and released once the kept copy exists: the caller passes the trunk output over, so
  // that in the FP8 recipes its FP32 storage goes before the MTP block runs.
  void mtp_forward_backward(const Batch& b, Tensor h, const Tensor& dh, bool backward) {
    const int64_t T = h.size(0), D = h.size(1);
    const std::string L = "layers." + std::to_string(cfg.num_hidden_layers) + ".eh";
    const Tensor& ids = b.mtp_ids;
    // Sublayer numbers of the records: the trunk's, the main head, then eh, the block, the head.
    const size_t sub = trunk.size() + 1;
    const Tensor hk = model::keep_residual(ctx, h);
    record(sub, L, "x", h);
    h = Tensor();
    Tensor rstd_e = ctx.empty({T}), rstd_h = ctx.empty({T}), x = ctx.empty({T, D});
    model::linear_forward(ctx, mtp_eh_input(ids, hk, rstd_e, rstd_h, nullptr), *eh, x, recipe.linear);
    record(sub, L, "y", x);
    const std::vector<MemoryItem> kept{model::account_item(L, "h", hk.view()), model::account_item(L, "ids", ids.view()),
                                       model::account_item(L, "rstd_e", rstd_e.view()),
                                       model::account_item(L, "rstd_h", rstd_h.view())};
    std::vector<std::unique_ptr<Saved>> saved;
    for (auto& layer : mtp) {
      Tensor y;
      record(sub + 1 + saved.size(), layer->name(), "x", x);
      saved.push_back(layer->forward(b, x, y));
      record(sub + saved.size(), layer->name(), "y", y);
      x = y;
    }
    if (backward) {
      memory.items.insert(memory.items.end(), kept.begin(), kept.end());
      for (auto& s : saved) memory.items.insert(memory.items.end(), s->kept.begin(), s->kept.end());
    }
    for (size_t i = 0; recording && i < mtp.size(); ++i)
      if (cfg.is_moe_layer(cfg.num_hidden_layers + int64_t(i) / 2) && i % 2 == 1)
        record(sub + 1 + i, mtp[i]->name(), "aux", mtp[i]->aux_loss(*saved[i]));
    Tensor dx = ctx.zeros({T, D}), logits;  // zero-filled: head_loss adds its gradient into it
    head_loss(x, *mtp_norm, b.mtp_targets, b.mtp_count, cfg.mtp_loss_weight, b.grad_scale, backward, dx,
              recording ? &logits : nullptr, model::rows_view(b.stats.view(), 1, 1));
    const size_t head_sub = sub + 1 + mtp.size();
    const std::string head_name = "layers." + std::to_string(cfg.num_hidden_layers) + ".shared_head";
    record(head_sub, head_name, "x", x);
    record(head_sub, head_name, "y", logits);
    if (recording) record(head_sub, head_name, "loss", loss_of(b, 1));
    if (!backward) return;
    record(head_sub, head_name, "dx", dx);
    for (size_t i = mtp.size(); i-- > 0;) {
      Tensor dprev;
      record(sub + 1 + i, mtp[i]->name(), "dy", dx);
      mtp[i]->backward_input(b, *saved[i], dx, dprev);
      mtp[i]->backward_weight(b, *saved[i]);
      record(sub + 1 + i, mtp[i]->name(), "dx", dprev);
      dx = dprev;
    }
    record(sub, L, "dy", dx);
    Tensor dcat = ctx.empty({T, 2 * D});
    const model::WgradDy deh = model::linear_backward_input(ctx, dx, *eh, dcat, false, recipe.linear);
    {
      // eh_proj's input and the embedding recomputed as forward made them (rstd again, the same).
      Tensor e;
      const Cached catin = mtp_eh_input(ids, hk, ctx.empty({T}), ctx.empty({T}), &e);
      model::linear_backward_weight(ctx, catin, deh, *eh, recipe.linear);
      Tensor den = ctx.empty({T, D}), de = ctx.empty({T, D});
      be.copy_cols(dcat.view(), 0, den.view(), 0, D, false);
      be.rmsnorm_backward(e.view(), enorm->weight.view(), rstd_e.view(), den.view(), de.view(), enorm->grad.view(), false);
      be.embedding_backward(ids.view(), de.view(), embed->grad.view());
    }
    Tensor dhn = ctx.empty({T, D});
    be.copy_cols(dcat.view(), D, dhn.view(), 0, D, false);
    const Tensor hx = model::norm_input(ctx, hk);
    be.rmsnorm_backward(hx.view(), hnorm->weight.view(), rstd_h.view(), dhn.view(), dh.view(), hnorm->grad.view(), true);
    if (recording) {  // eh's own share of dh, computed once more on its own
      Tensor dh_eh = ctx.empty({T, D});
      be.rmsnorm_backward(hx.view(), hnorm->weight.view(), rstd_h.view(), dhn.view(), dh_eh.view(), TensorView(), false);
      record(sub, L, "dx", dh_eh);
    }
  }

  // A head's mean loss read back from b.stats (records only).
  double loss_of(const Batch& b, int64_t at) {
    return be.to_host(model::rows_of(b.stats, at, 1)).ptr<double>()[0] / double(at == 0 ? b.main_count : b.mtp_count);
  }

  // The main head, then the MTP module, on the trunk output h; returns d loss / d h.
  Tensor heads(const Batch& b, Tensor h, double grad_scale, bool backward) {
    Tensor dh = ctx.zeros({h.size(0), h.size(1)});  // zero-filled: the heads add their gradients into it
    head_loss(h, *norm, b.targets, b.main_count, 1.0, grad_scale, backward, dh, &last_logits,
              model::rows_view(b.stats.view(), 0, 1));
    const size_t sub = trunk.size();
    record(sub, "head", "x", h);
    record(sub, "head", "y", last_logits);
    if (recording) record(sub, "head", "loss", loss_of(b, 0));
    if (backward) record(sub, "head", "dx", dh);
    if (cfg.num_nextn_predict_layers > 0) mtp_forward_backward(b, std::move(h), dh, backward);
    return dh;
  }
};

Model::Model(const ModelConfig& cfg, const Recipe& recipe, Backend& backend, uint64_t seed, ExpertShard shard,
             StageShard stages)
    : impl_(std::make_unique<Impl>(cfg, recipe, backend)) {
  validate_config(cfg, recipe);
  FP8MOE_CHECK(recipe.act_dtype != DType::f64 || backend.device() == Device::cpu,
               "recipe fp64 runs on the cpu backend only (backend " << backend.name() << ")");
  if (shard.count == 0) shard = {0, cfg.n_routed_experts};
  FP8MOE_CHECK(shard.first >= 0 && shard.count >= 0 && shard.first + shard.count <= cfg.n_routed_experts &&
                   (shard.count > 0 || cfg.n_routed_experts == 0),
               "model: routed experts [" << shard.first << ", " << shard.first + shard.count << ") are not among the "
                                         << cfg.n_routed_experts << " of the config");
  FP8MOE_CHECK(stages.sublayers.empty() || int64_t(stages.sublayers.size()) == 2 * cfg.num_hidden_layers,
               "model: a stage shard of " << stages.sublayers.size() << " sublayers for a trunk of "
                                          << 2 * cfg.num_hidden_layers);
  auto& m = *impl_;
  m.ctx.experts = shard;
  m.stages = std::move(stages);
  // The routed experts' matrices of one layer and kind share one [E * rows, cols] weight and one
  // gradient tensor (E: the experts held), each expert's Parameter viewing its rows: the grouped
  // GEMMs read the weights stacked and write the gradients stacked.
  std::map<std::string, std::pair<Tensor, Tensor>> stacks;
  const auto specs = model::parameter_specs(cfg);
  for (size_t i = 0; i < specs.size(); ++i) {
    const model::ParamSpec& s = specs[i];
    Parameter p;
    p.name = s.name;
    const DType dt = recipe.act_dtype;
    if (!m.stages.holds(cfg, s.name)) continue;
    const size_t at = s.name.find(".mlp.experts.");
    if (at != std::string::npos) {
      const size_t e0 = at + 13, e1 = s.name.find('.', e0);
      const int64_t e = std::stoll(s.name.substr(e0, e1 - e0)) - shard.first, E = shard.count, R = s.shape[0];
      if (e < 0 || e >= E) continue;
      auto& st = stacks[s.name.substr(0, e0) + "*" + s.name.substr(e1)];
      if (!st.first.defined()) {
        st = {backend.zeros(dt, {E * R, s.shape[1]}), backend.zeros(dt, {E * R, s.shape[1]})};
        m.grad_blocks.push_back(st.second);
      }
      p.weight = model::rows_of(st.first, e * R, R);
      p.grad = model::rows_of(st.second, e * R, R);
    } else if (s.shape.size() == 1) {
      p.weight = backend.zeros(dt, {s.shape[0]});
      p.grad = backend.zeros(dt, {s.shape[0]});
      m.grad_blocks.push_back(p.grad);
    } else {
      p.weight = backend.zeros(dt, {s.shape[0], s.shape[1]});
      p.grad = backend.zeros(dt, {s.shape[0], s.shape[1]});
      m.grad_blocks.push_back(p.grad);
    }
    p.trainable = s.trainable;
    p.decay = s.decay;
    m.index[p.name] = m.params.size();
    m.spec_of.push_back(i);
    m.params.push_back(std::move(p));
  }
  const model::ParamLookup get = [&m](const std::string& n) { return m.get(n); };
  for (int64_t l = 0; l < cfg.num_layers_total(); ++l) {
    const bool mtp = l >= cfg.num_hidden_layers;
    if (mtp && !m.stages.head) break;
    auto& dst = mtp ? m.mtp : m.trunk;
    const auto part = [&](int64_t i) { return mtp || m.stages.sublayers.empty() || m.stages.sublayers[size_t(i)]; };
    dst.push_back(part(2 * l) ? model::make_attention_layer(m.ctx, l, get) : nullptr);
    dst.push_back(!part(2 * l + 1)        ? nullptr
                  : cfg.is_moe_layer(l) ? model::make_moe_layer(m.ctx, l, get)
                                        : model::make_mlp_layer(m.ctx, l, get));
  }
  m.embed = m.find("model.embed_tokens.weight");
  m.norm = m.find("model.norm.weight");
  m.head = m.find("lm_head.weight");
  if (cfg.num_nextn_predict_layers > 0 && m.stages.head) {
    const std::string p = "model.layers." + std::to_string(cfg.num_hidden_layers) + ".";
    m.enorm = m.get(p + "enorm.weight");
    m.hnorm = m.get(p + "hnorm.weight");
    m.eh = m.get(p + "eh_proj.weight");
    m.mtp_norm = m.get(p + "shared_head.norm.weight");
  }
  init_weights(seed);
}

Model::~Model() = default;

const ModelConfig& Model::config() const { return impl_->cfg; }
const Recipe& Model::recipe() const { return impl_->recipe; }
Backend& Model::backend() const { return impl_->be; }
ExpertShard Model::expert_shard() const { return impl_->ctx.experts; }
const StageShard& Model::stage_shard() const { return impl_->stages; }
std::vector<Parameter>& Model::parameters() { return impl_->params; }
Parameter& Model::parameter(std::string_view name) { return *impl_->get(std::string(name)); }
Parameter* Model::find_parameter(std::string_view name) {
  auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &impl_->params[it->second];
}
int64_t Model::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : impl_->params) n += p.weight.numel();
  return n;
}
const Tensor& Model::last_logits() const { return impl_->last_logits; }
const MemoryAccount& Model::saved_memory() const { return impl_->memory; }
void Model::record_sublayers(bool on) {
  impl_->recording = on;
  impl_->records.clear();
}
const std::vector<std::pair<std::string, Tensor>>& Model::sublayer_records() const { return impl_->records; }

void Model::set_routed_experts(std::shared_ptr<RoutedExperts> r) {
  impl_->routed = std::move(r);
  impl_->ctx.routed = impl_->routed.get();
}

std::vector<Layer*> Model::trunk() {
  std::vector<Layer*> v;
  for (auto& l : impl_->trunk) v.push_back(l.get());
  return v;
}

void Model::init_weights(uint64_t seed) {
  auto& m = *impl_;
  const auto specs = model::parameter_specs(m.cfg);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, m.cfg.initializer_range);
  // Every parameter of the whole model draws its values in spec order, the absent experts' too,
  // so that an expert holds the same values in every shard.
  size_t next = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    auto draw = [&] {
      return specs[i].init == model::ParamSpec::normal ? nd(rng) : specs[i].init == model::ParamSpec::ones ? 1.0 : 0.0;
    };
    if (next == m.params.size() || m.spec_of[next] != i) {
      int64_t n = 1;
      for (int64_t d : specs[i].shape) n *= d;
      for (int64_t j = 0; j < n; ++j) draw();
      continue;
    }
    Parameter& p = m.params[next++];
    Tensor h = Tensor::host_like(p.weight.view());
    for (int64_t j = 0; j < h.numel(); ++j) {
      const double v = draw();
      if (h.dtype() == DType::f64) {
        h.ptr<double>()[j] = v;
      } else {
        h.ptr<float>()[j] = float(v);
      }
    }
    m.be.copy(p.weight.view(), h.view());
  }
}

void Model::set_mtp_loss_weight(double w) {
  FP8MOE_CHECK(std::isfinite(w) && w >= 0, "mtp_loss_weight must be finite and >= 0, got " << w);
  impl_->cfg.mtp_loss_weight = w;
}

void Model::zero_grad() {
  for (const Tensor& g : impl_->grad_blocks) impl_->be.zero(g.view());
}

int64_t Model::stats_width() const {
  const ModelConfig& c = impl_->cfg;
  int64_t moe = 0;
  for (int64_t l = 0; l < c.num_layers_total(); ++l) moe += c.is_moe_layer(l);
  return 2 + moe * (1 + c.n_routed_experts);
}

StepStats Model::step_stats(const Batch& b, const double* stats) const {
  const ModelConfig& c = impl_->cfg;
  StepStats st;
  st.tokens = b.tokens_count();
  st.main_loss = stats[0] / double(b.main_count);
  st.mtp_loss = stats[1] / double(b.mtp_count);
  // The balance losses summed in execution order onto 0, the MTP module's last.
  const double* at = stats + 2;
  for (int64_t l = 0; l < c.num_layers_total(); ++l) {
    if (!c.is_moe_layer(l)) continue;
    st.balance_loss += at[0];
    st.expert_loads.emplace_back(at + 1, at + 1 + c.n_routed_experts);
    at += 1 + c.n_routed_experts;
  }
  st.loss = st.main_loss + c.mtp_loss_weight * st.mtp_loss + st.balance_loss;
  return st;
}

Batch Model::make_batch(const TensorView& tokens, const TensorView& targets, const Tensor& stats) const {
  auto& m = *impl_;
  FP8MOE_CHECK(tokens.ndim == 2 && tokens.dtype == DType::i32, "tokens: expected [B, S] i32, got " << tokens.str());
  check_tensor(targets, "targets", DType::i32, 2);
  check_shape(targets, "targets", {tokens.size(0), tokens.size(1)});
  Batch b;
  b.batch = tokens.size(0);
  b.seq = tokens.size(1);
  const int64_t T = b.batch * b.seq;
  FP8MOE_CHECK(b.seq <= m.cfg.max_position_embeddings,
               "tokens: sequence length " << b.seq << " exceeds max_position_embeddings = " << m.cfg.max_position_embeddings);
  b.tokens = m.be.empty(DType::i32, {T});
  b.targets = m.be.empty(DType::i32, {T});
  m.be.copy(b.tokens.view(), reshape(tokens, {T}));
  m.be.copy(b.targets.view(), reshape(targets, {T}));
  Tensor pos = Tensor::host(DType::i32, {T});
  for (int64_t t = 0; t < T; ++t) pos.ptr<int32_t>()[t] = int32_t(t % b.seq);
  b.positions = model::to_backend(m.ctx, pos);
  // The heads' target counts and the MTP module's inputs and targets from a host copy of the
  // targets (the caller's, usually: no read-back), so that the step does not wait for the device.
  Tensor copy;
  if (targets.device != Device::cpu) copy = m.be.to_host(b.targets);
  const int32_t* next = copy.defined() ? copy.ptr<const int32_t>() : targets.ptr<const int32_t>();
  Tensor ids = Tensor::host(DType::i32, {T}), tg2 = Tensor::host(DType::i32, {T});
  int64_t main = 0, mtp = 0;
  for (int64_t t = 0; t < T; ++t) {  // MTP: input token t+1 (= targets[t]), target token t+2 in the sequence
    ids.ptr<int32_t>()[t] = next[t] >= 0 ? next[t] : 0;
    tg2.ptr<int32_t>()[t] = (t % b.seq < b.seq - 1 && next[t] >= 0) ? next[t + 1] : -1;
    main += next[t] >= 0;
    mtp += tg2.ptr<int32_t>()[t] >= 0;
  }
  b.main_count = std::max<int64_t>(main, 1);
  b.mtp_count = std::max<int64_t>(mtp, 1);
  if (m.cfg.num_nextn_predict_layers > 0) {
    b.mtp_ids = model::to_backend(m.ctx, ids);
    b.mtp_targets = model::to_backend(m.ctx, tg2);
  }
  const int64_t W = stats_width();
  if (stats.defined()) {
    FP8MOE_CHECK(stats.dtype() == DType::f64 && stats.view().ndim == 1 && stats.numel() == W &&
                     stats.device() == m.be.device(),
                 "make_batch: stats must be [" << W << "] f64 on the backend, got " << stats.view().str());
    b.stats = stats;
  } else {
    b.stats = m.be.zeros(DType::f64, {W});
  }
  return b;
}

Tensor Model::embed_forward(const Batch& b) {
  auto& m = *impl_;
  Tensor x = m.ctx.empty({b.tokens_count(), m.cfg.hidden_size});
  m.be.embedding_forward(b.tokens.view(), m.held("the embedding", m.embed)->weight.view(), x.view());
  return x;
}

void Model::embed_backward(const Batch& b, const Tensor& dx0) {
  impl_->be.embedding_backward(b.tokens.view(), dx0.view(), impl_->held("the embedding", impl_->embed)->grad.view());
}

Tensor Model::head_forward_backward(const Batch& b, const Tensor& h, double grad_scale, bool backward) {
  auto& m = *impl_;
  m.held("the head", m.head);
  if (!m.accounting && backward) m.memory = MemoryAccount{};
  return m.heads(b, h, grad_scale, backward);
}

std::shared_ptr<void> Model::share_weight_conversions() {
  return std::make_shared<model::WeightCache::Pass>(impl_->ctx.weights);
}

StepStats Model::Impl::run(Model& model, const TensorView& tokens, const TensorView& targets, double grad_scale,
                           bool backward) {
  Impl& m = *this;
  FP8MOE_CHECK(m.stages.whole(), "model: forward_backward and forward run the whole model; this one holds a stage shard "
                                 "(the pipeline executor runs it)");
  Batch b = model.make_batch(tokens, targets);
  b.grad_scale = grad_scale;
  if (backward) m.memory = MemoryAccount{};
  struct Accounting {
    bool& on;
    ~Accounting() { on = false; }
  } accounting{m.accounting};
  m.accounting = backward;
  m.records.clear();
  // A forward alone uses each weight once: nothing to share.
  std::optional<model::WeightCache::Pass> pass;
  if (backward) pass.emplace(m.ctx.weights);
  Tensor x = model.embed_forward(b);
  std::vector<std::unique_ptr<Saved>> saved;
  for (auto& layer : m.trunk) {
    Tensor y;
    m.record(saved.size(), layer->name(), "x", x);
    saved.push_back(layer->forward(b, x, y));
    m.record(saved.size() - 1, layer->name(), "y", y);
    x = y;
    if (backward) m.memory.items.insert(m.memory.items.end(), saved.back()->kept.begin(), saved.back()->kept.end());
  }
  for (size_t i = 0; m.recording && i < m.trunk.size(); ++i)
    if (i % 2 == 1 && m.cfg.is_moe_layer(int64_t(i) / 2)) m.record(i, m.trunk[i]->name(), "aux", m.trunk[i]->aux_loss(*saved[i]));
  // The trunk output passes to the heads, which release it once the MTP keeps its own copy.
  Tensor d = m.heads(b, std::move(x), grad_scale, backward);
  // What the step reports, read back once, after the whole step has been queued.
  const auto stats = [&] { return model.step_stats(b, be.to_host(b.stats).ptr<double>()); };
  if (!backward) return stats();
  for (size_t i = m.trunk.size(); i-- > 0;) {
    Tensor dx;
    m.record(i, m.trunk[i]->name(), "dy", d);
    m.trunk[i]->backward_input(b, *saved[i], d, dx);
    m.trunk[i]->backward_weight(b, *saved[i]);
    m.record(i, m.trunk[i]->name(), "dx", dx);
    saved[i].reset();
    d = dx;
  }
  model.embed_backward(b, d);
  return stats();
}

StepStats Model::forward_backward(const TensorView& tokens, const TensorView& targets, double grad_scale) {
  return impl_->run(*this, tokens, targets, grad_scale, true);
}

StepStats Model::forward(const TensorView& tokens, const TensorView& targets) {
  return impl_->run(*this, tokens, targets, 1.0, false);
}

void Model::update_routing_bias(const std::vector<std::vector<int64_t>>& loads, double gamma) {
  auto& m = *impl_;
  // Every MoE layer of the config in execution order (the trunk's, then the MTP module's), nullptr
  // where a stage shard leaves its bias out.
  std::vector<Parameter*> biases;
  for (int64_t l = 0; l < m.cfg.num_layers_total(); ++l)
    if (m.cfg.is_moe_layer(l))
      biases.push_back(m.find("model.layers." + std::to_string(l) + ".mlp.gate.e_score_correction_bias"));
  FP8MOE_CHECK(loads.size() == biases.size(), "update_routing_bias: loads has " << loads.size() << " layers, the model has "
                                                                             << biases.size() << " MoE layers");
  for (size_t l = 0; l < biases.size(); ++l) {
    if (!biases[l]) continue;
    const int64_t E = biases[l]->weight.numel();
    FP8MOE_CHECK(int64_t(loads[l].size()) == E, "update_routing_bias: loads[" << l << "] has " << loads[l].size()
                                                                             << " experts, expected " << E);
    double mean = 0;
    for (int64_t v : loads[l]) mean += double(v) / double(E);
    // The steps go to the device and are added there (y += 1 * x: one rounding, as on the host),
    // so that the update reads nothing back.
    Tensor h = Tensor::host_like(biases[l]->weight.view());  // [E]
    for (int64_t e = 0; e < E; ++e) {
      const double load = double(loads[l][size_t(e)]);
      const double step = gamma * (load < mean ? 1.0 : load > mean ? -1.0 : 0.0);
      if (h.dtype() == DType::f64) {
        h.ptr<double>()[e] = step;
      } else {
        h.ptr<float>()[e] = float(step);
      }
    }
    m.be.axpy(1.0, model::to_backend(m.ctx, h).view(), 1.0, biases[l]->weight.view());
  }
}

}  // namespace fp8moe
