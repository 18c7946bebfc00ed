// The inference engine (engine.hpp): weights uploaded once in the GEMMs' format, then per step the
// embedding, the layers (MLA over the paged latent cache; dense MLP or MoE) and the head of the
// last token of every chunk. Everything runs through the Backend; the host only builds index
// tables (positions, cache slots; the expert layout where the device does not build it, after a
// read-back of the routing) and receives the logits.
#include "serve/engine.hpp"

#include <algorithm>
#include <cmath>

#include "fp8moe/error.hpp"
#include "serve/views.hpp"

namespace fp8moe::serve {

namespace {

// One Linear y [T, N] = x [T, K] w^T in the engine's precision.
struct Linear {
  std::string name;
  int64_t N = 0, K = 0;
  Tensor w;           // [N, K] f32 (full) | bf16 (bf16)
  QuantizedTensor q;  // [N, K] e4m3, 128x128 blocks (fp8)
};

// A step's device checks deferred (immediate ones make the host wait for the device at every
// quantizer and index table), raised once its logits are read; where the caller deferred them
// already they are left to its next synchronize.
class StepChecks {
 public:
  explicit StepChecks(Backend& be) : be_(be), was_(be.checks()) { be_.set_checks(Backend::Checks::deferred); }
  ~StepChecks() {
    if (raised_) return;
    try {
      be_.set_checks(was_);
    } catch (const Error&) {  // the step is failing already: its own error is the one to report
    }
  }
  StepChecks(const StepChecks&) = delete;
  StepChecks& operator=(const StepChecks&) = delete;
  void raise() {
    raised_ = true;
    be_.set_checks(was_);
  }

 private:
  Backend& be_;
  Backend::Checks was_;
  bool raised_ = false;
};

// The most rows (G * M) a MoE layout built on the device may take: its M covers an expert getting
// every token, so past this the rows it pads out (written, and zeroed by the grouped GEMMs) cost
// more than the host's read of the routing saves.
constexpr int64_t kDeviceLayoutRows = 16384;

}  // namespace

struct Engine::Impl {
  const ModelConfig cfg;
  EngineOptions opt;
  Backend& be;
  LinearPrecision prec = LinearPrecision::full;
  bool head_bf16 = false;
  std::unique_ptr<LatentCache> cache;
  int64_t H, dn, dr, dv, dqk, rkv, D;
  double scale;

  struct Mlp {
    Linear gate, up, down;
  };
  struct Layer {
    Tensor in_norm, post_norm;          // [D] f32
    Linear q_a, q_b, kv_a, kv_b, o;     // q_a empty without q_lora (q_b is then q_proj)
    Tensor q_a_norm, kv_a_norm;         // [rq], [rkv] f32
    Tensor kv_b_f32;                    // [H * (dn + dv), rkv] f32: W_UK_h, W_UV_h for absorption
    Tensor wuk_t;                       // batch_invariant: [H * rkv, dn] f32, W_UK_h^T (the Linear form)
    bool moe = false;
    Mlp mlp;                            // dense MLP, or the shared expert of a MoE layer
    bool has_shared = false;
    Tensor gate_w, gate_bias;           // [E, D], [E] f32
    std::vector<Mlp> experts;           // G = E (+1 with shared_as_routed); full/bf16
    QuantizedTensor eg, eu, ed;         // fp8: [G * F, D], [G * F, D], [G * D, F] stacked
    QuantizedTensor pg, pu, pd;         // fp8 with redundant experts: the same by physical slot
  };
  std::vector<Layer> layers;
  Tensor embed;  // [V, D] f32
  Tensor norm;   // [D] f32
  Linear head;
  Tensor enorm, hnorm, mtp_norm;  // [D] f32: the MTP module's norms (layers[L] is its block)
  Linear eh;                      // [D, 2D] eh_proj
  // Redundant experts: moe_index[l], the trunk MoE layer's row in the placement (-1: none).
  std::vector<int64_t> moe_index;
  bool redundant = false;
  ExpertPlacement placement;
  ExpertLoads window;                             // [moe layer][expert], decayed at each rebalance
  std::vector<std::vector<int64_t>> gpu_tokens;   // [moe layer][virtual GPU]
  // [moe layer][expert] the copy the expert's next token goes to: kept across steps, since a
  // decode step brings an expert a token or two and a per-step turn would always pick copy 0.
  std::vector<std::vector<int64_t>> turn;
  // [moe layer] tokens per group [E (+1)] i64 of the layouts built on the device, not yet folded
  // into window and gpu_tokens (fold_device_loads).
  std::vector<Tensor> device_loads;
  int64_t steps = 0;

  Impl(const WeightSet& ws, Backend& b, const EngineOptions& o) : cfg(ws.cfg), opt(o), be(b) {
    validate_config(cfg);
    const std::string lin = opt.linear == "auto" ? (ws.recipe.rfind("fp8", 0) == 0 ? "fp8"
                                                    : ws.recipe == "bf16"          ? "bf16"
                                                                                   : "f32")
                                                 : opt.linear;
    FP8MOE_CHECK(lin == "f32" || lin == "bf16" || lin == "fp8",
                 "EngineOptions::linear: unknown '" << opt.linear << "' (expected auto, f32, bf16 or fp8)");
    prec = lin == "fp8" ? LinearPrecision::fp8 : lin == "bf16" ? LinearPrecision::bf16 : LinearPrecision::full;
    // The recipes that run Linears in BF16 or FP8 run the head in BF16 (Recipe::head_bf16).
    head_bf16 = prec != LinearPrecision::full;
    H = cfg.num_attention_heads;
    dn = cfg.qk_nope_head_dim;
    dr = cfg.qk_rope_head_dim;
    dv = cfg.v_head_dim;
    dqk = dn + dr;
    rkv = cfg.kv_lora_rank;
    D = cfg.hidden_size;
    scale = 1.0 / std::sqrt(double(dqk));
    FP8MOE_CHECK(!opt.shared_as_routed || cfg.n_shared_experts <= 1,
                 "EngineOptions::shared_as_routed needs n_shared_experts <= 1 (one expert of moe_intermediate_size), "
                 "got "
                     << cfg.n_shared_experts);
    load(ws);
    FP8MOE_CHECK(!opt.mtp || cfg.num_nextn_predict_layers > 0,
                 "EngineOptions::mtp: the model has no MTP module (num_nextn_predict_layers = 0)");
    cache = std::make_unique<LatentCache>(be, cfg.num_hidden_layers + (opt.mtp ? 1 : 0), opt.cache_blocks, rkv, dr,
                                          opt.cache);
    init_placement();
  }

