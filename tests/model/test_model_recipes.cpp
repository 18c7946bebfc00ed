// The recipes on the tiny config (configs/tiny.json): bf16 and the FP8 recipes against the fp32
// oracle from the same weights and batch, per tensor with calc_diff (logits and every gradient)
// and the relative loss error; and the memory account: the bytes each layer keeps, measured after
// forward_backward, equal the analytic prediction, and FP8 keeps less than BF16 by the caching.
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

struct Bounds {
  double logits, grads, all_grads, loss_rel;
};

void compare_recipes(const ModelConfig& cfg, const std::map<std::string, Bounds>& bounds) {
  auto rng = make_rng();
  const uint64_t seed = rng();
  auto [tok, tgt] = random_batch(rng, cfg);
  const RecipeRun ref = run_recipe("fp32", seed, tok, tgt, cfg);
  const bool moe = cfg.num_moe_layers() > 0;
  std::cout << "[ recipe   ] " << cfg.name << " fp32: loss " << ref.st.loss << " (main " << ref.st.main_loss << ", mtp "
            << ref.st.mtp_loss << ", balance " << ref.st.balance_loss << ") " << ref.seconds << " s\n";
  EXPECT_NEAR(ref.st.main_loss, std::log(double(cfg.vocab_size)), 0.1) << "an untrained model predicts uniformly";
  for (const auto& [name, b] : bounds) {
    const RecipeRun r = run_recipe(name, seed, tok, tgt, cfg);
    double worst = 0;
    std::string worst_name;
    std::vector<double> all_r, all_ref;
    for (const auto& [pname, g] : ref.grads) {
      const auto& gr = r.grads.at(pname);
      all_r.insert(all_r.end(), gr.begin(), gr.end());
      all_ref.insert(all_ref.end(), g.begin(), g.end());
      const double d = calc_diff(gr, g);
      if (std::getenv("FP8MOE_VERBOSE")) std::cout << "    " << name << " " << pname << " " << d << "\n";
      if (moe && routing_sensitive(pname)) continue;
      if (d > worst) worst = d, worst_name = pname;
    }
    const double dall = calc_diff(all_r, all_ref);
    const double dl = calc_diff(r.logits, ref.logits);
    const double loss_rel = std::fabs(r.st.main_loss - ref.st.main_loss) / ref.st.main_loss;
    std::cout << "[ recipe   ] " << cfg.name << " " << name << ": main-loss rel error " << loss_rel << ", logits calc_diff "
              << dl << ", gradients calc_diff: worst " << worst << " (" << worst_name << ")"
              << (moe ? " outside routing" : "") << ", all " << dall << "; " << r.seconds << " s\n";
    EXPECT_LT(dl, b.logits) << name;
    EXPECT_LT(worst, b.grads) << name << " " << worst_name;
    EXPECT_LT(dall, b.all_grads) << name;
    EXPECT_LT(loss_rel, b.loss_rel) << name;
  }
}

// Without experts nothing is discontinuous: every gradient tensor is bounded.
TEST(ModelRecipes, DenseAgainstFp32) {
  ModelConfig c = tiny_config();
  c.name = "tiny-dense";
  c.n_routed_experts = 0;
  c.first_k_dense_replace = c.num_hidden_layers;
  compare_recipes(c, {{"bf16", {2e-4, 2e-3, 1e-3, 2e-3}},
                      {"bf16+bf16", {2e-4, 2e-3, 1e-3, 2e-3}},
                      {"fp8", {5e-3, 2e-2, 1e-2, 3e-3}},
                      {"fp8+bf16", {5e-3, 2e-2, 1e-2, 3e-3}},
                      {"fp8-no-promotion", {5e-3, 2e-2, 1e-2, 3e-3}},
                      {"fp8-per-tensor", {1e-2, 5e-2, 2e-2, 5e-3}},
                      {"fp8-f32-cache", {5e-3, 2e-2, 1e-2, 3e-3}}});
}

TEST(ModelRecipes, MoeAgainstFp32) {
  compare_recipes(tiny_config(), {{"bf16", {1e-3, 2e-3, 2e-2, 2e-3}},
                                  {"bf16+bf16", {1e-3, 2e-3, 2e-2, 2e-3}},
                                  {"fp8", {5e-3, 2e-2, 5e-2, 3e-3}},
                                  {"fp8+bf16", {5e-3, 2e-2, 5e-2, 3e-3}},
                                  {"fp8-no-promotion", {5e-3, 2e-2, 5e-2, 3e-3}},
                                  {"fp8-per-tensor", {1e-2, 5e-2, 1e-1, 5e-3}},
                                  {"fp8-f32-cache", {5e-3, 2e-2, 5e-2, 3e-3}}});
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
  // attention-out input, as E5M6 (2 bytes of storage). Nothing else differs between the two
  // accounts, so the saving is the difference of their totals.
  const auto saving = [&c](int64_t tokens, const std::vector<std::vector<int64_t>>* loads) {
    const MemoryAccount bf = predict_memory(c, Recipe::from_name("bf16"), tokens, loads),
                        f8 = predict_memory(c, Recipe::from_name("fp8"), tokens, loads);
    int64_t s = 0;
    for (const auto& it : bf.items)
      if (it.dtype == DType::bf16) s += it.bytes;
    for (const auto& it : f8.items)
      if (it.dtype == DType::e4m3 || it.dtype == DType::e5m6 || it.tensor.ends_with(".scales")) s -= it.bytes;
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

}  // namespace
}  // namespace fp8moe::testing
