// MTP speculative decoding: greedy output identical to plain greedy decoding, on a random model
// (drafts mostly rejected) and on one built so that the MTP module predicts exactly what the main
// model will (every draft accepted: the accept path and its cache bookkeeping).
// Run: ctest --test-dir build -R test_serve
#include <gtest/gtest.h>

#include "fp8moe/model.hpp"
#include "serve/generate.hpp"
#include "serve_testing.hpp"
#include "testing.hpp"

namespace fp8moe::serve {
namespace {

std::unique_ptr<Model> test_model(Backend& be) {
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  cfg.initializer_range = 0.1;
  return std::make_unique<Model>(cfg, Recipe::from_name("fp32"), be, 11);
}

GenerateResult run(Engine& e, bool speculative, int64_t n) {
  GenerateOptions o;
  o.max_tokens = n;
  o.prefill_chunk = 16;  // the MTP prefill over several chunks
  const std::string prompt = "speculative decoding with the MTP module ";
  return speculative ? generate_speculative(e, prompt, o) : generate(e, prompt, o);
}

EngineOptions mtp_options() {
  EngineOptions o;
  o.cache = CacheDType::f32;
  o.cache_blocks = 4;
  o.mtp = true;
  return o;
}

TEST(ServeSpeculative, GreedyOutputOfARandomModel) {
  auto be = make_backend(testing_env::backend_name());
  auto m = test_model(*be);
  Engine e(weights_of(*m), *be, mtp_options());
  const GenerateResult plain = run(e, false, 60), spec = run(e, true, 60);
  std::cout << "random model: " << spec.accepted << " of " << spec.drafted << " drafts accepted, "
            << spec.main_steps << " main steps for " << spec.tokens.size() << " tokens\n";
  EXPECT_EQ(spec.tokens, plain.tokens);
  EXPECT_EQ(spec.text, plain.text);
  EXPECT_EQ(spec.main_steps, int64_t(spec.tokens.size()) - spec.accepted);
}

// Sublayers without output (o_proj, down_proj zero) make the trunk output the embedding: the main
// model's next token is g(current token). eh_proj = [I | 0] makes the MTP block's input
// enorm(embed(t + 1)) and its output, under the shared head, g(token t + 1): the main model's
// next choice, so every draft is right.
TEST(ServeSpeculative, EveryDraftAcceptedWhenTheMtpModuleIsExact) {
  auto be = make_backend(testing_env::backend_name());
  auto m = test_model(*be);
  const int64_t D = m->config().hidden_size;
  for (Parameter& p : m->parameters()) {
    Tensor h = be->to_host(p.weight);
    if (p.name.ends_with("o_proj.weight") || p.name.ends_with("down_proj.weight")) {
      std::fill(h.ptr<float>(), h.ptr<float>() + h.numel(), 0.0f);
    } else if (p.name.ends_with("eh_proj.weight")) {
      std::fill(h.ptr<float>(), h.ptr<float>() + h.numel(), 0.0f);
      for (int64_t i = 0; i < D; ++i) h.ptr<float>()[i * 2 * D + i] = 1.0f;
    } else {
      continue;
    }
    be->copy(p.weight.view(), h.view());
  }
  Engine e(weights_of(*m), *be, mtp_options());
  const GenerateResult plain = run(e, false, 50), spec = run(e, true, 50);
  std::cout << "exact MTP: " << spec.accepted << " of " << spec.drafted << " drafts accepted, " << spec.main_steps
            << " main steps for " << spec.tokens.size() << " tokens (plain: " << plain.main_steps << ")\n";
  EXPECT_EQ(spec.tokens, plain.tokens);
  EXPECT_EQ(spec.accepted, spec.drafted);
  EXPECT_LE(spec.main_steps, int64_t(spec.tokens.size()) / 2 + 1);
  GenerateOptions o;
  o.sampling.temperature = 1;
  testing::expect_error([&] { generate_speculative(e, "x", o); }, "temperature must be 0");
}

}  // namespace
}  // namespace fp8moe::serve
