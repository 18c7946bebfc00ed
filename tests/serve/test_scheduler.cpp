// Continuous batching: requests of different lengths through a cache too small for all of them
// at once (preemption and resumption), chunked prefill under a small step budget, arrivals while
// others run; every greedy output equals the request's output alone. Stop strings, cancellation.
// Run: ctest --test-dir build -R test_serve
#include <gtest/gtest.h>

#include "fp8moe/model.hpp"
#include "serve/generate.hpp"
#include "serve/scheduler.hpp"
#include "serve_testing.hpp"
#include "testing.hpp"

namespace fp8moe::serve {
namespace {

struct ServeSetup {
  std::unique_ptr<Backend> be = make_backend(testing_env::backend_name());
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  explicit ServeSetup(int64_t blocks) {
    ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
    cfg.initializer_range = 0.1;  // peaked logits: greedy choices are not near-ties
    model = std::make_unique<Model>(cfg, Recipe::from_name("fp32"), *be, 7);
    EngineOptions o;
    o.cache = CacheDType::f32;
    o.cache_blocks = blocks;
    engine = std::make_unique<Engine>(weights_of(*model), *be, o);
  }
};

struct Out {
  std::vector<int32_t> tokens;
  std::string text, reason;
};

Request make(const std::vector<int32_t>& prompt, int64_t max_tokens, Out* out) {
  Request r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  r.on_text = [out](std::string_view s) { out->text += s; };
  r.on_done = [out](const std::string& reason, const std::vector<int32_t>& t) {
    out->reason = reason;
    out->tokens = t;
  };
  return r;
}

std::vector<int32_t> prompt_of(int64_t n, int64_t seed) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(int32_t((i * 31 + seed * 17) % 90 + 33));
  return p;
}

TEST(ServeScheduler, PreemptionAndChunkingKeepEveryGreedyOutput) {
  ServeSetup s(6);  // 384 tokens of cache for ~1000 tokens of requests
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{5, 40}, {120, 30}, {33, 70}, {64, 20}, {1, 50},
                                                           {90, 60}, {17, 64}, {150, 40}, {70, 10}, {8, 80}};
  std::vector<Out> alone(shapes.size()), together(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    Scheduler one(*s.engine, {});
    one.submit(make(prompt_of(shapes[i].first, int64_t(i)), shapes[i].second, &alone[i]));
    while (one.step()) {}
    ASSERT_EQ(int64_t(alone[i].tokens.size()), shapes[i].second);
  }
  SchedulerOptions o;
  o.max_step_tokens = 48;  // prompts go in several chunks
  Scheduler many(*s.engine, o);
  // Half arrive at once, the rest while the first ones run.
  size_t next = 0;
  for (; next < shapes.size() / 2; ++next)
    many.submit(make(prompt_of(shapes[next].first, int64_t(next)), shapes[next].second, &together[next]));
  int64_t steps = 0, max_running = 0;
  while (true) {
    const bool worked = many.step();
    max_running = std::max(max_running, many.stats().running);
    if (++steps % 7 == 0 && next < shapes.size()) {
      many.submit(make(prompt_of(shapes[next].first, int64_t(next)), shapes[next].second, &together[next]));
      ++next;
      continue;
    }
    if (!worked && next == shapes.size()) break;
  }
  const SchedulerStats st = many.stats();
  std::cout << "steps " << st.steps << ", preemptions " << st.preemptions << ", max running " << max_running
            << ", finished " << st.finished << "\n";
  EXPECT_GT(st.preemptions, 0) << "the cache was meant to run out";
  EXPECT_GT(max_running, 2);
  EXPECT_EQ(st.finished, int64_t(shapes.size()));
  EXPECT_EQ(st.blocks_used, 0);
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "request " << i;
    EXPECT_EQ(together[i].text, alone[i].text) << "request " << i;
    EXPECT_EQ(together[i].reason, "length");
  }
}

TEST(ServeScheduler, StopStringsCancellationAndValidation) {
  ServeSetup s(4);
  Out free_run, stopped, cancelled;
  {
    Scheduler one(*s.engine, {});
    one.submit(make(prompt_of(10, 1), 40, &free_run));
    while (one.step()) {}
  }
  ASSERT_GE(free_run.text.size(), 12u);
  const std::string stop = free_run.text.substr(8, 3);  // its first occurrence ends the text
  const size_t at = free_run.text.find(stop);
  Scheduler sch(*s.engine, {});
  Request r = make(prompt_of(10, 1), 40, &stopped);
  r.stop = {stop};
  sch.submit(std::move(r));
  const uint64_t id = sch.submit(make(prompt_of(30, 2), 100, &cancelled));
  for (int i = 0; i < 5; ++i) sch.step();
  sch.cancel(id);
  while (sch.step()) {}
  EXPECT_EQ(stopped.reason, "stop");
  EXPECT_EQ(stopped.text, free_run.text.substr(0, at));
  EXPECT_EQ(cancelled.reason, "cancelled");
  EXPECT_LT(cancelled.tokens.size(), 100u);
  EXPECT_EQ(sch.stats().blocks_used, 0);
  EXPECT_TRUE(sch.idle());
  testing::expect_error([&] { sch.submit(make({}, 4, &stopped)); }, "prompt: empty");
  testing::expect_error([&] { sch.submit(make({1, 2}, 300, &stopped)); }, "exceeds the context");
  testing::expect_error([&] { sch.submit(make({1, 2}, 0, &stopped)); }, "max_tokens");
  testing::expect_error([&] { sch.submit(make({1, 999}, 4, &stopped)); }, "outside the vocabulary");
  Request bad = make({1}, 4, &stopped);
  bad.sampling.top_p = 2;
  testing::expect_error([&] { sch.submit(bad); }, "top_p");
  bool hit = true;
  EXPECT_EQ(emittable("abcd", {"cde"}, &hit), 2u);  // "cd" may begin the stop string: withheld
  EXPECT_FALSE(hit);
  EXPECT_EQ(emittable("abcdef", {"cde", "b"}, &hit), 1u);
  EXPECT_TRUE(hit);
}

}  // namespace
}  // namespace fp8moe::serve