  // ---- Redundant experts.
  void init_placement() {
    int64_t n = 0;
    for (int64_t l = 0; l < int64_t(layers.size()); ++l)
      moe_index.push_back(l < cfg.num_hidden_layers && layers[size_t(l)].moe ? n++ : -1);
    FP8MOE_CHECK(opt.expert_gpus >= 1 && opt.expert_nodes >= 1 && opt.rebalance_every >= 0,
                 "EngineOptions: expert_gpus and expert_nodes must be >= 1 and rebalance_every >= 0, got "
                     << opt.expert_gpus << ", " << opt.expert_nodes << ", " << opt.rebalance_every);
    FP8MOE_CHECK(opt.load_decay >= 0 && opt.load_decay <= 1,
                 "EngineOptions::load_decay must be in [0, 1], got " << opt.load_decay);
    const int64_t E = cfg.n_routed_experts;
    window.assign(size_t(n), std::vector<double>(size_t(E), 0.0));
    gpu_tokens.assign(size_t(n), std::vector<int64_t>(size_t(opt.expert_gpus), 0));
    redundant = opt.expert_slots > 0 && n > 0;
    for (int64_t i = 0; i < n && !redundant; ++i) device_loads.push_back(be.zeros(DType::i64, {E + (layers_extra() ? 1 : 0)}));
    if (!redundant) {
      if (n > 0) placement = identity_placement(n, E, opt.expert_nodes, opt.expert_gpus);
      return;
    }
    // Before any statistics: equal loads (the extra copies go to the lowest expert indices).
    set_placement(place_experts(ExpertLoads(size_t(n), std::vector<double>(size_t(E), 1.0)), shape()));
  }
  PlacementShape shape() const { return {opt.expert_slots, opt.expert_nodes, opt.expert_gpus, cfg.n_group}; }
  // Rows of the logical stack `src` ([groups * N, K], groups = E (+1)) for the slots' experts,
  // then the extra groups past E unchanged.
  QuantizedTensor by_slot(const QuantizedTensor& src, const std::vector<int32_t>& slot_expert) {
    const int64_t E = cfg.n_routed_experts, extra = layers_extra() ? 1 : 0;
    const int64_t N = src.values.size(0) / (E + extra), K = src.values.size(1), S = int64_t(slot_expert.size());
    QuantizedTensor d = be.empty_quantized((S + extra) * N, K, DType::e4m3, ScaleKind::block_128x128);
    const int64_t nb = N / kQuantGroup;
    for (int64_t s = 0; s < S + extra; ++s) {
      const int64_t e = s < S ? slot_expert[size_t(s)] : E + (s - S);
      be.copy(rows(d.values.view(), s * N, N), rows(src.values.view(), e * N, N));
      be.copy(rows(d.scales.view(), s * nb, nb), rows(src.scales.view(), e * nb, nb));
    }
    return d;
  }
  bool layers_extra() const { return opt.shared_as_routed && cfg.n_shared_experts > 0; }
  void set_placement(const ExpertPlacement& p) {
    FP8MOE_CHECK(redundant, "Engine::set_placement: the engine has no redundant experts (EngineOptions::expert_slots = 0)");
    const PlacementShape s = shape();
    FP8MOE_CHECK(p.layers == int64_t(window.size()) && p.experts == cfg.n_routed_experts && p.shape.slots == s.slots &&
                     p.shape.gpus == s.gpus && p.shape.nodes == s.nodes,
                 "Engine::set_placement: a placement of " << p.layers << " layers, " << p.experts << " experts, "
                     << p.shape.slots << " slots on " << p.shape.nodes << " x " << p.shape.gpus << " GPUs for an engine of "
                     << window.size() << ", " << cfg.n_routed_experts << ", " << s.slots << " on " << s.nodes << " x "
                     << s.gpus);
    placement = p;
    turn.assign(size_t(p.layers), std::vector<int64_t>(size_t(p.experts), 0));
    if (prec != LinearPrecision::fp8) return;  // the slots read the logical experts' weights
    for (size_t l = 0; l < layers.size(); ++l) {
      const int64_t ml = moe_index[l];
      if (ml < 0) continue;
      Layer& L = layers[l];
      L.pg = by_slot(L.eg, p.phy_to_log[size_t(ml)]);
      L.pu = by_slot(L.eu, p.phy_to_log[size_t(ml)]);
      L.pd = by_slot(L.ed, p.phy_to_log[size_t(ml)]);
    }
  }
  void rebalance() {
    if (!redundant) return;
    double seen = 0;
    for (const auto& row : window)
      for (double v : row) seen += v;
    if (seen == 0) return;
    set_placement(place_experts(window, shape()));
    for (auto& row : window)
      for (double& v : row) v *= opt.load_decay;
  }

  // ---- Loading.
  const Tensor& find(const WeightSet& ws, const std::string& name) const {
    const auto it = ws.tensors.find(name);
    FP8MOE_CHECK(it != ws.tensors.end(), "weights: missing tensor '" << name << "'");
    return it->second;
  }
  // A host f32 copy of a weight (FP8 ones dequantized with their block scales).
  Tensor host_f32(const WeightSet& ws, const std::string& name) const {
    const Tensor& t = find(ws, name);
    Tensor h = Tensor::host_like(t.view());
    be.copy(h.view(), t.view());  // any device to host
    be.synchronize();
    Tensor f = t.view().ndim == 1 ? Tensor::host(DType::f32, {t.size(0)}) : Tensor::host(DType::f32, {t.size(0), t.size(1)});
    if (h.dtype() == DType::e4m3) {
      const Tensor& s = find(ws, name + "_scale_inv");
      Tensor sh = Tensor::host_like(s.view());
      be.copy(sh.view(), s.view());
      fp8moe::dequantize(QuantizedView{h.view(), sh.view(), ScaleKind::block_128x128}, f.view());
    } else {
      for (int64_t i = 0; i < h.numel(); ++i) store_float(f.view(), i, load_float(h.view(), i));
    }
    return f;
  }
  Tensor upload(const Tensor& host) {
    Tensor d = host.view().ndim == 1 ? be.empty(host.dtype(), {host.size(0)})
                                     : be.empty(host.dtype(), {host.size(0), host.size(1)});
    be.copy(d.view(), host.view());
    return d;
  }
  Tensor vec(const WeightSet& ws, const std::string& name) { return upload(host_f32(ws, name)); }
  // The weight in the GEMMs' format; an exported E4M3 weight is used as it is (no requantization).
  Linear linear(const WeightSet& ws, const std::string& name, LinearPrecision p) {
    Linear L;
    L.name = name;
    const Tensor& t = find(ws, name);
    FP8MOE_CHECK(t.view().ndim == 2, "weights: '" << name << "' is " << t.view().str() << ", expected a matrix");
    L.N = t.size(0);
    L.K = t.size(1);
    if (p == LinearPrecision::fp8) {
      FP8MOE_CHECK(L.K % kQuantGroup == 0, name << ": FP8 needs in features (" << L.K << ") % 128 == 0");
      L.q = be.empty_quantized(L.N, L.K, DType::e4m3, ScaleKind::block_128x128);
      if (t.dtype() == DType::e4m3) {
        be.copy(L.q.values.view(), t.view());
        be.copy(L.q.scales.view(), find(ws, name + "_scale_inv").view());
      } else {
        const Tensor w = upload(host_f32(ws, name));
        be.quantize_128x128(w.view(), L.q, ScaleMode::fp32);
      }
      return L;
    }
    const Tensor w = upload(host_f32(ws, name));
    if (p == LinearPrecision::full) {
      L.w = w;
    } else {
      L.w = be.empty(DType::bf16, {L.N, L.K});
      be.convert(w.view(), L.w.view());
    }
    return L;
  }
  Mlp mlp(const WeightSet& ws, const std::string& pre) {
    return {linear(ws, pre + "gate_proj.weight", prec), linear(ws, pre + "up_proj.weight", prec),
            linear(ws, pre + "down_proj.weight", prec)};
  }
  // The G matrices stacked [G * N, K] with their block scales (N % 128 == 0: whole blocks).
  QuantizedTensor stack(const std::vector<const Linear*>& ls) {
    const int64_t N = ls[0]->N, K = ls[0]->K, G = int64_t(ls.size());
    FP8MOE_CHECK(N % kQuantGroup == 0, ls[0]->name << ": grouped FP8 GEMMs need out features (" << N << ") % 128 == 0");
    QuantizedTensor s = be.empty_quantized(G * N, K, DType::e4m3, ScaleKind::block_128x128);
    for (int64_t g = 0; g < G; ++g) {
      FP8MOE_CHECK(ls[size_t(g)]->N == N && ls[size_t(g)]->K == K,
                   ls[size_t(g)]->name << ": [" << ls[size_t(g)]->N << ", " << ls[size_t(g)]->K
                                       << "] differs from the other experts' [" << N << ", " << K << "]");
      be.copy(rows(s.values.view(), g * N, N), ls[size_t(g)]->q.values.view());
      be.copy(rows(s.scales.view(), g * N / kQuantGroup, N / kQuantGroup), ls[size_t(g)]->q.scales.view());
    }
    return s;
  }

