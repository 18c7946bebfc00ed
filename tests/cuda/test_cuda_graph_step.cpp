// Training steps as CUDA graphs (pipeline::Executor::set_graphs, Backend::begin_capture) and with
// the Wgrads on a stream of their own (set_wgrad_stream): a model stepped so against the same
// model stepped plainly (one stream, no graphs), bit for bit (losses, expert loads, gradient
// norms and every weight after AdamW, with new data each step and a grad_scale that changes
// half-way, so that a step runs as usual and the next one records again); a deferred check that
// fails inside a replayed step raised at synchronize(); the caching allocator keeping the blocks a
// recording used (on its stream and on one that joined it) out of every allocation outside
// graphs; and the trainer's --graphs on against --graphs off. Skips without a GPU (the steps:
// without a Hopper GPU).
// Run: build/tests/cuda/test_cuda_graph_step
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "cuda/runtime/caching_allocator.hpp"
#include "cuda/runtime/cuda_stream.hpp"
#include "cuda_test_util.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/optimizer.hpp"
#include "fp8moe/pipeline_executor.hpp"
#include "fp8moe/trainer.hpp"
#include "micro_batches.hpp"

namespace fp8moe::testing {
namespace {

namespace fs = std::filesystem;

std::string config_path(const std::string& name) {
  const std::string in_sources = std::string(FP8MOE_SOURCE_DIR) + "/configs/" + name;
  return fs::exists(in_sources) ? in_sources : "configs/" + name;
}

// A model, its executor and its optimizer on one backend.
struct Stepper {
  Model model;
  pipeline::Executor ex;
  std::vector<ParamRef> refs;
  std::unique_ptr<AdamW> opt;
  Stepper(const ModelConfig& cfg, Backend& be, int M, bool graphs, bool wgrad_stream = true)
      : model(cfg, Recipe::from_name("fp8"), be, 3),
        ex(model, pipeline::one_f_one_b_schedule(1, M), pipeline::balanced_split(cfg, 1), nullptr) {
    ex.set_graphs(graphs);
    ex.set_wgrad_stream(wgrad_stream);
    for (Parameter& p : model.parameters())
      if (p.trainable) refs.push_back({p.name, p.weight.view(), p.grad.view(), p.decay});
    opt = std::make_unique<AdamW>(be, refs, AdamWConfig{});
  }
  // One step: forward and backward, the gradient norm, AdamW and the routing-bias update.
  std::pair<std::vector<StepStats>, double> step(const std::vector<Tensor>& tok, const std::vector<Tensor>& tgt,
                                                 double grad_scale) {
    model.zero_grad();
    std::vector<StepStats> st = ex.run(tok, tgt, grad_scale);
    model.backend().synchronize();
    const double norm = global_grad_norm(model.backend(), refs);
    opt->step(1e-3f, clip_scale(norm, 1.0f));
    std::vector<std::vector<int64_t>> loads = st[0].expert_loads;
    model.update_routing_bias(loads, 1e-3);
    return {std::move(st), norm};
  }
};

// Blocks a recording took or freed stay with graphs: an allocation outside graphs never gets
// them, so a replay never writes over another tensor. First, while the process's free lists are
// empty.
TEST(GraphStepCuda, BlocksOfARecordingStayWithGraphs) {
  FP8MOE_REQUIRE_GPU();
  const Stream stream = cuda::make_stream();
  const cudaStream_t s = cuda::native(stream);
  const cuda::CachedBlock before = cuda::cached_malloc(4096, s);
  const cuda::CachedBlock freed_inside = cuda::cached_malloc(8192, s);
  cuda::cached_free(before);
  const int64_t kept = cuda::allocator_stats().graph_reserved;
  cuda::begin_graph_pool(s);
  const cuda::CachedBlock g1 = cuda::cached_malloc(4096, s);  // the ordinary free block, now the graphs'
  EXPECT_EQ(g1.ptr, before.ptr);
  EXPECT_TRUE(g1.graph);
  cuda::cached_free(g1);
  const cuda::CachedBlock g2 = cuda::cached_malloc(4096, s);
  EXPECT_EQ(g2.ptr, g1.ptr);
  cuda::cached_free(freed_inside);  // a recorded kernel may have used it
  cuda::end_graph_pool();
  cuda::cached_free(g2);
  const cuda::CachedBlock after = cuda::cached_malloc(4096, s);
  const cuda::CachedBlock after2 = cuda::cached_malloc(8192, s);
  EXPECT_NE(after.ptr, before.ptr);
  EXPECT_NE(after2.ptr, freed_inside.ptr);
  EXPECT_EQ(cuda::allocator_stats().graph_reserved - kept, 4096 + 8192);
  cuda::begin_graph_pool(s);  // the next recording finds them again
  const cuda::CachedBlock again = cuda::cached_malloc(4096, s);
  EXPECT_EQ(again.ptr, before.ptr);
  cuda::end_graph_pool();
  for (const cuda::CachedBlock& b : {after, after2, again}) cuda::cached_free(b);
  stream.synchronize();
}

// A stream that joins a recording (it waits for an event of the recorded stream: the Wgrad
// stream of a step) takes and frees graph blocks as the recorded stream does.
TEST(GraphStepCuda, AStreamJoiningARecordingTakesGraphBlocks) {
  FP8MOE_REQUIRE_GPU();
  const Stream main_stream = cuda::make_stream(), side_stream = cuda::make_stream();
  const cudaStream_t s = cuda::native(main_stream), side = cuda::native(side_stream);
  const cuda::CachedBlock used = cuda::cached_malloc(24576, side);  // an ordinary block of the side stream
  cudaEvent_t fork = nullptr, join = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), cudaSuccess);
  cuda::begin_graph_pool(s);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
  const cuda::CachedBlock before_join = cuda::cached_malloc(20480, side);  // not recorded yet
  ASSERT_EQ(cudaEventRecord(fork, s), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
  const cuda::CachedBlock joined = cuda::cached_malloc(16384, side);
  ASSERT_EQ(cudaMemsetAsync(joined.ptr, 0, 16384, side), cudaSuccess);
  cuda::cached_free(used);  // a recorded kernel of the side stream may have used it
  ASSERT_EQ(cudaEventRecord(join, side), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(s, join, 0), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cuda::end_graph_pool();
  EXPECT_FALSE(before_join.graph);
  EXPECT_TRUE(joined.graph);
  cuda::cached_free(joined);
  const cuda::CachedBlock after = cuda::cached_malloc(16384, side), after_used = cuda::cached_malloc(24576, side);
  EXPECT_NE(after.ptr, joined.ptr) << "the graph's block stays with graphs";
  EXPECT_NE(after_used.ptr, used.ptr) << "the block freed during the recording stays with graphs";
  for (const cuda::CachedBlock& b : {before_join, after, after_used}) cuda::cached_free(b);
  (void)cudaGraphDestroy(graph);
  (void)cudaEventDestroy(fork);
  (void)cudaEventDestroy(join);
  main_stream.synchronize();
  side_stream.synchronize();
}

TEST(GraphStepCuda, StepsAsGraphsEqualStepsWithout) {
  FP8MOE_REQUIRE_SM90();
  auto be = make_cuda_backend();
  ASSERT_TRUE(be->can_capture());
  be->set_checks(Backend::Checks::deferred);
  ModelConfig cfg = load_config(config_path("tiny.json"));
  const int M = 2;
  // The plain steps: one stream, no graphs. Against them, the Wgrads on their own stream, without
  // and with graphs (the recording then spans both streams).
  Stepper plain(cfg, *be, M, false, false), eager(cfg, *be, M, false), graphed(cfg, *be, M, true);
  const int steps = 7;
  for (int step = 0; step < steps; ++step) {
    std::vector<Tensor> tok, tgt;
    seeded_micro_batches(cfg, M, 100 + step, tok, tgt);
    const double scale = step < 3 ? 1.0 / M : 0.5 / M;  // step 3 runs as usual, 4 records again
    const auto [want, want_norm] = plain.step(tok, tgt, scale);
    for (Stepper* s : {&eager, &graphed}) {
      const char* what = s == &eager ? "wgrad stream" : "wgrad stream, graphs";
      const auto [got, got_norm] = s->step(tok, tgt, scale);
      ASSERT_EQ(got.size(), want.size());
      for (size_t m = 0; m < got.size(); ++m) {
        EXPECT_EQ(got[m].loss, want[m].loss) << what << ", step " << step << " micro-batch " << m;
        EXPECT_EQ(got[m].main_loss, want[m].main_loss) << what << ", step " << step;
        EXPECT_EQ(got[m].mtp_loss, want[m].mtp_loss) << what << ", step " << step;
        EXPECT_EQ(got[m].balance_loss, want[m].balance_loss) << what << ", step " << step;
        EXPECT_EQ(got[m].expert_loads, want[m].expert_loads) << what << ", step " << step;
      }
      EXPECT_EQ(got_norm, want_norm) << what << ", step " << step;
    }
  }
  // Steps 0 and 3 ran as usual; 1 and 4 were recorded; all the others replayed.
  EXPECT_EQ(graphed.ex.graph_replays(), steps - 2);
  EXPECT_EQ(graphed.ex.graph_note(), "");
  EXPECT_EQ(eager.ex.graph_replays(), 0);
  for (size_t i = 0; i < plain.model.parameters().size(); ++i) {
    const Parameter& a = plain.model.parameters()[i];
    for (Stepper* s : {&eager, &graphed})
      EXPECT_EQ(first_mismatch(be->to_host(s->model.parameters()[i].weight), be->to_host(a.weight)), -1) << a.name;
  }
}

// A bad token id in a replayed step: the embedding's deferred range check, recorded once, is
// raised after the replay (the records go back after each replay), and the next step is clean.
TEST(GraphStepCuda, ACheckFailingInAReplayIsRaised) {
  FP8MOE_REQUIRE_SM90();
  auto be = make_cuda_backend();
  be->set_checks(Backend::Checks::deferred);
  ModelConfig cfg = load_config(config_path("tiny.json"));
  Stepper s(cfg, *be, 1, true);
  std::vector<Tensor> tok, tgt;
  seeded_micro_batches(cfg, 1, 7, tok, tgt);
  for (int step = 0; step < 3; ++step) EXPECT_NO_THROW(s.step(tok, tgt, 1.0)) << "step " << step;
  ASSERT_EQ(s.ex.graph_replays(), 2);
  Tensor bad = Tensor::host(DType::i32, {cfg.batch_size, cfg.seq_len});
  std::copy_n(tok[0].ptr<int32_t>(), bad.numel(), bad.ptr<int32_t>());
  bad.ptr<int32_t>()[5] = int32_t(cfg.vocab_size);
  s.model.zero_grad();
  (void)s.ex.run({bad}, tgt, 1.0);
  EXPECT_EQ(s.ex.graph_replays(), 3);
  expect_error([&] { be->synchronize(); }, "outside [0, " + std::to_string(cfg.vocab_size) + ")");
  s.model.zero_grad();
  (void)s.ex.run(tok, tgt, 1.0);
  EXPECT_NO_THROW(be->synchronize());
  EXPECT_EQ(s.ex.graph_replays(), 4);
}

std::vector<nlohmann::json> metrics(const fs::path& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The trainer with --graphs on and off: the same metrics, bit for bit, over a run whose MTP
// weight changes (a step as usual, then a new recording), with validation and the EMA between.
TEST(GraphStepCuda, TrainerGraphsOnEqualsOff) {
  FP8MOE_REQUIRE_SM90();
  const fs::path dir = test_dir("fp8moe_graph_trainer");
  TrainOptions o;
  o.model_config = config_path("tiny.json");
  o.backend = "cuda";
  o.data = std::string(FP8MOE_SOURCE_DIR) + "/docs";
  o.steps = 8;
  o.batch_size = 2;
  o.seq_len = 64;
  o.eval_every = 3;
  o.eval_batches = 2;
  o.ckpt_every = 0;
  o.mtp_weight_after = 0.05;
  o.mtp_switch = 0.5;
  o.quiet = true;
  std::vector<std::vector<nlohmann::json>> runs;
  for (const char* g : {"off", "on"}) {
    o.graphs = g;
    o.out_dir = (dir / g).string();
    const TrainSummary sum = Trainer(o).run();
    EXPECT_EQ(sum.graph_replays, o.graphs == "on" ? o.steps - 2 : 0) << g;
    EXPECT_EQ(sum.graph_note, "");
    runs.push_back(metrics(o.out_dir));
  }
  ASSERT_EQ(runs[0].size(), size_t(o.steps));
  ASSERT_EQ(runs[1].size(), runs[0].size());
  for (size_t i = 0; i < runs[0].size(); ++i)
    for (const char* k : {"loss", "total_loss", "mtp_loss", "balance_loss", "grad_norm", "val_loss", "expert_loads"})
      EXPECT_EQ(runs[1][i].value(k, nlohmann::json()), runs[0][i].value(k, nlohmann::json())) << "step " << i << " " << k;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fp8moe::testing
