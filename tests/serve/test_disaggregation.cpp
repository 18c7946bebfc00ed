// Prefill/decode disaggregation under mpirun with 2 ranks (ctest serve_disaggregation_np2): rank
// 0 prefills, rank 1 decodes what it is handed; every greedy output equals the output of one
// engine serving the request alone with the same weights, with the decode rank's cache of a
// different size (its blocks elsewhere) and for each cache dtype; the same through the server
// front (DisaggregatedFront, serve_decode_rank). Prints the handover's GB/s.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <iostream>

#include "fp8moe/comm.hpp"
#include "fp8moe/model.hpp"
#include "serve/disaggregated_front.hpp"
#include "serve/disaggregation.hpp"
#include "serve_testing.hpp"
#include "testing.hpp"

namespace fp8moe::serve {
namespace {

Comm* g_world = nullptr;

std::vector<int32_t> prompt_of(int64_t n, int64_t seed) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(int32_t((i * 23 + seed * 19) % 170 + 30));
  return p;
}

constexpr int64_t kRequests = 6, kNew = 20;
int64_t prompt_len(int64_t i) { return 5 + i * 29; }  // 5 .. 150 tokens: one to three blocks

void run(const std::string& recipe, CacheDType cache) {
  Comm& world = *g_world;
  ASSERT_EQ(world.size(), 2) << "run under mpirun -np 2";
  auto be = make_backend(testing_env::backend_name());
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  cfg.initializer_range = 0.1;  // peaked logits: greedy choices are not near-ties
  Model model(cfg, Recipe::from_name(recipe), *be, 9);  // the same seed on both ranks: the same weights
  EngineOptions o;
  o.cache = cache;
  if (world.rank() == 0) {
    o.cache_blocks = 8;
    Engine e(weights_of(model), *be, o);
    PrefillSender tx(e, world, 1);
    for (int64_t i = 0; i < kRequests; ++i) tx.send(prompt_of(prompt_len(i), i), kNew);
    tx.finish();
    std::cout << recipe << " " << cache_dtype_name(cache) << ": prefill rank sent " << tx.stats().bytes
              << " bytes of cache in " << tx.stats().requests << " handovers, " << tx.stats().gb_per_s() << " GB/s\n";
    return;
  }
  o.cache_blocks = 24;
  Engine e(weights_of(model), *be, o);
  std::vector<std::vector<int32_t>> got(kRequests), want(kRequests);
  {
    Scheduler s(e, {});
    DecodeReceiver rx(s, e, world, 0);
    // Occupy the first blocks, so the handed-over blocks land elsewhere than on the prefill rank.
    Request filler;
    filler.prompt = prompt_of(70, 99);
    filler.max_tokens = 4;
    s.submit(filler);
    s.step();
    for (int64_t i = 0;; ++i) {
      Request r;
      r.on_done = [&got, i](const std::string&, const std::vector<int32_t>& t) { got[size_t(i)] = t; };
      if (!rx.receive(std::move(r))) break;
      s.step();  // decode steps between arrivals: admissions while others run
    }
    while (s.step()) {
    }
    std::cout << recipe << " " << cache_dtype_name(cache) << ": decode rank received " << rx.stats().bytes
              << " bytes in " << rx.stats().requests << " handovers, " << rx.stats().gb_per_s() << " GB/s\n";
  }
  for (int64_t i = 0; i < kRequests; ++i) {
    Scheduler one(e, {});
    Request r;
    r.prompt = prompt_of(prompt_len(i), i);
    r.max_tokens = kNew;
    r.on_done = [&want, i](const std::string&, const std::vector<int32_t>& t) { want[size_t(i)] = t; };
    one.submit(std::move(r));
    while (one.step()) {
    }
    EXPECT_EQ(got[size_t(i)], want[size_t(i)]) << "request " << i << " (" << prompt_len(i) << " prompt tokens)";
    EXPECT_EQ(int64_t(got[size_t(i)].size()), kNew);
  }
}

TEST(Disaggregation, TokensEqualOneEngineFp32) { run("fp32", CacheDType::f32); }
TEST(Disaggregation, TokensEqualOneEngineFp8Cache) { run("fp8", CacheDType::fp8); }
TEST(Disaggregation, TokensEqualOneEngineBf16Cache) { run("bf16", CacheDType::bf16); }

// The server front: requests submitted to the front (rank 0) as to a Scheduler, prefilled there,
// decoded on rank 1, their text and ends back on rank 0's callbacks: the same text, tokens and
// finish reasons as one engine's scheduler, with a stop string, a sampled request and a request
// cancelled on the way.
struct Out {
  std::string text, reason;
  std::vector<int32_t> tokens;
};
Request request_of(int64_t i, Out* out, const std::string& stop = "") {
  Request r;
  r.prompt = prompt_of(prompt_len(i), i);
  r.max_tokens = kNew + i;
  if (i == 2 && !stop.empty()) r.stop = {stop};
  if (i == 3) r.sampling = {0.8, 0, 0.95, 3};  // sampled: the generator's state goes with the cache
  r.on_text = [out](std::string_view t) { out->text += t; };
  r.on_done = [out](const std::string& reason, const std::vector<int32_t>& t) {
    out->reason = reason;
    out->tokens = t;
  };
  return r;
}

// Rank 0 is the front, every other rank a decode rank (ctest runs it at 2 and 3 ranks).
TEST(Disaggregation, ServerFrontEqualsOneScheduler) {
  Comm& world = *g_world;
  ASSERT_GE(world.size(), 2);
  auto be = make_backend(testing_env::backend_name());
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  cfg.initializer_range = 0.1;
  Model model(cfg, Recipe::from_name("fp32"), *be, 9);
  EngineOptions o;
  o.cache = CacheDType::f32;
  o.cache_blocks = world.rank() == 0 ? 8 : 24;
  Engine e(weights_of(model), *be, o);
  if (world.rank() > 0) {
    Scheduler s(e, {});
    serve_decode_rank(s, e, world, 0);
    return;
  }
  std::vector<int> decode_ranks;
  for (int r = 1; r < world.size(); ++r) decode_ranks.push_back(r);
  std::vector<Out> got(kRequests + 1), want(kRequests);
  Engine one_e(weights_of(model), *be, o);
  const auto alone = [&](const Request& r, Out* out) {
    Scheduler one(one_e, {});
    Request q = r;
    q.on_text = [out](std::string_view t) { out->text += t; };
    q.on_done = [out](const std::string& reason, const std::vector<int32_t>& t) {
      out->reason = reason;
      out->tokens = t;
    };
    one.submit(std::move(q));
    while (one.step()) {
    }
  };
  // Request 2 stops at two bytes from the middle of what it makes without a stop string.
  Out free_run;
  alone(request_of(2, &free_run), &free_run);
  ASSERT_GE(free_run.text.size(), 8u);
  const std::string stop = free_run.text.substr(5, 2);
  for (int64_t i = 0; i < kRequests; ++i) alone(request_of(i, nullptr, stop), &want[size_t(i)]);
  EXPECT_EQ(want[2].reason, "stop");
  {
    DisaggregatedFront front(e, world, decode_ranks);
    front.submit(request_of(0, &got[0], stop));
    Request big;
    big.prompt = {1};
    big.max_tokens = 256;
    testing::expect_error([&] { front.submit(big); }, "exceeds the context of 256 tokens");
    for (int64_t i = 0; i < kRequests; ++i) {
      if (i > 0) front.submit(request_of(i, &got[size_t(i)], stop));
      front.step();
    }
    Request gone = request_of(1, &got[kRequests]);
    gone.max_tokens = 200;
    const uint64_t id = front.submit(std::move(gone));
    for (int k = 0; k < 3; ++k) front.step();
    front.cancel(id);
    while (!front.idle()) front.step();
    std::cout << "front: " << front.handover().requests << " handovers, " << front.handover().bytes << " bytes, "
              << front.stats().finished << " finished, " << front.stats().cancelled << " cancelled\n";
    EXPECT_EQ(front.stats().finished, kRequests);
    EXPECT_EQ(front.stats().cancelled, 1);
    // Each request went to the decode rank with the fewest in flight: every rank got some.
    const std::vector<int64_t> per_rank = front.handovers_per_rank();
    ASSERT_EQ(per_rank.size(), decode_ranks.size());
    int64_t handed = 0;
    for (size_t i = 0; i < per_rank.size(); ++i) {
      std::cout << "decode rank " << decode_ranks[i] << ": " << per_rank[i] << " requests\n";
      EXPECT_GE(per_rank[i], 1) << "decode rank " << decode_ranks[i];
      handed += per_rank[i];
    }
    EXPECT_EQ(handed, kRequests + 1);
    front.finish();
  }
  for (int64_t i = 0; i < kRequests; ++i) {
    EXPECT_EQ(got[size_t(i)].tokens, want[size_t(i)].tokens) << "request " << i;
    EXPECT_EQ(got[size_t(i)].text, want[size_t(i)].text) << "request " << i;
    EXPECT_EQ(got[size_t(i)].reason, want[size_t(i)].reason) << "request " << i;
  }
  EXPECT_EQ(got[kRequests].reason, "cancelled");
  EXPECT_LT(got[kRequests].tokens.size(), 200u);
}

// The handover of a DeepSeek-V3-sized cache: 61 layers of the FP8 latent (512 + 64 per token, 656
// bytes with scales) for a 4096-token prompt, 164 MB, rank 0 to rank 1; received blocks equal sent.
TEST(Disaggregation, HandoverBandwidth) {
  Comm& world = *g_world;
  ASSERT_EQ(world.size(), 2);
  auto be = make_backend(testing_env::backend_name());
  const int64_t layers = 61, blocks = 64;
  LatentCache cache(*be, layers, blocks + 8, 512, 64, CacheDType::fp8);
  std::vector<int32_t> table;
  for (int32_t b = 0; b < blocks; ++b) table.push_back(world.rank() == 0 ? b : blocks + 7 - b);
  Tensor rows_f = Tensor::host(DType::f32, {blocks * kBlockTokens, 576});
  for (int64_t i = 0; i < rows_f.numel(); ++i) rows_f.ptr<float>()[i] = float((i * 7919) % 1000) / 500.0f - 1.0f;
  std::vector<int64_t> slots;
  for (int64_t p = 0; p < blocks * kBlockTokens; ++p) slots.push_back(int64_t(table[size_t(p / kBlockTokens)]) * kBlockTokens + p % kBlockTokens);
  const Stream st = be->stream();
  double best = 0;
  int64_t bytes = 0;
  if (world.rank() == 0)
    for (int64_t l = 0; l < layers; ++l) cache.write(l, rows_f.view(), slots);
  for (int rep = 0; rep < 3; ++rep) {
    // The transfer alone: the export (a gather of the blocks) and the buffers before the clock.
    const std::vector<Tensor> parts = world.rank() == 0 ? cache.export_blocks(table) : cache.empty_export(blocks);
    be->synchronize();
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    if (world.rank() == 0) {
      bytes = send_cache_blocks(world, parts, 1, st);
    } else {
      bytes = recv_cache_blocks(world, parts, 0, st);
      be->synchronize();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, double(bytes) / s / 1e9);
      cache.import_blocks(table, parts);
    }
  }
  if (world.rank() == 1) {
    std::cout << "handover of " << bytes << " bytes (61 layers x 4096 tokens, fp8 latent): " << best
              << " GB/s at best of 3, receive side, " << world.name() << "\n";
    const Tensor r = be->to_host(cache.read(60, table, blocks * kBlockTokens));
    // The FP8 round trip of what rank 0 wrote: within E4M3's relative step.
    double worst = 0;
    for (int64_t i = 0; i < rows_f.numel(); ++i)
      worst = std::max(worst, double(std::abs(r.ptr<float>()[i] - rows_f.ptr<float>()[i])));
    EXPECT_LT(worst, 0.07);
  }
}

}  // namespace
}  // namespace fp8moe::serve

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // On several GPUs (FP8MOE_SERVE_BACKEND=cuda) each rank on its own, so that the handover crosses
  // between them.
  fp8moe::select_local_gpu(fp8moe::launch_info());
  std::unique_ptr<fp8moe::Comm> world = fp8moe::make_comm("mpi");
  fp8moe::serve::g_world = world.get();
  if (world->rank() != 0) GTEST_FLAG_SET(brief, true);
  const int rc = RUN_ALL_TESTS();
  fp8moe::serve::g_world = nullptr;
  world.reset();
  return rc;
}