  void load(const WeightSet& ws) {
    embed = vec(ws, "model.embed_tokens.weight");
    norm = vec(ws, "model.norm.weight");
    head = linear(ws, "lm_head.weight", head_bf16 ? LinearPrecision::bf16 : LinearPrecision::full);
    for (int64_t l = 0; l < cfg.num_hidden_layers + (opt.mtp ? 1 : 0); ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Layer L;
      L.in_norm = vec(ws, p + "input_layernorm.weight");
      L.post_norm = vec(ws, p + "post_attention_layernorm.weight");
      if (cfg.q_lora_rank > 0) {
        L.q_a = linear(ws, p + "self_attn.q_a_proj.weight", prec);
        L.q_a_norm = vec(ws, p + "self_attn.q_a_layernorm.weight");
        L.q_b = linear(ws, p + "self_attn.q_b_proj.weight", prec);
      } else {
        L.q_b = linear(ws, p + "self_attn.q_proj.weight", prec);
      }
      L.kv_a = linear(ws, p + "self_attn.kv_a_proj_with_mqa.weight", prec);
      L.kv_a_norm = vec(ws, p + "self_attn.kv_a_layernorm.weight");
      L.kv_b = linear(ws, p + "self_attn.kv_b_proj.weight", prec);
      // The absorption reads kv_b_proj as the expanded form's GEMM sees it (dequantized FP8 blocks).
      if (prec == LinearPrecision::fp8) {
        L.kv_b_f32 = f32({L.kv_b.N, L.kv_b.K});
        be.dequantize(L.kv_b.q, L.kv_b_f32.view());
      } else {
        L.kv_b_f32 = upload(host_f32(ws, p + "self_attn.kv_b_proj.weight"));
        if (prec == LinearPrecision::bf16) {  // the BF16 weight's values
          Tensor b = be.empty(DType::bf16, {L.kv_b.N, L.kv_b.K});
          be.convert(L.kv_b_f32.view(), b.view());
          be.convert(b.view(), L.kv_b_f32.view());
        }
      }
      if (opt.batch_invariant) {
        L.wuk_t = f32({H * rkv, dn});
        for (int64_t h = 0; h < H; ++h)
          be.transpose(rows(L.kv_b_f32.view(), h * (dn + dv), dn), rows(L.wuk_t.view(), h * rkv, rkv));
      }
      L.o = linear(ws, p + "self_attn.o_proj.weight", prec);
      L.moe = cfg.is_moe_layer(l);
      if (!L.moe) {
        L.mlp = mlp(ws, p + "mlp.");
      } else {
        L.gate_w = vec(ws, p + "mlp.gate.weight");
        L.gate_bias = vec(ws, p + "mlp.gate.e_score_correction_bias");
        for (int64_t e = 0; e < cfg.n_routed_experts; ++e)
          L.experts.push_back(mlp(ws, p + "mlp.experts." + std::to_string(e) + "."));
        if (cfg.n_shared_experts > 0) {
          Mlp s = mlp(ws, p + "mlp.shared_experts.");
          if (opt.shared_as_routed) L.experts.push_back(std::move(s));
          else {
            L.mlp = std::move(s);
            L.has_shared = true;
          }
        }
        if (prec == LinearPrecision::fp8) {
          std::vector<const Linear*> g, u, d;
          for (const Mlp& m : L.experts) {
            g.push_back(&m.gate);
            u.push_back(&m.up);
            d.push_back(&m.down);
          }
          L.eg = stack(g);
          L.eu = stack(u);
          L.ed = stack(d);
          L.experts.clear();  // the stacks hold the weights
        }
      }
      layers.push_back(std::move(L));
    }
    if (opt.mtp) {
      const std::string p = "model.layers." + std::to_string(cfg.num_hidden_layers) + ".";
      enorm = vec(ws, p + "enorm.weight");
      hnorm = vec(ws, p + "hnorm.weight");
      mtp_norm = vec(ws, p + "shared_head.norm.weight");
      eh = linear(ws, p + "eh_proj.weight", prec);
    }
  }

