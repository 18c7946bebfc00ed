// MTP speculative decoding: greedy output identical to plain greedy decoding, the logits of every
// token bit for bit (its log-probability). On a random model (drafts mostly rejected), on one
// built so that the MTP module predicts exactly what the main model will (every draft accepted:
// the accept path and its cache bookkeeping), and over 300 tokens of one where it mostly does, in
// the fp32, bf16 and fp8 recipes with the fp8 cache (both paths, the rejected drafts' latents
// left past the sequence's length). The verification step itself: its two rows are the logits of
// decoding the tokens one by one. Sampling (temperature > 0) by rejection: the tokens distributed
// as plain sampling's. On the backend FP8MOE_SERVE_BACKEND names (cpu by default).
// Run: ctest --test-dir build -R test_serve   (or build/tests/serve/test_serve --gtest_filter='ServeSpeculative*')
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "fp8moe/model.hpp"
#include "serve/generate.hpp"
#include "serve_testing.hpp"
#include "testing.hpp"

namespace fp8moe::serve {
namespace {

std::unique_ptr<Model> test_model(Backend& be, const std::string& recipe = "fp32", int64_t context = 256) {
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  cfg.initializer_range = 0.1;
  cfg.max_position_embeddings = context;
  return std::make_unique<Model>(cfg, Recipe::from_name(recipe), be, 11);
}

const std::string kPrompt = "speculative decoding with the MTP module ";

GenerateResult run(Engine& e, bool speculative, int64_t n) {
  GenerateOptions o;
  o.max_tokens = n;
  o.prefill_chunk = 16;  // the MTP prefill over several chunks
  return speculative ? generate_speculative(e, kPrompt, o) : generate(e, kPrompt, o);
}

EngineOptions mtp_options(CacheDType cache = CacheDType::f32, int64_t blocks = 4) {
  EngineOptions o;
  o.cache = cache;
  o.cache_blocks = blocks;
  o.mtp = true;
  o.batch_invariant = true;
  return o;
}

void expect_same_output(const GenerateResult& spec, const GenerateResult& plain) {
  EXPECT_EQ(spec.tokens, plain.tokens);
  EXPECT_EQ(spec.text, plain.text);
  ASSERT_EQ(spec.logprobs.size(), plain.logprobs.size());
  int64_t differ = 0, first = -1;
  for (size_t i = 0; i < spec.logprobs.size(); ++i)
    if (std::memcmp(&spec.logprobs[i], &plain.logprobs[i], sizeof(float)) != 0) {
      if (first < 0) first = int64_t(i);
      ++differ;
    }
  EXPECT_EQ(differ, 0) << "tokens whose logits differ from plain decoding's, the first at " << first;
}

// The weights of `m` scaled: o_proj by `o_scale`, down_proj to zero, eh_proj = [I | 0].
void shape_for_drafts(Model& m, Backend& be, float o_scale) {
  const int64_t D = m.config().hidden_size;
  for (Parameter& p : m.parameters()) {
    Tensor h = be.to_host(p.weight);
    float* w = h.ptr<float>();
    if (p.name.ends_with("o_proj.weight")) {
      for (int64_t i = 0; i < h.numel(); ++i) w[i] *= o_scale;
    } else if (p.name.ends_with("down_proj.weight")) {
      std::fill(w, w + h.numel(), 0.0f);
    } else if (p.name.ends_with("eh_proj.weight")) {
      std::fill(w, w + h.numel(), 0.0f);
      for (int64_t i = 0; i < D; ++i) w[i * 2 * D + i] = 1.0f;
    } else {
      continue;
    }
    be.copy(p.weight.view(), h.view());
  }
}

TEST(ServeSpeculative, GreedyOutputOfARandomModel) {
  auto be = make_backend(testing_env::backend_name());
  auto m = test_model(*be);
  Engine e(weights_of(*m), *be, mtp_options());
  const GenerateResult plain = run(e, false, 60), spec = run(e, true, 60);
  std::cout << "random model: " << spec.accepted << " of " << spec.drafted << " drafts accepted, "
            << spec.main_steps << " main steps for " << spec.tokens.size() << " tokens\n";
  expect_same_output(spec, plain);
  EXPECT_EQ(spec.main_steps, int64_t(spec.tokens.size()) - spec.accepted);
}

// Sublayers without output (o_proj, down_proj zero) make the trunk output the embedding: the main
// model's next token is g(current token). eh_proj = [I | 0] makes the MTP block's input
// enorm(embed(t + 1)) and its output, under the shared head, g(token t + 1): the main model's
// next choice, so every draft is right.
TEST(ServeSpeculative, EveryDraftAcceptedWhenTheMtpModuleIsExact) {
  auto be = make_backend(testing_env::backend_name());
  auto m = test_model(*be);
  shape_for_drafts(*m, *be, 0.0f);
  Engine e(weights_of(*m), *be, mtp_options());
  const GenerateResult plain = run(e, false, 50), spec = run(e, true, 50);
  std::cout << "exact MTP: " << spec.accepted << " of " << spec.drafted << " drafts accepted, " << spec.main_steps
            << " main steps for " << spec.tokens.size() << " tokens (plain: " << plain.main_steps << ")\n";
  expect_same_output(spec, plain);
  EXPECT_EQ(spec.accepted, spec.drafted);
  EXPECT_LE(spec.main_steps, int64_t(spec.tokens.size()) / 2 + 1);
  EngineOptions variant = mtp_options();
  variant.batch_invariant = false;
  Engine e2(weights_of(*m), *be, variant);
  testing::expect_error([&] { generate_speculative(e2, "x", GenerateOptions{}); }, "needs EngineOptions::batch_invariant");
}

// A small attention output keeps the MTP module's draft mostly right while every logit depends on
// the attention's rounding: 300 tokens with many accepted and some rejected drafts, each token's
// logits those of plain decoding bit for bit, in the three recipes over the fp8 cache.
class ServeSpeculativeLong : public ::testing::TestWithParam<std::string> {};

TEST_P(ServeSpeculativeLong, PlainGreedyTextAndLogitsOver300Tokens) {
  auto be = make_backend(testing_env::backend_name());
  auto m = test_model(*be, GetParam(), 512);
  shape_for_drafts(*m, *be, 0.05f);
  Engine e(weights_of(*m), *be, mtp_options(CacheDType::fp8, 8));
  const int64_t n = 320;
  const GenerateResult plain = run(e, false, n), spec = run(e, true, n);
  std::cout << GetParam() << ": " << spec.accepted << " of " << spec.drafted << " drafts accepted, "
            << spec.main_steps << " main steps for " << spec.tokens.size() << " tokens\n";
  ASSERT_EQ(int64_t(plain.tokens.size()), n);
  expect_same_output(spec, plain);
  EXPECT_GT(spec.accepted, spec.drafted / 2) << "the drafts should mostly be right";
  EXPECT_LT(spec.accepted, spec.drafted) << "the reject path should run too";
}

INSTANTIATE_TEST_SUITE_P(Recipes, ServeSpeculativeLong, ::testing::Values("fp32", "bf16", "fp8"));

// The verification step's rows (SeqChunk::decode) against decoding the same tokens one per step:
// the same logits bit for bit, and the same latents in the cache.
TEST(ServeSpeculative, VerifiedRowsAreTheDecodeSteps) {
  auto be = make_backend(testing_env::backend_name());
  for (const std::string recipe : {"fp32", "fp8"}) {
    auto m = test_model(*be, recipe);
    Engine e(weights_of(*m), *be, mtp_options(CacheDType::fp8));
    BlockAllocator alloc(e.cache().blocks());
    std::vector<int32_t> table;
    ASSERT_TRUE(alloc.allocate(2, table));
    const std::vector<int32_t> p = encode_text(kPrompt + kPrompt);  // 84 tokens: across a block
    const int64_t P = int64_t(p.size()), V = e.config().vocab_size;
    e.step({{&table, 0, p}});
    const Tensor l0 = e.step({{&table, P, {7}}}), l1 = e.step({{&table, P + 1, {99}}});
    const Tensor c1 = be->to_host(e.cache().read(0, table, P + 2));
    const Tensor both = e.step({{&table, P, {7, 99}, 2, true}});
    const Tensor c2 = be->to_host(e.cache().read(0, table, P + 2));
    ASSERT_EQ(both.size(0), 2);
    EXPECT_EQ(0, std::memcmp(both.ptr<float>(), l0.ptr<float>(), size_t(V) * 4)) << recipe << ": row 0";
    EXPECT_EQ(0, std::memcmp(both.ptr<float>() + V, l1.ptr<float>(), size_t(V) * 4)) << recipe << ": row 1";
    EXPECT_EQ(0, std::memcmp(c1.ptr<float>(), c2.ptr<float>(), size_t((P + 2) * c1.size(1)) * 4)) << recipe << ": cache";
  }
}

// Speculative sampling: the first drafted token (the second generated) over 3000 seeds against
// plain sampling's distribution of it, computed exactly from the main model's logits: p(t) =
// sum_m p1(m) p2(t | m) under the sampler's truncation (temperature 1, top-k 6). Chi-square over
// the tokens of expected count >= 5 (the rest pooled), rejected at p = 1e-4 (Wilson-Hilferty).
// With a small attention output the MTP module's distribution overlaps the main model's by about
// half: a rule that kept every draft, or none, fails by far; both paths run.
TEST(ServeSpeculative, SampledTokensDistributedAsPlainSampling) {
  auto be = make_backend(testing_env::backend_name());
  auto m = test_model(*be);
  shape_for_drafts(*m, *be, 0.05f);
  Engine e(weights_of(*m), *be, mtp_options());
  GenerateOptions o;
  o.max_tokens = 2;
  o.sampling.temperature = 1;
  o.sampling.top_k = 6;
  const std::string prompt = "MTP";
  const int64_t V = e.config().vocab_size, P = int64_t(prompt.size());
  std::vector<double> want(static_cast<size_t>(V), 0.0);
  {
    BlockAllocator alloc(e.cache().blocks());
    std::vector<int32_t> table;
    ASSERT_TRUE(alloc.allocate(1, table));
    const Sampler s(o.sampling);
    const Tensor l1 = e.step({{&table, 0, encode_text(prompt)}});
    const std::vector<double> p1 = s.distribution(l1.ptr<float>(), V);
    for (int64_t t = 0; t < V; ++t) {
      if (p1[size_t(t)] == 0) continue;
      const Tensor l2 = e.step({{&table, P, {int32_t(t)}}});
      const std::vector<double> p2 = s.distribution(l2.ptr<float>(), V);
      for (int64_t u = 0; u < V; ++u) want[size_t(u)] += p1[size_t(t)] * p2[size_t(u)];
    }
  }
  const int64_t N = 3000;
  std::vector<int64_t> seen(static_cast<size_t>(V), 0);
  int64_t accepted = 0;
  for (int64_t seed = 1; seed <= N; ++seed) {
    o.sampling.seed = uint64_t(seed);
    const GenerateResult r = generate_speculative(e, prompt, o);
    ASSERT_EQ(r.tokens.size(), 2u);
    ++seen[size_t(r.tokens[1])];
    accepted += r.accepted;
  }
  double chi2 = 0, pooled_want = 0, pooled_seen = 0;
  int64_t bins = 0;
  for (int64_t t = 0; t < V; ++t) {
    const double expect = double(N) * want[size_t(t)];
    if (expect >= 5) {
      chi2 += (double(seen[size_t(t)]) - expect) * (double(seen[size_t(t)]) - expect) / expect;
      ++bins;
    } else {
      pooled_want += expect;
      pooled_seen += double(seen[size_t(t)]);
    }
  }
  if (pooled_want > 0 || pooled_seen > 0) {
    chi2 += (pooled_seen - pooled_want) * (pooled_seen - pooled_want) / std::max(pooled_want, 1.0);
    ++bins;
  }
  const double df = double(bins - 1), z = 3.719;  // one-sided p = 1e-4
  const double critical = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
  std::cout << "speculative sampling: " << accepted << " of " << N << " drafts accepted; chi2 " << chi2 << " over "
            << bins << " bins (critical " << critical << " at p = 1e-4)\n";
  EXPECT_LT(chi2, critical);
  EXPECT_GT(accepted, N / 20);
  EXPECT_LT(accepted, N - N / 20);
}

}  // namespace
}  // namespace fp8moe::serve
