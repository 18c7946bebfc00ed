// EngineOptions::batch_invariant: a decode token's logits are the same bits whether it is decoded
// alone or in a step with other sequences of other lengths, a prefill chunk and the two verified
// rows of a draft (8 rows, the most the option covers), in the fp32, bf16 and fp8 recipes with the
// fp8 and bf16 caches. On the backend FP8MOE_SERVE_BACKEND names (cpu by default): on the GPU the
// decode attention's split count and cuBLASLt's algorithm would otherwise follow the batch.
// Run: build/tests/serve/test_serve --gtest_filter='ServeBatchInvariance*'
#include <gtest/gtest.h>

#include <cstring>

#include "fp8moe/model.hpp"
#include "serve/engine.hpp"
#include "serve_testing.hpp"
#include "testing.hpp"

namespace fp8moe::serve {
namespace {

struct InvarianceCase {
  std::string recipe;
  CacheDType cache;
};

class ServeBatchInvariance : public ::testing::TestWithParam<InvarianceCase> {};

TEST_P(ServeBatchInvariance, DecodeLogitsAloneOrInABatch) {
  auto be = make_backend(testing_env::backend_name());
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  cfg.initializer_range = 0.1;
  Model model(cfg, Recipe::from_name(GetParam().recipe), *be, 13);
  EngineOptions o;
  o.cache = GetParam().cache;
  o.cache_blocks = 16;
  o.batch_invariant = true;
  Engine e(weights_of(model), *be, o);
  const int64_t V = cfg.vocab_size;
  BlockAllocator alloc(e.cache().blocks());
  // Sequences A, B, C (decoded) of 70, 5 and 190 tokens, and D (prefilled during the step).
  const std::vector<int64_t> len = {70, 5, 190};
  std::vector<std::vector<int32_t>> tables(4);
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(V) - 1);
  auto tokens = [&](int64_t n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int32_t& x : t) x = tok(rng);
    return t;
  };
  for (size_t s = 0; s < 4; ++s) ASSERT_TRUE(alloc.allocate(s < 3 ? blocks_for(len[s] + 2) : 1, tables[s]));
  for (size_t s = 0; s < 3; ++s) e.step({{&tables[s], 0, tokens(len[s])}});
  const std::vector<int32_t> d_prompt = tokens(3);
  // One step: B, A, D's prompt, C and the draft after it (verification rows): 1 + 1 + 3 + 2 rows.
  const Tensor batch = e.step({{&tables[1], len[1], {11}},
                               {&tables[0], len[0], {42}},
                               {&tables[3], 0, d_prompt},
                               {&tables[2], len[2], {5, 77}, 2, true}});
  ASSERT_EQ(batch.size(0), 5);
  // Each decode token alone (A and B rewrite their latents with the same bits; C's two tokens one
  // step each).
  const Tensor a = e.step({{&tables[0], len[0], {42}}}), b = e.step({{&tables[1], len[1], {11}}});
  const Tensor c0 = e.step({{&tables[2], len[2], {5}}}), c1 = e.step({{&tables[2], len[2] + 1, {77}}});
  auto same = [&](int64_t row, const Tensor& alone, const char* what) {
    EXPECT_EQ(0, std::memcmp(batch.ptr<float>() + row * V, alone.ptr<float>(), size_t(V) * sizeof(float)))
        << GetParam().recipe << ": " << what << " differs between the batch and its step alone";
  };
  same(0, b, "B (5 tokens)");
  same(1, a, "A (70 tokens)");
  same(3, c0, "C (190 tokens)");
  same(4, c1, "C's verified draft");
}

INSTANTIATE_TEST_SUITE_P(Recipes, ServeBatchInvariance,
                         ::testing::Values(InvarianceCase{"fp32", CacheDType::fp8}, InvarianceCase{"bf16", CacheDType::fp8},
                                           InvarianceCase{"fp8", CacheDType::fp8}, InvarianceCase{"fp8", CacheDType::bf16}),
                         [](const auto& info) {
                           return info.param.recipe + "_" + (info.param.cache == CacheDType::fp8 ? "fp8" : "bf16") +
                                  "_cache";
                         });

}  // namespace
}  // namespace fp8moe::serve