  // ---- Ops.
  Tensor f32(std::initializer_list<int64_t> shape) { return be.empty(DType::f32, shape); }
  Tensor i32(const std::vector<int32_t>& v) {
    Tensor h = Tensor::host(DType::i32, {int64_t(v.size())});
    std::copy(v.begin(), v.end(), h.ptr<int32_t>());
    return upload(h);
  }
  // y [T, N] f32 = x [T, K] w [N, K]^T, x and w f32 or bf16: through gemm_batch_invariant in a
  // step that EngineOptions::batch_invariant covers (x's rows are at most the step's).
  void linear_gemm(const TensorView& x, const TensorView& w, const TensorView& y) {
    if (opt.batch_invariant && x.size(0) <= kBatchInvariantRows) be.gemm_batch_invariant(x, w, y);
    else be.gemm(x, w, y, false, true, false);
  }
  // x [T, K] f32 as a Linear of L's format reads it: 1x128 E4M3 tiles with `mode` scales (fp8),
  // a BF16 copy (bf16) or x itself; made once where Linears share their input.
  struct LinearInput {
    TensorView x;
    QuantizedTensor q;
    Tensor b;
  };
  LinearInput linear_input(const Linear& L, const TensorView& x, ScaleMode mode = ScaleMode::fp32) {
    LinearInput in{x, {}, {}};
    const int64_t T = x.size(0);
    if (T == 0) return in;
    if (L.q.values.defined()) {
      in.q = be.empty_quantized(T, L.K, DType::e4m3, ScaleKind::tile_1x128);  // [T, K] 1x128
      be.quantize_1x128(x, in.q, mode);
    } else if (L.w.dtype() == DType::bf16) {
      in.b = be.empty(DType::bf16, {T, L.K});
      be.convert(x, in.b.view());
    }
    return in;
  }
  // y [T, N] f32 = x [T, K] w^T.
  Tensor apply(const Linear& L, const LinearInput& in) {
    const int64_t T = in.x.size(0);
    Tensor y = f32({T, L.N});
    if (T == 0) return y;
    if (L.q.values.defined()) be.gemm_fp8(in.q, L.q, y.view(), GemmOptions{});
    else linear_gemm(in.b.defined() ? in.b.view() : in.x, L.w.view(), y.view());
    return y;
  }
  Tensor run(const Linear& L, const TensorView& x, ScaleMode mode = ScaleMode::fp32) {
    return apply(L, linear_input(L, x, mode));
  }
  Tensor rmsnorm(const TensorView& x, const Tensor& w) {
    Tensor y = f32({x.size(0), x.size(1)}), rstd = f32({x.size(0)});
    be.rmsnorm_forward(x, w.view(), y.view(), rstd.view(), cfg.rms_norm_eps);
    return y;
  }
  Tensor cols(const TensorView& x, int64_t c0, int64_t n) {
    Tensor y = f32({x.size(0), n});
    be.copy_cols(x, c0, y.view(), 0, n, false);
    return y;
  }
  // out [T, D] = down(silu(gate(x)) * up(x)) for the first rows of x.
  Tensor mlp_forward(const Mlp& m, const TensorView& x, ScaleMode in_mode) {
    const LinearInput in = linear_input(m.gate, x, in_mode);
    const Tensor g = apply(m.gate, in), u = apply(m.up, in);
    Tensor a = f32({x.size(0), m.gate.N});
    be.swiglu_forward(g.view(), u.view(), a.view());
    return run(m.down, a.view());
  }

  // The attention-out Linear's input as the FP8 recipe's forward feeds it: rounded to E5M6 tiles
  // with power-of-two scales (the training cache this Linear reads its E4M3 tiles from), so the
  // served model is the trained one; the other precisions take O itself.
  // A sublayer's input as the FP8 recipes' training forward normalizes it: rounded through BF16
  // (Recipe::residual_cache); the residual stream itself stays FP32.
  Tensor norm_input(const Tensor& x) {
    if (prec != LinearPrecision::fp8) return x;
    Tensor b = be.empty(DType::bf16, {x.size(0), x.size(1)}), r = f32({x.size(0), x.size(1)});
    be.convert(x.view(), b.view());
    be.convert(b.view(), r.view());
    return r;
  }

  Tensor attn_out_input(const Tensor& O) {
    if (prec != LinearPrecision::fp8) return O;
    QuantizedTensor q = be.empty_quantized(O.size(0), O.size(1), DType::e5m6, ScaleKind::tile_1x128);
    be.quantize_1x128(O.view(), q, ScaleMode::pow2);
    Tensor r = f32({O.size(0), O.size(1)});
    be.dequantize(q, r.view());
    return r;
  }

  // ---- Attention of one layer: x [T, D] += o_proj(MLA(x)).
  struct StepRows {
    std::vector<int64_t> row0;  // first row of each chunk in the step's rows
    Tensor tokens;              // [T] i32
    Tensor positions;           // [T] i32
    std::vector<int64_t> slots; // [T] cache slot of each row
    Tensor slot_index;          // the same [T] i32 on the backend
    // The chunks whose tokens are decode rows, the B decode rows of the step and what every
    // layer's absorbed form takes: their rows in the step, block tables [B, max blocks] and
    // lengths [B] (the rows of one chunk share its table).
    std::vector<bool> decode;
    int64_t B = 0;
    Tensor dec_rows, dec_table, dec_lengths;
  };
  void attention(int64_t l, const std::vector<SeqChunk>& chunks, const StepRows& sr, const Tensor& x) {
    Layer& L = layers[size_t(l)];
    const int64_t T = x.size(0);
    const Tensor h = rmsnorm(norm_input(x).view(), L.in_norm);  // [T, D]
    const LinearInput hin = linear_input(L.kv_a, h.view());  // q_a (or q_proj) and kv_a read h
    Tensor q;                                                 // [T, H * dqk]
    if (L.q_a.N > 0) {
      const Tensor cq = apply(L.q_a, hin);
      q = run(L.q_b, rmsnorm(cq.view(), L.q_a_norm).view());
    } else {
      q = apply(L.q_b, hin);
    }
    be.rope(reshape(q.view(), {T, H, dqk}), dn, dr, sr.positions.view(), cfg.rope_theta, false);
    const Tensor ckv = apply(L.kv_a, hin);  // [T, rkv + dr]
    Tensor lat = rmsnorm(cols(ckv.view(), 0, rkv).view(), L.kv_a_norm);  // [T, rkv] kv_b_proj's input
    Tensor kpe = cols(ckv.view(), rkv, dr);                            // [T, dr], one head
    be.rope(reshape(kpe.view(), {T, 1, dr}), 0, dr, sr.positions.view(), cfg.rope_theta, false);
    cache->write(l, lat.view(), kpe.view(), sr.slots, sr.slot_index.view());

    // [T, H * dv] the attention output: every row written by one of the two forms.
    Tensor O = f32({T, H * dv});
    for (size_t c = 0; c < chunks.size(); ++c) {
      const SeqChunk& ch = chunks[c];
      if (sr.decode[c]) continue;
      if (!ch.decode) {
        expanded(L, l, ch, sr.row0[c], q, O);
        continue;
      }
      // Decode rows without the absorbed form: the prefill form one token at a time.
      for (int64_t i = 0; i < int64_t(ch.tokens.size()); ++i)
        expanded(L, l, SeqChunk{ch.table, ch.start + i, {ch.tokens[size_t(i)]}}, sr.row0[c] + i, q, O);
    }
    if (sr.B > 0) absorbed(L, l, sr, q, O);
    be.axpy(1.0, run(L.o, attn_out_input(O).view(), ScaleMode::pow2).view(), 1.0, x.view());
  }

