// The model's API contracts: config files and their validation messages, parameter counts of the
// full DeepSeek-V3, backward-for-input/backward-for-weights split across micro-batches (the order
// a ZeroBubble/DualPipe schedule uses gives the same gradients), gradient accumulation, the
// auxiliary-loss-free bias update, safetensors round trip, the sublayer records of the
// teacher-forced reference check, a model holding a share of the routed experts, and model ops
// unsupported by a backend.
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "model_testing.hpp"

namespace fp8moe::testing {
namespace {

void expect_error(const ModelConfig& c, const Recipe& r, const std::string& needle) {
  try {
    validate_config(c, r);
    ADD_FAILURE() << "accepted a bad config, expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, FilesLoadAndValidate) {
  for (const auto& f : std::filesystem::directory_iterator(std::string(FP8MOE_SOURCE_DIR) + "/configs")) {
    if (f.path().extension() != ".json") continue;
    const ModelConfig c = load_config(f.path().string());
    EXPECT_NO_THROW(validate_config(c, Recipe::from_name("fp8"))) << f.path();
    std::cout << "[ config   ] " << c.name << ": " << count_parameters(c).total << " parameters\n";
  }
  const ModelConfig v3 = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/deepseek-v3.json");
  const ParameterCount pc = count_parameters(v3);
  // The report: 671B total, 37B activated per token (the MTP module not counted).
  EXPECT_NEAR(pc.total_main / 1e9, 671.0, 1.0);
  EXPECT_NEAR(pc.activated_main / 1e9, 37.5, 1.0);
  const ModelConfig b1 = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/1b.json");
  EXPECT_NEAR(count_parameters(b1).total / 1e9, 1.0, 0.1);
  EXPECT_EQ(config_from_json(config_to_json(v3)).hidden_size, 7168);
}

TEST(ModelConfig, BadConfigsAreRejectedWithClearMessages) {
  const Recipe fp8 = Recipe::from_name("fp8"), fp32 = Recipe::from_name("fp32");
  ModelConfig c = tiny_config();
  c.num_attention_heads = 3;
  expect_error(c, fp32, "num_attention_heads = 3 does not divide hidden_size = 128");
  c = tiny_config();
  c.num_experts_per_tok = 9;
  expect_error(c, fp32, "num_experts_per_tok = 9 exceeds n_routed_experts = 8");
  c = tiny_config();
  c.n_group = 3;
  expect_error(c, fp32, "n_group = 3 does not divide n_routed_experts = 8");
  c = tiny_config();
  c.topk_group = 3;
  expect_error(c, fp32, "topk_group = 3 must be in [1, n_group = 2]");
  c = tiny_config();
  c.num_experts_per_tok = 5;  // 1 group of 4 experts reachable
  expect_error(c, fp32, "exceeds the 4 experts of topk_group = 1 groups");
  c = tiny_config();
  c.hidden_size = 96;
  c.num_attention_heads = 2;
  EXPECT_NO_THROW(validate_config(c, fp32));
  expect_error(c, fp8, "hidden_size = 96 must be a multiple of 128 for recipe fp8");
  c = tiny_config();
  c.moe_intermediate_size = 64;
  expect_error(c, fp8, "moe_intermediate_size = 64 must be a multiple of 128");
  c = tiny_config();
  c.qk_rope_head_dim = 5;
  expect_error(c, fp32, "qk_rope_head_dim = 5 must be even");
  c = tiny_config();
  c.num_nextn_predict_layers = 2;
  expect_error(c, fp32, "num_nextn_predict_layers = 2 must be 0 or 1");
  EXPECT_THROW(config_from_json(R"({"hidden_size": "big"})"), Error);
  try {
    config_from_json(R"({"hidden_size": "big"})");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'hidden_size' has the wrong type"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Recipe::from_name("fp4"), Error);
  // Attention: exact (the activations' dtype) in every recipe unless set to bf16.
  for (const std::string& name : Recipe::names()) {
    Recipe r = Recipe::from_name(name);
    EXPECT_EQ(r.attn_compute, r.act_dtype) << name;
    EXPECT_EQ(r.attention(), "exact") << name;
    r.set_attention("bf16");
    EXPECT_EQ(r.attn_compute, DType::bf16) << name;
    EXPECT_EQ(r.attention(), "bf16") << name;
    r.set_attention("exact");
    EXPECT_EQ(r.attn_compute, r.act_dtype) << name;
  }
  try {
    Recipe::from_name("fp8").set_attention("fp16");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown attention precision 'fp16' (expected exact or bf16)"),
              std::string::npos)
        << e.what();
  }
  auto be = make_backend("cpu");
  c = tiny_config();
  c.hidden_size = 96;
  EXPECT_THROW(Model(c, fp8, *be), Error);  // the model validates against its recipe
}

// B and W of two micro-batches in the order B1 B2 W2 W1 (backward-for-weights deferred, as in
// ZeroBubble) give the gradients of running each micro-batch's backward in one piece, up to the
// order in which the two micro-batches' Wgrads add into the gradients (tol).
void check_deferred_backward_for_weights(const ModelConfig& c, const std::string& recipe, double tol) {
  auto rng = make_rng();
  auto be = make_backend("cpu");
  const Recipe r = Recipe::from_name(recipe);
  Model m(c, r, *be, rng());
  auto [t1, g1] = random_batch(rng, c);
  auto [t2, g2] = random_batch(rng, c);
  const Batch b1 = m.make_batch(t1.view(), g1.view()), b2 = m.make_batch(t2.view(), g2.view());
  auto trunk = m.trunk();
  const int64_t T = b1.tokens_count(), D = c.hidden_size;
  auto grads = [&] {
    std::vector<double> v;
    for (auto& p : m.parameters())
      for (double g : to_doubles(p.grad.view())) v.push_back(g);
    return v;
  };
  Tensor dy = random_normal(rng, DType::f32, {T, D});
  Tensor dyd = Tensor::host(r.act_dtype, {T, D});
  for (int64_t i = 0; i < T * D; ++i) store_float(dyd.view(), i, dy.ptr<float>()[i]);
  // Reference: each micro-batch's full backward in turn, sublayer by sublayer.
  m.zero_grad();
  std::vector<Tensor> dx_ref;
  for (const Batch* b : {&b1, &b2}) {
    Tensor x = m.embed_forward(*b);
    for (Layer* l : trunk) {
      Tensor y, dx;
      auto s = l->forward(*b, x, y);
      l->backward_input(*b, *s, dyd, dx);
      l->backward_weight(*b, *s);
      dx_ref.push_back(dx);
      x = y;
    }
  }
  const auto ref = grads();
  // Split: forward both, B of both, then W in reverse order.
  m.zero_grad();
  std::vector<std::unique_ptr<Saved>> s1, s2;
  Tensor x1 = m.embed_forward(b1), x2 = m.embed_forward(b2);
  for (Layer* l : trunk) {
    Tensor y1, y2;
    s1.push_back(l->forward(b1, x1, y1));
    s2.push_back(l->forward(b2, x2, y2));
    x1 = y1;
    x2 = y2;
  }
  std::vector<Tensor> dx1(trunk.size()), dx2(trunk.size());
  for (size_t i = 0; i < trunk.size(); ++i) trunk[i]->backward_input(b1, *s1[i], dyd, dx1[i]);
  for (size_t i = 0; i < trunk.size(); ++i) trunk[i]->backward_input(b2, *s2[i], dyd, dx2[i]);
  for (size_t i = trunk.size(); i-- > 0;) trunk[i]->backward_weight(b2, *s2[i]);
  for (size_t i = trunk.size(); i-- > 0;) trunk[i]->backward_weight(b1, *s1[i]);
  const auto split = grads();
  ASSERT_EQ(ref.size(), split.size());
  EXPECT_LT(rel_error(split, ref), tol);
  for (size_t i = 0; i < trunk.size(); ++i) {
    EXPECT_LT(rel_error(to_doubles(dx1[i].view()), to_doubles(dx_ref[i].view())), tol) << trunk[i]->name();
    EXPECT_LT(rel_error(to_doubles(dx2[i].view()), to_doubles(dx_ref[trunk.size() + i].view())), tol) << trunk[i]->name();
  }
}

TEST(ModelSplit, DeferredBackwardForWeights) { check_deferred_backward_for_weights(fd_config(), "fp64", 1e-12); }

// FP8: each Linear's Dgrad quantizes dy^T for its Wgrad (with dy, in one pass, where the shapes
// agree) and keeps it in the layer's state until the deferred W.
TEST(ModelSplit, DeferredBackwardForWeightsFp8) { check_deferred_backward_for_weights(tiny_config(), "fp8", 1e-6); }

TEST(ModelApi, AccumulationBiasUpdateAndSafetensors) {
  auto rng = make_rng();
  auto be = make_backend("cpu");
  const ModelConfig c = tiny_config();
  Model m(c, Recipe::from_name("fp32"), *be, rng());
  EXPECT_EQ(m.num_parameters(), count_parameters(c).total);
  EXPECT_NO_THROW(m.parameter("model.layers.1.mlp.experts.7.down_proj.weight"));
  EXPECT_NO_THROW(m.parameter("model.layers.2.eh_proj.weight"));
  EXPECT_THROW(m.parameter("model.layers.9.mlp.gate.weight"), Error);
  EXPECT_FALSE(m.parameter("model.layers.1.mlp.gate.e_score_correction_bias").trainable);
  auto [tok, tgt] = random_batch(rng, c);
  // Two half-scaled passes accumulate to one full pass.
  m.zero_grad();
  const StepStats st = m.forward_backward(tok.view(), tgt.view(), 1.0);
  const auto g1 = to_doubles(m.parameter("model.layers.0.self_attn.q_b_proj.weight").grad.view());
  m.zero_grad();
  m.forward_backward(tok.view(), tgt.view(), 0.5);
  m.forward_backward(tok.view(), tgt.view(), 0.5);
  const auto g2 = to_doubles(m.parameter("model.layers.0.self_attn.q_b_proj.weight").grad.view());
  EXPECT_LT(rel_error(g2, g1), 1e-5);
  // Bias update: under-loaded experts move up by gamma, over-loaded ones down.
  ASSERT_EQ(st.expert_loads.size(), 2u);
  m.update_routing_bias(st.expert_loads, 0.01);
  const auto bias = to_doubles(m.parameter("model.layers.1.mlp.gate.e_score_correction_bias").weight.view());
  double mean = 0;
  for (auto v : st.expert_loads[0]) mean += double(v) / double(c.n_routed_experts);
  for (int64_t e = 0; e < c.n_routed_experts; ++e) {
    const double load = double(st.expert_loads[0][size_t(e)]);
    EXPECT_NEAR(bias[size_t(e)], load < mean ? 0.01 : load > mean ? -0.01 : 0.0, 1e-7) << "expert " << e;
  }
  EXPECT_THROW(m.update_routing_bias({st.expert_loads[0]}, 0.01), Error);
  // Safetensors round trip into a differently seeded model gives the same loss.
  const std::string path = ::testing::TempDir() + "/fp8moe_model_test.safetensors";
  save_safetensors(path, m);
  Model m2(c, Recipe::from_name("fp32"), *be, rng());
  load_safetensors(path, m2);
  EXPECT_EQ(m2.forward(tok.view(), tgt.view()).loss, m.forward(tok.view(), tgt.view()).loss);
}

// The weights converted for the GEMMs (BF16, FP8 blocks) are shared within one forward_backward
// and never outlive it: after the weights change, a model gives the same loss and gradients, bit
// for bit, as a fresh model built with the changed weights.
TEST(ModelApi, ConvertedWeightsFollowWeightChanges) {
  auto be = make_backend("cpu");
  const ModelConfig c = tiny_config();
  for (const char* recipe : {"bf16", "fp8"}) {
    SCOPED_TRACE(recipe);
    auto rng = make_rng();
    const uint64_t seed = rng();
    auto [tok, tgt] = random_batch(rng, c);
    const std::vector<std::string> changed{"model.layers.0.self_attn.q_b_proj.weight",
                                           "model.layers.0.mlp.up_proj.weight",
                                           "model.layers.1.mlp.experts.0.down_proj.weight", "lm_head.weight"};
    auto change = [&](Model& m) {
      for (const auto& name : changed) {
        Parameter& p = m.parameter(name);
        float* w = p.weight.ptr<float>();
        for (int64_t i = 0; i < p.weight.numel(); ++i) w[i] *= (i % 3 == 0) ? -1.5f : 0.75f;
      }
    };
    auto run = [&](Model& m) {
      m.zero_grad();
      const double loss = m.forward_backward(tok.view(), tgt.view(), 1.0).loss;
      std::vector<double> g{loss};
      for (auto& p : m.parameters())
        for (double v : to_doubles(p.grad.view())) g.push_back(v);
      return g;
    };
    Model a(c, Recipe::from_name(recipe), *be, seed), b(c, Recipe::from_name(recipe), *be, seed);
    const auto before = run(a);
    change(a);
    change(b);
    const auto after = run(a);
    EXPECT_NE(after, before);
    EXPECT_EQ(after, run(b));
  }
}

// record_sublayers: every sublayer's x, y, dy, dx in execution order, chained (one sublayer's y is
// the next one's x, its dx the previous one's dy; the trunk output's gradient is the sum of the
// head's and the MTP eh part's dx), with gradients identical to a run without records.
TEST(ModelApi, SublayerRecords) {
  auto rng = make_rng();
  auto be = make_backend("cpu");
  const ModelConfig c = fd_config();
  Model m(c, Recipe::from_name("fp64"), *be, rng());
  auto [tok, tgt] = random_batch(rng, c);
  auto f64 = [](const Tensor& t) { return std::vector<double>(t.ptr<double>(), t.ptr<double>() + t.numel()); };
  auto grads = [&] {
    std::vector<double> v;
    for (auto& p : m.parameters())
      for (double g : f64(p.grad)) v.push_back(g);
    return v;
  };
  m.zero_grad();
  m.forward_backward(tok.view(), tgt.view(), 1.0);
  const auto plain = grads();
  EXPECT_TRUE(m.sublayer_records().empty());
  m.record_sublayers(true);
  m.zero_grad();
  const StepStats st = m.forward_backward(tok.view(), tgt.view(), 1.0);
  EXPECT_EQ(grads(), plain);
  std::map<std::string, std::vector<double>> r;
  for (const auto& [name, t] : m.sublayer_records()) r[name] = f64(t);
  const std::vector<std::string> subs{"sub.0.layers.0.attn", "sub.1.layers.0.mlp", "sub.2.layers.1.attn",
                                      "sub.3.layers.1.moe",  "sub.4.head",         "sub.5.layers.2.eh",
                                      "sub.6.layers.2.attn", "sub.7.layers.2.moe", "sub.8.layers.2.shared_head"};
  std::set<std::string> expected;
  for (const auto& s : subs)
    for (const char* what : {".x", ".y", ".dx"}) expected.insert(s + what);
  for (const auto& s : subs)
    if (s.find("head") == std::string::npos) expected.insert(s + ".dy");
  for (const char* k : {"sub.3.layers.1.moe.aux", "sub.7.layers.2.moe.aux", "sub.4.head.loss",
                        "sub.8.layers.2.shared_head.loss"})
    expected.insert(k);
  std::set<std::string> got;
  for (const auto& kv : r) got.insert(kv.first);
  EXPECT_EQ(got, expected);
  const int64_t T = c.batch_size * c.seq_len;
  EXPECT_EQ(int64_t(r["sub.4.head.y"].size()), T * c.vocab_size);
  EXPECT_EQ(r["sub.4.head.y"], f64(m.last_logits()));
  EXPECT_EQ(r["sub.4.head.loss"][0], st.main_loss);
  EXPECT_EQ(r["sub.8.layers.2.shared_head.loss"][0], st.mtp_loss);
  EXPECT_NEAR(r["sub.3.layers.1.moe.aux"][0] + r["sub.7.layers.2.moe.aux"][0], st.balance_loss, 1e-15);
  for (size_t i : {0, 1, 2, 3, 5, 6, 7}) EXPECT_EQ(r[subs[i] + ".y"], r[subs[i + 1] + ".x"]) << subs[i];
  for (size_t i : {0, 1, 2, 5, 6, 7}) EXPECT_EQ(r[subs[i] + ".dy"], r[subs[i + 1] + ".dx"]) << subs[i];
  EXPECT_EQ(r["sub.3.layers.1.moe.y"], r["sub.5.layers.2.eh.x"]);
  std::vector<double> dh = r["sub.4.head.dx"];
  for (size_t j = 0; j < dh.size(); ++j) dh[j] += r["sub.5.layers.2.eh.dx"][j];
  EXPECT_LT(rel_error(dh, r["sub.3.layers.1.moe.dy"]), 1e-14);
  m.record_sublayers(false);
  m.forward(tok.view(), tgt.view());
  EXPECT_TRUE(m.sublayer_records().empty());
}

// A backend without the model ops reports which one is missing.
class NoModelOps final : public Backend {
 public:
  std::string name() const override { return "bare"; }
  Device device() const override { return Device::cpu; }
  bool supports(Op) const override { return false; }
  Tensor zeros(DType t, std::initializer_list<int64_t> s) override { return Tensor::host(t, s); }
  void copy(const TensorView&, const TensorView&) override {}
  void quantize_1x128(const TensorView&, const QuantizedView&, ScaleMode) override {}
  void quantize_128x128(const TensorView&, const QuantizedView&, ScaleMode) override {}
  void quantize_128x1(const TensorView&, const QuantizedView&, ScaleMode) override {}
  void requantize_128x1(const QuantizedView&, const QuantizedView&, ScaleMode) override {}
  void transpose_128x128(const QuantizedView&, const QuantizedView&, int64_t) override {}
  void dequantize(const QuantizedView&, const TensorView&) override {}
  void gemm_fp8(const QuantizedView&, const QuantizedView&, const TensorView&, const GemmOptions&) override {}
  void gemm_bf16(const TensorView&, const TensorView&, const TensorView&, bool) override {}
};

// A model holding routed experts [2, 6) of 8 (an expert-parallel rank's): those experts' parameters
// only, stacked from row 0, with the values of the whole model; everything else as in the whole
// model. The in-process MoE layer, which needs every expert, refuses to run it.
TEST(ModelApi, ExpertShardHoldsItsExpertsWithTheWholeModelsValues) {
  auto be = make_backend("cpu");
  const ModelConfig c = tiny_config();
  ASSERT_EQ(c.n_routed_experts, 8);
  Model whole(c, Recipe::from_name("fp8"), *be, 7), part(c, Recipe::from_name("fp8"), *be, 7, {2, 4});
  EXPECT_EQ(part.expert_shard().first, 2);
  EXPECT_EQ(part.expert_shard().count, 4);
  EXPECT_EQ(whole.expert_shard().count, 8);
  int64_t absent = 0;
  for (Parameter& p : whole.parameters()) {
    const size_t at = p.name.find(".mlp.experts.");
    const int64_t e = at == std::string::npos ? -1 : std::stoll(p.name.substr(at + 13));
    Parameter* q = part.find_parameter(p.name);
    if (e >= 0 && (e < 2 || e >= 6)) {
      EXPECT_EQ(q, nullptr) << p.name;
      absent += p.weight.numel();
      continue;
    }
    ASSERT_NE(q, nullptr) << p.name;
    ASSERT_EQ(q->weight.numel(), p.weight.numel()) << p.name;
    EXPECT_EQ(std::memcmp(q->weight.view().data, p.weight.view().data, p.weight.view().nbytes()), 0) << p.name;
    if (e > 2) {  // row group e - 2 of its stack
      const std::string first = p.name.substr(0, at + 13) + "2" + p.name.substr(p.name.find('.', at + 13));
      EXPECT_EQ(static_cast<const char*>(q->weight.view().data),
                static_cast<const char*>(part.parameter(first).weight.view().data) +
                    (e - 2) * int64_t(q->weight.view().nbytes()))
          << p.name;
    }
  }
  EXPECT_EQ(part.num_parameters(), whole.num_parameters() - absent);
  EXPECT_GT(absent, 0);
  auto rng = make_rng();
  auto [tok, tgt] = random_batch(rng, c);
  try {
    part.forward(tok.view(), tgt.view());
    ADD_FAILURE() << "a model without every expert ran the in-process MoE layer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds routed experts [2, 6) of 8"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Model(c, Recipe::from_name("fp8"), *be, 7, {6, 4}), Error);
}

TEST(ModelApi, UnsupportedOpsNameThemselves) {
  NoModelOps be;
  try {
    be.attention_forward({}, {}, {}, {}, {}, 1, 1.0, DType::f32);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "attention_forward: unsupported on backend bare");
  }
  EXPECT_EQ(op_name(Op::moe_route), "moe_route");
  Model m(tiny_config(), Recipe::from_name("fp32"), be);
  auto rng = make_rng();
  auto [tok, tgt] = random_batch(rng, tiny_config());
  EXPECT_THROW(m.forward(tok.view(), tgt.view()), Error);
}

}  // namespace
}  // namespace fp8moe::testing
