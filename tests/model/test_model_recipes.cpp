// The recipes on the tiny config (configs/tiny.json): bf16 and the FP8 recipes against the fp32
// oracle from the same weights and batch, per tensor with calc_diff (logits and every gradient)
// and the relative loss error; and the memory account: the bytes each layer keeps, measured after
// forward_backward, equal the analytic prediction, and FP8 keeps less than BF16 by the caching.
#include <algorithm>
#include <chrono>
#include <cmath>

#include "model_testing.hpp"

namespace fp8moe::testing {
namespace {

struct RecipeRun {
  StepStats st;
  std::vector<double> logits;
  std::map<std::string, std::vector<double>> grads;
  MemoryAccount memory;
  double seconds = 0;
};

RecipeRun run_recipe(const std::string& recipe, uint64_t seed, const Tensor& tok, const Tensor& tgt,
                     const ModelConfig& cfg = tiny_config()) {
  auto be = make_backend("cpu");
  Model model(cfg, recipe_of(recipe), *be, seed);
  model.zero_grad();
  RecipeRun r;
  const auto t0 = std::chrono::steady_clock::now();
  r.st = model.forward_backward(tok.view(), tgt.view(), 1.0);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.logits = to_doubles(model.last_logits().view());
  for (auto& p : model.parameters())
    if (p.trainable) r.grads[p.name] = to_doubles(p.grad.view());
  r.memory = model.saved_memory();
  return r;
}

// calc_diff bounds: logits, the worst gradient tensor outside the routing-sensitive ones (all of
// them without top-k routing), all gradients as one vector, the main loss's relative error, and
// the worst routing-sensitive gradient tensor (the routed experts, the router and the norm before
// it: a token whose top-k choice flips between the two runs moves them by O(1)).
struct Bounds {
  double logits, grads, all_grads, loss_rel, routing;
};

void compare_recipes(const ModelConfig& cfg, const std::map<std::string, Bounds>& bounds) {
  auto rng = make_rng();
  const uint64_t seed = rng();
  auto [tok, tgt] = random_batch(rng, cfg);
  const RecipeRun ref = run_recipe("fp32", seed, tok, tgt, cfg);
  // Top-k routing that can flip (experts > experts per token): the routing-sensitive tensors get
  // their own bound.
  const bool moe = cfg.num_moe_layers() > 0 && cfg.n_routed_experts > cfg.num_experts_per_tok;
  std::cout << "[ recipe   ] " << cfg.name << " fp32: loss " << ref.st.loss << " (main " << ref.st.main_loss << ", mtp "
            << ref.st.mtp_loss << ", balance " << ref.st.balance_loss << ") " << ref.seconds << " s\n";
  EXPECT_NEAR(ref.st.main_loss, std::log(double(cfg.vocab_size)), 0.1) << "an untrained model predicts uniformly";
  for (const auto& [name, b] : bounds) {
    const RecipeRun r = run_recipe(name, seed, tok, tgt, cfg);
    double worst = 0, worst_routing = 0;
    std::string worst_name, worst_routing_name;
    std::vector<double> all_r, all_ref;
    for (const auto& [pname, g] : ref.grads) {
      const auto& gr = r.grads.at(pname);
      all_r.insert(all_r.end(), gr.begin(), gr.end());
      all_ref.insert(all_ref.end(), g.begin(), g.end());
      const double d = calc_diff(gr, g);
      if (std::getenv("FP8MOE_VERBOSE")) std::cout << "    " << name << " " << pname << " " << d << "\n";
      if (moe && routing_sensitive(pname)) {
        // An expert whose few rows all flip to other experts in one recipe has no gradient there:
        // calc_diff exactly 1 whatever the arithmetic (seen with FP8MOE_SEED=10569856293091157883,
        // fp8-per-tensor, an expert of layer 1). That is the routing, not the recipe.
        const auto zero = [](const std::vector<double>& v) {
          return std::all_of(v.begin(), v.end(), [](double x) { return x == 0.0; });
        };
        if (zero(gr) != zero(g)) continue;
        if (d > worst_routing) worst_routing = d, worst_routing_name = pname;
        continue;
      }
      if (d > worst) worst = d, worst_name = pname;
    }
    const double dall = calc_diff(all_r, all_ref);
    const double dl = calc_diff(r.logits, ref.logits);
    const double loss_rel = std::fabs(r.st.main_loss - ref.st.main_loss) / ref.st.main_loss;
    std::cout << "[ recipe   ] " << cfg.name << " " << name << ": main-loss rel error " << loss_rel << ", logits calc_diff "
              << dl << ", gradients calc_diff: worst " << worst << " (" << worst_name << ")"
              << (moe ? " outside routing" : "") << ", all " << dall;
    if (moe) std::cout << ", routing-sensitive worst " << worst_routing << " (" << worst_routing_name << ")";
    std::cout << "; " << r.seconds << " s\n";
    EXPECT_LT(dl, b.logits) << name;
    EXPECT_LT(worst, b.grads) << name << " " << worst_name;
    EXPECT_LT(dall, b.all_grads) << name;
    EXPECT_LT(loss_rel, b.loss_rel) << name;
    if (moe) {
      EXPECT_LT(worst_routing, b.routing) << name << " " << worst_routing_name;
    }
  }
}

// Bounds: at least 1.5x the worst seen over 85 seeds (FP8MOE_SEED=1000..1083 and one that failed
// a tighter bound), kept where they already were: the first bounds, 3x the worst of 4 seeds,
// failed about one run in twenty, mostly on the main loss's relative error, which is heavy-tailed
// at this size (docs/ACCURACY.md lists the measured values). The FP8 ablations land where fp8
// does on a model this small (K <= 1024, no outliers): what tells them apart is
// test_recipe_guards.cpp, which observes each choice itself. The routing-sensitive bound of the
// top-k config (1.0 FP8, 0.5 BF16; worst seen 0.50 and 0.18) only catches a broken MoE;
// MoeAllExpertsAgainstFp32 bounds those tensors tightly.

// Without experts nothing is discontinuous: every gradient tensor is bounded.
TEST(ModelRecipes, DenseAgainstFp32) {
  ModelConfig c = tiny_config();
  c.name = "tiny-dense";
  c.n_routed_experts = 0;
  c.first_k_dense_replace = c.num_hidden_layers;
  compare_recipes(c, {{"bf16", {3.8e-5, 1.5e-4, 5.7e-5, 6.1e-5, 0}},
                      {"bf16+bf16", {4e-5, 2.1e-4, 5.7e-5, 8.5e-5, 0}},
                      {"fp8", {5.3e-3, 2.3e-2, 1e-2, 8.2e-4, 0}},
                      {"fp8+bf16", {5.1e-3, 2.1e-2, 1e-2, 8.9e-4, 0}},
                      {"fp8-no-promotion", {5.1e-3, 2.1e-2, 1e-2, 9.1e-4, 0}},
                      {"fp8-per-tensor", {8.5e-3, 3.4e-2, 1.1e-2, 1.2e-3, 0}},
                      {"fp8-f32-cache", {5.1e-3, 2.1e-2, 1e-2, 8.9e-4, 0}}});
}

// Every token to every routed expert (2 of 2): the MoE layer's FP8 paths (dispatch quantization,
// grouped GEMMs, combine) without routing flips, so every gradient tensor, the routed experts', the
// router's and the post-attention norm's included, is bounded as tightly as the rest.
TEST(ModelRecipes, MoeAllExpertsAgainstFp32) {
  ModelConfig c = tiny_config();
  c.name = "tiny-all-experts";
  c.n_routed_experts = 2;
  c.num_experts_per_tok = 2;
  c.n_group = 1;
  c.topk_group = 1;
  compare_recipes(c, {{"bf16", {3.6e-5, 2.3e-4, 5.1e-5, 8.7e-5, 0}},
                      {"bf16+bf16", {3.9e-5, 2.7e-4, 5.6e-5, 8.6e-5, 0}},
                      {"fp8", {9.1e-3, 7.1e-2, 1.1e-2, 1.3e-3, 0}},
                      {"fp8+bf16", {8.8e-3, 5.6e-2, 1.1e-2, 1.3e-3, 0}},
                      {"fp8-no-promotion", {9.1e-3, 6.3e-2, 1.1e-2, 1.3e-3, 0}},
                      {"fp8-per-tensor", {7.9e-3, 7e-2, 1e-2, 1.1e-3, 0}},
                      {"fp8-f32-cache", {8.8e-3, 6.4e-2, 1e-2, 1.2e-3, 0}}});
}

TEST(ModelRecipes, MoeAgainstFp32) {
  compare_recipes(tiny_config(), {{"bf16", {4e-4, 2e-3, 9.2e-4, 2.2e-4, 0.5}},
                                  {"bf16+bf16", {4.9e-4, 2e-3, 9.1e-4, 1.3e-4, 0.5}},
                                  {"fp8", {5.8e-3, 2.4e-2, 1.8e-2, 1.6e-3, 1.0}},
                                  {"fp8+bf16", {5.9e-3, 2.4e-2, 1.9e-2, 1.5e-3, 1.0}},
                                  {"fp8-no-promotion", {6.1e-3, 2.3e-2, 1.8e-2, 1.4e-3, 1.0}},
                                  {"fp8-per-tensor", {9.7e-3, 3.8e-2, 1.8e-2, 1.6e-3, 1.0}},
                                  {"fp8-f32-cache", {6.5e-3, 2.4e-2, 1.6e-2, 1.5e-3, 1.0}}});
}

TEST(ModelMemory, MeasuredEqualsPredictedAndFp8KeepsLess) {
  auto rng = make_rng();
  const uint64_t seed = rng();
  const ModelConfig c = tiny_config();
  auto [tok, tgt] = random_batch(rng, c);
  const int64_t T = c.batch_size * c.seq_len;
  std::map<std::string, int64_t> totals;
  std::vector<std::vector<int64_t>> fp8_loads;
  for (const std::string name : {"fp32", "bf16", "fp8", "fp8-f32-cache"}) {
    const RecipeRun r = run_recipe(name, seed, tok, tgt);
    const MemoryAccount pred = predict_memory(c, Recipe::from_name(name), T, &r.st.expert_loads);
    const auto mp = r.memory.bytes_per_layer(), pp = pred.bytes_per_layer();
    EXPECT_EQ(mp, pp) << name;
    ASSERT_EQ(r.memory.items.size(), pred.items.size()) << name;
    for (size_t i = 0; i < pred.items.size(); ++i) {
      EXPECT_EQ(r.memory.items[i].layer, pred.items[i].layer);
      EXPECT_EQ(r.memory.items[i].tensor, pred.items[i].tensor);
      EXPECT_EQ(r.memory.items[i].bytes, pred.items[i].bytes) << name << " " << pred.items[i].layer << " " << pred.items[i].tensor;
    }
    totals[name] = r.memory.total_bytes();
    if (name == "fp8") fp8_loads = r.st.expert_loads;
    std::cout << "[ memory   ] " << name << ": " << r.memory.total_bytes() << " bytes kept\n";
  }
  EXPECT_LT(totals["bf16"], totals["fp32"]);
  // The saving of the caching choices at the same routing (the recipes route differently, and
  // each expert's rows are padded to 128): every tensor cached as BF16 (2 bytes) is cached as E4M3
  // (1 byte, padded to 128 tokens for Linear inputs, + 4-byte scales per 128) or, for the
  // attention-out input, as E5M6 (1.5 bytes, packed), and each sublayer's input x and the MTP's
  // copy of the trunk output h, FP32 in bf16, are kept in BF16. Nothing else differs between the
  // two accounts, so the saving is the difference of their totals.
  const auto saving = [&c](int64_t tokens, const std::vector<std::vector<int64_t>>* loads) {
    const MemoryAccount bf = predict_memory(c, Recipe::from_name("bf16"), tokens, loads),
                        f8 = predict_memory(c, Recipe::from_name("fp8"), tokens, loads);
    int64_t s = 0;
    for (const auto& it : bf.items)
      if (it.dtype == DType::bf16 || it.tensor == "x" || it.tensor == "h") s += it.bytes;
    for (const auto& it : f8.items)
      if (it.dtype == DType::e4m3 || it.dtype == DType::e5m6 || it.tensor.ends_with(".scales") || it.tensor == "x" ||
          it.tensor == "h")
        s -= it.bytes;
    EXPECT_EQ(s, bf.total_bytes() - f8.total_bytes());
    return s;
  };
  const int64_t observed = saving(T, &fp8_loads), balanced = saving(T, nullptr), large = saving(4096, nullptr);
  std::cout << "[ memory   ] bf16 - fp8 at the fp8 run's routing " << observed << " bytes, balanced routing " << balanced
            << ", at 4096 tokens " << large << "\n";
  EXPECT_GT(observed, 0);
  EXPECT_GT(balanced, 0);
  EXPECT_GT(large, 0);
}

// The MTP module keeps the trunk output h as the sublayers keep their inputs (BF16 in the FP8
// recipes, the activation dtype otherwise), the token ids and the two rstd, and recomputes the
// embedding and eh_proj's input (the two norm outputs) for its backward.
// Catches: eh_proj's input cached from forward (FP8 tiles in fp8), the embedding kept, h kept in
// FP32 in fp8 (keep_residual dropped for the trunk output).
// Seen failing: with the module as it was (eh_proj's input cached, the embedding kept; model and
// account: emb f32 and eh_in listed, 784 bytes per token in fp8 instead of 268, 1544 in fp32
// instead of 524), and with h kept as the FP32 trunk output in fp8 (h f32, 524 bytes per token).
TEST(ModelMemory, MtpKeepsTheTrunkOutputAsSublayersKeepTheirInputs) {
  auto rng = make_rng();
  const uint64_t seed = rng();
  const ModelConfig c = tiny_config();
  auto [tok, tgt] = random_batch(rng, c);
  const int64_t T = c.batch_size * c.seq_len, D = c.hidden_size;
  const std::string eh = "layers." + std::to_string(c.num_hidden_layers) + ".eh";
  for (const std::string name : {"fp32", "bf16", "fp8"}) {
    const Recipe r = Recipe::from_name(name);
    const RecipeRun run = run_recipe(name, seed, tok, tgt);
    std::map<std::string, std::string_view> kept;  // tensor -> dtype
    int64_t bytes = 0;
    for (const auto& it : run.memory.items)
      if (it.layer == eh) kept[it.tensor] = dtype_name(it.dtype), bytes += it.bytes;
    const std::map<std::string, std::string_view> expected{{"h", dtype_name(r.residual_cache)},
                                                           {"ids", "i32"},
                                                           {"rstd_e", dtype_name(r.act_dtype)},
                                                           {"rstd_h", dtype_name(r.act_dtype)}};
    EXPECT_EQ(kept, expected) << name << ": only the norms' inputs (h, the ids of the embedding) and rstd";
    EXPECT_EQ(bytes, T * (int64_t(dtype_size(r.residual_cache)) * D + 4 + 2 * int64_t(dtype_size(r.act_dtype)))) << name;
    std::cout << "[ memory   ] " << name << " " << eh << ": " << double(bytes) / double(T) << " bytes per token\n";
  }
}

// What the allocator holds, not the account: the backend's live bytes grow, over each trunk
// layer's forward, by exactly what the account lists for it plus its output y, less its input x
// where the layer keeps x itself (allocated before, kept by reference) rather than a BF16 copy. FP8MOE_MEMORY_CONFIG=<json> measures another config (one
// sequence of its seq_len tokens), e.g. configs/medium.json for docs/MODEL.md.
TEST(ModelMemory, AllocatorHoldsWhatTheAccountLists) {
  ModelConfig c = tiny_config();
  if (const char* path = std::getenv("FP8MOE_MEMORY_CONFIG")) {
    c = load_config(path);
    c.batch_size = 1;
  }
  auto rng = make_rng();
  auto [tok, tgt] = random_batch(rng, c);
  const int64_t T = c.batch_size * c.seq_len;
  for (const std::string name : {"bf16", "fp8"}) {
    auto be = make_backend("cpu");
    Model model(c, Recipe::from_name(name), *be, rng());
    const Batch b = model.make_batch(tok.view(), tgt.view());
    Tensor x = model.embed_forward(b);
    std::vector<std::unique_ptr<Saved>> saved;
    std::vector<std::pair<std::string, int64_t>> measured;  // per trunk layer
    std::vector<std::vector<int64_t>> loads;                // per MoE layer, for the account
    for (Layer* layer : model.trunk()) {
      const int64_t before = be->device_memory_in_use();
      Tensor y;
      saved.push_back(layer->forward(b, x, y));
      const int64_t grew = be->device_memory_in_use() - before;
      const bool x_itself = Recipe::from_name(name).residual_cache == x.dtype();
      measured.emplace_back(layer->name(), grew + (x_itself ? int64_t(x.view().nbytes()) : 0) - int64_t(y.view().nbytes()));
      const auto l = layer->expert_loads(*saved.back());
      if (!l.empty()) loads.push_back(l);
      x = y;
    }
    loads.resize(size_t(c.num_moe_layers()), std::vector<int64_t>(size_t(c.n_routed_experts), 0));  // the MTP's
    const auto per_layer = predict_memory(c, Recipe::from_name(name), T, &loads).bytes_per_layer();
    int64_t measured_total = 0, account_total = 0;
    for (const auto& [layer, kept] : measured) {
      EXPECT_EQ(kept, per_layer.at(layer)) << name << " " << layer;
      measured_total += kept;
      account_total += per_layer.at(layer);
    }
    std::cout << "[ memory   ] " << c.name << " " << name << ": trunk keeps " << measured_total << " bytes for " << T
              << " tokens (allocator), " << double(measured_total) / double(T) / double(saved.size())
              << " bytes per token and sublayer; account " << account_total << "\n";
  }
}

// The account itemized per token for DeepSeek-V3 (configs/deepseek-v3.json, 4096 tokens, balanced
// routing): one attention and one MoE layer and the MTP's own part, the report's recipe against
// BF16, as docs/MODEL.md lists it (`fp8moe model` prints every layer kind). The attention-out
// cache takes 0.75 of BF16's bytes (plus its scales); no RMSNorm output is kept.
TEST(ModelMemory, ItemizedPerTokenDeepSeekV3) {
  const ModelConfig c = load_config(source_dir() + "/configs/deepseek-v3.json");
  const int64_t T = 4096;
  const MemoryAccount bf = predict_memory(c, Recipe::from_name("bf16"), T),
                      f8 = predict_memory(c, Recipe::from_name("fp8"), T);
  for (const std::string layer : {"layers.3.attn", "layers.3.moe", "layers.61.eh"}) {
    std::map<std::string, std::pair<double, double>> per_token;  // tensor -> bf16, fp8 bytes per token
    std::vector<std::string> order;
    for (const auto* acc : {&bf, &f8})
      for (const auto& it : acc->items) {
        if (it.layer != layer) continue;
        const std::string& name = it.tensor;
        if (!per_token.count(name)) order.push_back(name);
        (acc == &bf ? per_token[name].first : per_token[name].second) += double(it.bytes) / double(T);
      }
    double sb = 0, s8 = 0;
    std::cout << "[ memory   ] " << layer << " bytes per token: tensor | bf16 | fp8\n";
    for (const auto& n : order) {
      std::cout << "    " << n << " | " << per_token[n].first << " | " << per_token[n].second << "\n";
      sb += per_token[n].first, s8 += per_token[n].second;
      EXPECT_EQ(n.find("norm_out"), std::string::npos) << "RMSNorm outputs are recomputed";
    }
    std::cout << "    total | " << sb << " | " << s8 << " (" << s8 / sb << " of BF16)\n";
  }
  // The MTP's own part: the trunk output as the sublayers keep their inputs, the ids, two rstd.
  const auto per_token = [T](const MemoryAccount& m, const std::string& layer) {
    return double(m.bytes_per_layer().at(layer)) / double(T);
  };
  EXPECT_EQ(per_token(bf, "layers.61.eh"), 4.0 * double(c.hidden_size) + 12);
  EXPECT_EQ(per_token(f8, "layers.61.eh"), 2.0 * double(c.hidden_size) + 12);
  for (const auto& it : f8.items)
    if (it.tensor == "attn_out") {
      EXPECT_EQ(it.dtype, DType::e5m6);
      EXPECT_EQ(it.bytes * 4, T * c.num_attention_heads * c.v_head_dim * 2 * 3) << it.layer;
    }
}

}  // namespace
}  // namespace fp8moe::testing