  // The compute-friendly form for one chunk: K, V of all L = start + n positions expanded from
  // the cached latents, the chunk's queries at the last n of L causal rows.
  void expanded(Layer& Ly, int64_t l, const SeqChunk& c, int64_t r0, const Tensor& q, const Tensor& O) {
    const int64_t n = int64_t(c.tokens.size()), Lt = c.start + n;
    const Tensor all = cache->read(l, *c.table, Lt);
    const TensorView lat = rows(all.view(), 0, Lt);  // [L, rkv + dr]
    const Tensor kv = run(Ly.kv_b, cols(lat, 0, rkv).view());  // [L, H * (dn + dv)]
    const TensorView kvh = reshape(kv.view(), {Lt * H, dn + dv});
    Tensor K = f32({Lt, H, dqk}), V = f32({Lt, H, dv});
    const TensorView Kh = reshape(K.view(), {Lt * H, dqk});
    be.copy_cols(kvh, 0, Kh, 0, dn, false);
    be.copy_cols(kvh, dn, reshape(V.view(), {Lt * H, dv}), 0, dv, false);
    std::vector<int32_t> head_rows(size_t(Lt * H));
    for (int64_t i = 0; i < Lt * H; ++i) head_rows[size_t(i)] = int32_t(i / H);
    Tensor kpe = f32({Lt * H, dr});  // the shared RoPE key in every head
    be.gather_rows(cols(lat, rkv, dr).view(), i32(head_rows).view(), TensorView(), kpe.view());
    be.copy_cols(kpe.view(), 0, Kh, dn, dr, false);
    // Queries: zero rows for the prefix (their outputs are not used), the chunk's at the end.
    Tensor Q = be.zeros(DType::f32, {Lt, H, dqk});
    be.copy(rows(reshape(Q.view(), {Lt, H * dqk}), c.start, n), rows(q.view(), r0, n));
    Tensor Op = f32({Lt, H, dv}), lse = f32({H, Lt});
    be.attention_forward(Q.view(), K.view(), V.view(), Op.view(), lse.view(), Lt, scale, DType::f32);
    be.copy(rows(O.view(), r0, n), rows(reshape(Op.view(), {Lt, H * dv}), c.start, n));
  }

  // The absorbed form for the step's decode rows: q_lat_h = q_nope_h W_UK_h,
  // Backend::mla_decode_attention over the layer's cache for all B rows at once, then o_h =
  // o_lat_h W_UV_h^T. Each absorption is one batched GEMM over the heads, which reads and writes
  // every head where it lies in the token-major rows (head h at columns h * width), so a layer
  // issues the same few ops at any head count; under batch invariance it is the batched
  // gemm_batch_invariant, W_UK_h in its Linear form (wuk_t).
  void absorbed(Layer& Ly, int64_t l, const StepRows& sr, const Tensor& q, const Tensor& O) {
    const int64_t B = sr.B, W = rkv + dr, head_rows = (dn + dv) * rkv;
    const bool invariant = opt.batch_invariant && B <= kBatchInvariantRows;
    // A step of decode rows only has them in order: q and O are theirs as they are.
    const bool all = B == q.size(0);
    Tensor qd = all ? q : f32({B, H * dqk});
    if (!all) be.gather_rows(q.view(), sr.dec_rows.view(), TensorView(), qd.view());
    Tensor qs = f32({B * H, W}), os = f32({B * H, rkv});  // the op's rows b * H + h: [q_lat | q_pe], o_lat
    const TensorView q_nope = matrices(qd.view(), 0, H, B, dn, dqk, H * dqk),
                     q_lat = matrices(qs.view(), 0, H, B, rkv, W, H * W);
    if (invariant)
      be.gemm_batch_invariant(q_nope, matrices(Ly.wuk_t.view(), 0, H, rkv, dn, rkv * dn, dn), q_lat);
    else
      be.gemm_strided_batched(q_nope, matrices(Ly.kv_b_f32.view(), 0, H, dn, rkv, head_rows, rkv), q_lat, false, false);
    be.copy_cols(reshape(qd.view(), {B * H, dqk}), dn, qs.view(), rkv, dr, false);
    be.mla_decode_attention(qs.view(), cache->view(l), sr.dec_table.view(), sr.dec_lengths.view(), scale, os.view(),
                            opt.batch_invariant ? MlaDecodeSplits::by_length : MlaDecodeSplits::fit_batch);
    Tensor od = all ? O : f32({B, H * dv});
    const TensorView o_lat = matrices(os.view(), 0, H, B, rkv, rkv, H * rkv),
                     w_uv = matrices(Ly.kv_b_f32.view(), dn * rkv, H, dv, rkv, head_rows, rkv),
                     o_h = matrices(od.view(), 0, H, B, dv, dv, H * dv);
    if (invariant) be.gemm_batch_invariant(o_lat, w_uv, o_h);
    else be.gemm_strided_batched(o_lat, w_uv, o_h, true, false);
    if (!all) be.scatter_rows(od.view(), sr.dec_rows.view(), O.view());
  }

  // ---- The MLP half: x [T, D] += mlp(norm(x)) or moe(norm(x)).
  void ffn(int64_t l, const Tensor& x) {
    Layer& L = layers[size_t(l)];
    const Tensor h = rmsnorm(norm_input(x).view(), L.post_norm);
    if (!L.moe) {
      be.axpy(1.0, mlp_forward(L.mlp, h.view(), ScaleMode::fp32).view(), 1.0, x.view());
      return;
    }
    const int64_t T = x.size(0), E = cfg.n_routed_experts, k = cfg.num_experts_per_tok;
    // The report quantizes the activations before dispatch with power-of-two scales.
    if (L.has_shared) be.axpy(1.0, mlp_forward(L.mlp, h.view(), ScaleMode::pow2).view(), 1.0, x.view());
    Tensor logits = f32({T, E}), scores = f32({T, E}), w = f32({T, k});
    Tensor idx = be.empty(DType::i32, {T, k});
    linear_gemm(h.view(), L.gate_w.view(), logits.view());
    be.moe_route(logits.view(), L.gate_bias.view(), scores.view(), idx.view(), w.view(), cfg.n_group, cfg.topk_group,
                 cfg.norm_topk_prob, cfg.routed_scaling_factor);
    const bool extra = layers_extra();
    // With redundant experts the groups are the physical slots, each token's choice sent to one
    // copy of its expert in turn (the copies of an expert split its tokens evenly).
    const int64_t ml = moe_index[size_t(l)];
    const bool phys = redundant && ml >= 0;
    const int64_t routed = phys ? placement.shape.slots : E;
    const int64_t G = routed + (extra ? 1 : 0), K = k + (extra ? 1 : 0);
    Tensor wk = w;
    if (extra) {  // slot k: expert E with weight 1
      wk = f32({T, K});
      Tensor ones = Tensor::host(DType::f32, {T, 1});
      std::fill(ones.ptr<float>(), ones.ptr<float>() + T, 1.0f);
      be.copy_cols(w.view(), 0, wk.view(), 0, k, false);
      be.copy_cols(upload(ones).view(), 0, wk.view(), k, 1, false);
    }
    // The masked layout: expert g's rows at g * M + [0, count[g]), M a multiple of 64. The FP8
    // experts take it from the device (M for the most tokens an expert can get, T), so that the step
    // waits for nothing before its logits; where that bound would cost too many rows, and for the
    // copies' turns and the per-expert GEMMs of the other precisions, the host reads the routing.
    const bool on_device = prec == LinearPrecision::fp8 && !phys && G * round_up(T, 64) <= kDeviceLayoutRows;
    const MaskedLayout lay = on_device ? device_layout(idx, G, extra ? E : -1, ml) : host_layout(idx, G, routed, K, ml);
    const int64_t M = lay.M, R = G * M;
    Tensor ye;  // [R, D] expert outputs
    if (prec == LinearPrecision::fp8) {
      const int64_t F = L.eg.values.size(0) / (E + (extra ? 1 : 0));
      const QuantizedTensor& eg = phys ? L.pg : L.eg;
      const QuantizedTensor& eu = phys ? L.pu : L.eu;
      const QuantizedTensor& ed = phys ? L.pd : L.ed;
      QuantizedTensor xq = be.empty_quantized(R, D, DType::e4m3, ScaleKind::tile_1x128);
      be.moe_permute_quantize(h.view(), lay.row_slot.view(), K, TensorView(), xq, ScaleMode::pow2);
      Tensor g = f32({R, F}), u = f32({R, F}), a = f32({R, F});
      be.grouped_gemm_fp8_masked(xq, eg, lay.counts.view(), G, g.view(), GemmOptions{});
      be.grouped_gemm_fp8_masked(xq, eu, lay.counts.view(), G, u.view(), GemmOptions{});
      be.swiglu_forward(g.view(), u.view(), a.view());
      QuantizedTensor aq = be.empty_quantized(R, F, DType::e4m3, ScaleKind::tile_1x128);
      be.quantize_1x128(a.view(), aq, ScaleMode::fp32);
      ye = f32({R, D});
      be.grouped_gemm_fp8_masked(aq, ed, lay.counts.view(), G, ye.view(), GemmOptions{});
    } else {
      Tensor xe = f32({R, D});
      be.moe_permute(h.view(), lay.row_slot.view(), K, TensorView(), xe.view());
      ye = be.zeros(DType::f32, {R, D});
      for (int64_t g = 0; g < G; ++g) {
        const int64_t n = lay.host_counts[size_t(g)];
        if (n == 0) continue;
        const int64_t e = phys && g < routed ? placement.phy_to_log[size_t(ml)][size_t(g)] : g < routed ? g : E;
        const Tensor y = mlp_forward(L.experts[size_t(e)], rows(xe.view(), g * M, n), ScaleMode::pow2);
        be.copy(rows(ye.view(), g * M, n), y.view());
      }
    }
    be.moe_combine(ye.view(), lay.slot_row.view(), wk.view(), x.view(), true);
  }

  // The masked layout of a MoE layer's G groups: row_slot [G * M], slot_row [T, K], counts [G] on
  // the device; host_counts where the host built it.
  struct MaskedLayout {
    int64_t M = 0;
    Tensor row_slot, slot_row, counts;
    std::vector<int32_t> host_counts;
  };
  // From the routing idx [T, k] read back: the copies' turns, the loads and the virtual GPUs' tokens
  // counted here, M the most slots of a group rounded up to 64. Groups [0, routed) are the routed
  // experts (or their copies), slot k of K = k + 1 goes to group `routed`.
  MaskedLayout host_layout(const Tensor& idx, int64_t G, int64_t routed, int64_t K, int64_t ml) {
    const Tensor idx_h = be.to_host(idx);
    const int64_t T = idx.size(0), k = idx.size(1);
    const bool phys = redundant && ml >= 0;
    std::vector<int32_t> count(size_t(G), 0), expert(size_t(T * K));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        int32_t g = int32_t(routed);
        if (j < k) {
          const int32_t e = idx_h.ptr<int32_t>()[t * k + j];
          g = e;
          if (phys) {
            const auto& copies = placement.log_to_phy[size_t(ml)][size_t(e)];
            g = copies[size_t(turn[size_t(ml)][size_t(e)]++) % copies.size()];
          }
          if (ml >= 0) {
            window[size_t(ml)][size_t(e)] += 1;
            ++gpu_tokens[size_t(ml)][size_t(int64_t(g) * opt.expert_gpus / routed)];
          }
        }
        expert[size_t(t * K + j)] = g;
        ++count[size_t(g)];
      }
    MaskedLayout m;
    m.M = round_up(std::max<int64_t>(1, *std::max_element(count.begin(), count.end())), 64);
    std::vector<int32_t> row_slot(size_t(G * m.M), -1), slot_row(size_t(T * K)), fill(size_t(G), 0);
    for (int64_t s = 0; s < T * K; ++s) {
      const int32_t g = expert[size_t(s)];
      const int64_t r = g * m.M + fill[size_t(g)]++;
      row_slot[size_t(r)] = int32_t(s);
      slot_row[size_t(s)] = int32_t(r);
    }
    m.row_slot = i32(row_slot);
    m.slot_row = be.empty(DType::i32, {T, K});
    be.copy(m.slot_row.view(), reshape(i32(slot_row).view(), {T, K}));
    m.counts = i32(count);
    m.host_counts = std::move(count);
    return m;
  }
  // On the device (Backend::moe_masked_layout), M = round_up(T, 64): no expert gets a token twice.
  // The trunk's layers add their counts to device_loads, folded into the host's counts when read.
  MaskedLayout device_layout(const Tensor& idx, int64_t G, int64_t every_token_group, int64_t ml) {
    const int64_t T = idx.size(0), K = idx.size(1) + (every_token_group >= 0 ? 1 : 0);
    MaskedLayout m;
    m.M = round_up(T, 64);
    m.row_slot = be.empty(DType::i32, {G * m.M});
    m.slot_row = be.empty(DType::i32, {T, K});
    m.counts = be.empty(DType::i32, {G});
    be.moe_masked_layout(idx.view(), G, every_token_group, m.row_slot.view(), m.slot_row.view(), m.counts.view(),
                         ml >= 0 ? device_loads[size_t(ml)].view() : TensorView());
    return m;
  }
  // The tokens the device layouts routed since the last fold, added to the loads and the virtual
  // GPUs' counts (without redundant experts expert e is on GPU e * gpus / E).
  void fold_device_loads() {
    const int64_t E = cfg.n_routed_experts;
    for (size_t ml = 0; ml < device_loads.size(); ++ml) {
      const Tensor h = be.to_host(device_loads[ml]);
      for (int64_t e = 0; e < E; ++e) {
        const int64_t n = h.ptr<int64_t>()[e];
        window[ml][size_t(e)] += double(n);
        gpu_tokens[ml][size_t(e * opt.expert_gpus / E)] += n;
      }
      be.zero(device_loads[ml].view());
    }
  }

  // The step's rows: tokens, positions, cache slots, and the rows whose logits are asked for.
  StepRows rows_of(const std::vector<SeqChunk>& chunks, std::vector<int32_t>& tokens, std::vector<int32_t>& out_rows) {
    StepRows sr;
    std::vector<int32_t> pos;
    for (const SeqChunk& c : chunks) {
      const int64_t n = int64_t(c.tokens.size());
      FP8MOE_CHECK(n > 0, "Engine::step: a chunk without tokens");
      FP8MOE_CHECK(c.logits_rows >= 1 && c.logits_rows <= n,
                   "Engine::step: logits_rows must be in [1, " << n << "], got " << c.logits_rows);
      FP8MOE_CHECK(c.table && int64_t(c.table->size()) * kBlockTokens >= c.start + n,
                   "Engine::step: the block table covers " << (c.table ? c.table->size() : 0) * kBlockTokens
                                                           << " tokens, the chunk ends at " << c.start + n);
      FP8MOE_CHECK(c.start + n <= cfg.max_position_embeddings,
                   "Engine::step: position " << c.start + n - 1 << " >= max_position_embeddings "
                                             << cfg.max_position_embeddings);
      sr.row0.push_back(int64_t(tokens.size()));
      for (int64_t i = 0; i < n; ++i) {
        const int32_t t = c.tokens[size_t(i)];
        FP8MOE_CHECK(t >= 0 && t < cfg.vocab_size, "Engine::step: token " << t << " outside the vocabulary [0, "
                                                                          << cfg.vocab_size << ")");
        const int64_t p = c.start + i;
        tokens.push_back(t);
        pos.push_back(int32_t(p));
        sr.slots.push_back(int64_t((*c.table)[size_t(p / kBlockTokens)]) * kBlockTokens + p % kBlockTokens);
      }
      for (int64_t r = n - c.logits_rows; r < n; ++r) out_rows.push_back(int32_t(sr.row0.back() + r));
    }
    sr.tokens = i32(tokens);
    sr.positions = i32(pos);
    sr.slot_index = i32(std::vector<int32_t>(sr.slots.begin(), sr.slots.end()));
    sr.decode.assign(chunks.size(), false);
    if (opt.absorbed_decode) {
      std::vector<int32_t> dec_rows, lengths;
      std::vector<const std::vector<int32_t>*> tables;
      int64_t nb = 1;
      for (size_t c = 0; c < chunks.size(); ++c) {
        const SeqChunk& ch = chunks[c];
        if (ch.tokens.size() != 1 && !ch.decode) continue;
        sr.decode[c] = true;
        for (int64_t i = 0; i < int64_t(ch.tokens.size()); ++i) {
          dec_rows.push_back(int32_t(sr.row0[c] + i));
          lengths.push_back(int32_t(ch.start + i + 1));
          tables.push_back(ch.table);
          nb = std::max(nb, blocks_for(ch.start + i + 1));
        }
      }
      const int64_t B = sr.B = int64_t(dec_rows.size());
      if (B > 0) {
        Tensor table = Tensor::host(DType::i32, {B, nb});  // blocks past a sequence's end: 0, never read
        for (int64_t b = 0; b < B; ++b) {
          const std::vector<int32_t>& t = *tables[size_t(b)];
          std::copy(t.begin(), t.begin() + blocks_for(lengths[size_t(b)]), table.ptr<int32_t>() + b * nb);
        }
        sr.dec_rows = i32(dec_rows);
        sr.dec_table = upload(table);
        sr.dec_lengths = i32(lengths);
      }
    }
    return sr;
  }

  // logits [R, V] (on the backend) of rows `out` of x [T, D] through `final_norm` and the head (x
  // itself where out is every row in order, as in a step of decode rows).
  Tensor head_logits(const Tensor& x, const std::vector<int32_t>& out, const Tensor& final_norm) {
    bool every = int64_t(out.size()) == x.size(0);
    for (size_t i = 0; every && i < out.size(); ++i) every = out[i] == int32_t(i);
    Tensor xl = x;
    if (!every) {
      xl = f32({int64_t(out.size()), D});
      be.gather_rows(x.view(), i32(out).view(), TensorView(), xl.view());
    }
    return run(head, rmsnorm(xl.view(), final_norm).view());
  }

  // The step's work from its rows on the backend to its logits there (the residual stream in
  // *hidden when asked).
  Tensor forward(const std::vector<SeqChunk>& chunks, const StepRows& sr, const std::vector<int32_t>& out,
                 Tensor* hidden) {
    const int64_t T = sr.tokens.size(0);
    Tensor x = f32({T, D});  // [T, D] the residual stream
    be.embedding_forward(sr.tokens.view(), embed.view(), x.view());
    for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      attention(l, chunks, sr, x);
      ffn(l, x);
    }
    if (hidden) *hidden = x;
    return head_logits(x, out, norm);
  }

  Tensor step(const std::vector<SeqChunk>& chunks, Tensor* hidden) {
    FP8MOE_CHECK(!chunks.empty(), "Engine::step: no chunks");
    StepChecks checks(be);
    std::vector<int32_t> tokens, out;
    const StepRows sr = rows_of(chunks, tokens, out);
    Tensor logits;
    if (!hidden && graphable(chunks, sr)) {
      const GraphKey k{sr.B, sr.dec_table.size(1)};
      if (recorded.graph.defined() && recorded.key == k) {
        logits = replay(sr);
      } else if (last_key == k && record(k, chunks, sr, out)) {
        logits = replay(sr);
      } else {
        last_key = k;
        logits = forward(chunks, sr, out, nullptr);
      }
    } else {
      logits = forward(chunks, sr, out, hidden);
    }
    logits = be.to_host(logits);
    checks.raise();
    if (opt.rebalance_every > 0 && ++steps % opt.rebalance_every == 0) rebalance();
    return logits;
  }

  // ---- Decode steps as graphs (EngineOptions::graphs): a step of B single-token decode rows
  // whose tables are `width` blocks wide is recorded the second time that shape comes in a row
  // and replayed while it stays, its rows copied into the recorded step's. Only where the step
  // asks the host nothing on the way: the FP8 experts' layouts on the device, no redundant
  // experts (their copies take turns on the host), the shared expert not routed (its weights are
  // uploaded per step). The fit_batch splits of the decode attention depend on B and the width
  // alone, so a replay computes what the step would compute eagerly, bit for bit.
  struct GraphKey {
    int64_t B = 0, width = 0;
    friend bool operator==(const GraphKey&, const GraphKey&) = default;
  };
  struct Recorded {
    GraphKey key;
    Graph graph;
    StepRows sr;    // the tensors the graph reads
    Tensor logits;  // and the one it writes
  };
  GraphKey last_key;
  Recorded recorded;
  std::string graph_note;  // why graphs are off, after a capture failed
  int64_t replays = 0;

  bool graphable(const std::vector<SeqChunk>& chunks, const StepRows& sr) const {
    if (!opt.graphs || !graph_note.empty() || !be.can_capture() || prec != LinearPrecision::fp8 || redundant ||
        layers_extra() || sr.B != int64_t(chunks.size()))
      return false;
    for (const SeqChunk& c : chunks)
      if (c.tokens.size() != 1) return false;
    return cfg.n_routed_experts * round_up(sr.B, 64) <= kDeviceLayoutRows;  // ffn's on_device
  }
  // Records the step (nothing runs yet: replay() runs it). False, with graphs off and the reason
  // in graph_note, when the capture fails: then the step runs as usual.
  bool record(const GraphKey& k, const std::vector<SeqChunk>& chunks, const StepRows& sr,
              const std::vector<int32_t>& out) {
    recorded = Recorded{};  // the graph before goes first: its blocks are the new one's to reuse
    Graph g;
    Tensor logits;
    try {
      g = be.capture([&] { logits = forward(chunks, sr, out, nullptr); });
    } catch (const Error& e) {
      graph_note = e.what();
      return false;
    }
    recorded = Recorded{k, std::move(g), sr, logits};
    return true;
  }
  // The step as the recorded graph, this step's rows copied into the recorded ones; its logits.
  Tensor replay(const StepRows& sr) {
    cache->check_slots(sr.slots);  // LatentCache::write's check: the replay does not call it
    StepRows& to = recorded.sr;
    for (const auto f : {&StepRows::tokens, &StepRows::positions, &StepRows::slot_index, &StepRows::dec_rows,
                         &StepRows::dec_table, &StepRows::dec_lengths})
      if ((to.*f).view().data != (sr.*f).view().data) be.copy((to.*f).view(), (sr.*f).view());
    recorded.graph.replay(be.stream());
    ++replays;
    return recorded.logits;
  }

  Tensor mtp_step(const std::vector<SeqChunk>& chunks, const TensorView& hidden) {
    FP8MOE_CHECK(opt.mtp, "Engine::mtp_step: the engine was made without EngineOptions::mtp");
    StepChecks checks(be);
    std::vector<int32_t> tokens, out;
    std::vector<SeqChunk> last_only = chunks;
    for (SeqChunk& c : last_only) c.logits_rows = 1;
    const StepRows sr = rows_of(last_only, tokens, out);
    const int64_t T = int64_t(tokens.size()), L = cfg.num_hidden_layers;
    FP8MOE_CHECK(hidden.size(0) == T && hidden.size(1) == D,
                 "Engine::mtp_step: hidden must be [" << T << ", " << D << "], got " << hidden.str());
    Tensor e = f32({T, D});
    be.embedding_forward(sr.tokens.view(), embed.view(), e.view());
    Tensor cat = f32({T, 2 * D});  // [enorm(embed(t + 1)); hnorm(h_t)]
    be.copy_cols(rmsnorm(e.view(), enorm).view(), 0, cat.view(), 0, D, false);
    be.copy_cols(rmsnorm(hidden, hnorm).view(), 0, cat.view(), D, D, false);
    Tensor x = run(eh, cat.view());  // [T, D]
    attention(L, last_only, sr, x);
    ffn(L, x);
    Tensor logits = be.to_host(head_logits(x, out, mtp_norm));
    checks.raise();
    return logits;
  }
};

namespace {
double linear_bytes(const Linear& L) {
  if (L.q.values.defined()) return double(L.q.values.view().nbytes() + L.q.scales.view().nbytes());
  return L.w.defined() ? double(L.w.view().nbytes()) : 0.0;
}
double qbytes(const QuantizedTensor& q) {
  return q.values.defined() ? double(q.values.view().nbytes() + q.scales.view().nbytes()) : 0.0;
}
}  // namespace

double Engine::decode_step_bytes(int64_t batch, int64_t context) const {
  const Impl& m = *impl_;
  double b = linear_bytes(m.head) + double(batch * m.D * 4);  // head, embedding rows
  for (int64_t l = 0; l < m.cfg.num_hidden_layers; ++l) {
    const Impl::Layer& L = m.layers[size_t(l)];
    for (const Linear* x : {&L.q_a, &L.q_b, &L.kv_a, &L.o}) b += linear_bytes(*x);
    b += double(L.kv_b_f32.view().nbytes());  // decode reads kv_b_proj through the absorption only
    if (!L.moe) {
      for (const Linear* x : {&L.mlp.gate, &L.mlp.up, &L.mlp.down}) b += linear_bytes(*x);
      continue;
    }
    if (L.has_shared)
      for (const Linear* x : {&L.mlp.gate, &L.mlp.up, &L.mlp.down}) b += linear_bytes(*x);
    b += double(L.gate_w.view().nbytes());
    const double E = double(m.cfg.n_routed_experts), k = double(m.cfg.num_experts_per_tok);
    // Experts touched by batch * k uniform picks among E: E (1 - (1 - k/E)^batch); every token
    // picks the shared one when it runs as a routed expert.
    const double touched = E * (1 - std::pow(1 - k / E, double(batch)));
    double per_expert = 0;
    if (L.eg.values.defined()) {
      const double groups = E + (m.opt.shared_as_routed && m.cfg.n_shared_experts > 0 ? 1 : 0);
      per_expert = (qbytes(L.eg) + qbytes(L.eu) + qbytes(L.ed)) / groups;
      b += per_expert * (touched + (groups > E ? 1 : 0));
    } else {
      for (const Impl::Mlp& e : L.experts) per_expert = linear_bytes(e.gate) + linear_bytes(e.up) + linear_bytes(e.down);
      b += per_expert * (touched + (double(L.experts.size()) > E ? 1 : 0));
    }
  }
  return b + double(batch) * double(context) * double(m.cache->bytes_per_token());
}

Engine::Engine(const WeightSet& w, Backend& be, const EngineOptions& opt) : impl_(std::make_unique<Impl>(w, be, opt)) {}
Engine::~Engine() = default;
const ModelConfig& Engine::config() const { return impl_->cfg; }
const EngineOptions& Engine::options() const { return impl_->opt; }
LinearPrecision Engine::linear_precision() const { return impl_->prec; }
Backend& Engine::backend() const { return impl_->be; }
LatentCache& Engine::cache() { return *impl_->cache; }
int64_t Engine::graph_replays() const { return impl_->replays; }
const std::string& Engine::graph_note() const { return impl_->graph_note; }
Tensor Engine::step(const std::vector<SeqChunk>& chunks, Tensor* hidden) { return impl_->step(chunks, hidden); }
const ExpertPlacement& Engine::placement() const { return impl_->placement; }
const ExpertLoads& Engine::expert_loads() const {
  impl_->fold_device_loads();
  return impl_->window;
}
const std::vector<std::vector<int64_t>>& Engine::gpu_tokens() const {
  impl_->fold_device_loads();
  return impl_->gpu_tokens;
}
void Engine::reset_gpu_tokens() {
  impl_->fold_device_loads();
  for (auto& row : impl_->gpu_tokens) std::fill(row.begin(), row.end(), 0);
}
void Engine::set_placement(const ExpertPlacement& p) { impl_->set_placement(p); }
void Engine::rebalance() { impl_->rebalance(); }
Tensor Engine::mtp_step(const std::vector<SeqChunk>& chunks, const TensorView& hidden) {
  return impl_->mtp_step(chunks, hidden);
}

}  // namespace fp8moe::serve
