// The pipeline executor on CPU ranks, under mpirun (registered with ctest at 1, 2 and 4 ranks): for
// each of 1F1B, ZB1P, DualPipe and DualPipeV over every rank of the world, one step of the
// executor on a 4-layer MoE model against Model::forward_backward on the same rank:
//   - the ops each rank ran, recorded by the executor as it ran them, are its schedule's list;
//   - every micro-batch's losses and expert loads are bitwise those of the sequential loop;
//   - after sum_gradients the gradients are the sequential loop's, bitwise where every stage's
//     parameters sit on one rank (DualPipe's two copies of a stage add up in another order:
//     there within a relative 1e-5 of the gradient's norm).
// Removals tried once on a scratch copy of the executor, each failing here at 2 ranks: a B always
// computing its weight gradients (ZB1P, DualPipe, DualPipeV: W finds no pass), DualPipeV's turn
// on the last rank sent instead of handed over (nothing sends it), and the losses and loads not
// gathered over the pipeline ranks (every schedule).
//   mpirun --oversubscribe -np 4 build/tests/parallel/test_pipeline_mpi
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "fp8moe/backend.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/pipeline_executor.hpp"
#include "mpi_main.hpp"

namespace fp8moe {
namespace {

Comm* g_world = nullptr;

ModelConfig deep_config() {
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/tests/parallel/tiny_deep.json");
  cfg.seq_len = 16;
  cfg.batch_size = 1;
  return cfg;
}

int micro_batches_for(pipeline::Method m, int ranks) {
  return m == pipeline::Method::DualPipe || m == pipeline::Method::DualPipeV ? 2 * ranks : ranks;
}

void check_method(pipeline::Method method) {
  Comm& world = *g_world;
  const int P = world.size(), me = world.rank();
  const ModelConfig cfg = deep_config();
  if (P == 1 && (method == pipeline::Method::DualPipe || method == pipeline::Method::DualPipeV))
    GTEST_SKIP() << "two stages per rank need an even number of them";
  const int M = micro_batches_for(method, P), stages = pipeline::stages_for(method, P);
  const pipeline::Schedule schedule =
      pipeline::make_schedule(method, method == pipeline::Method::DualPipeV ? stages : P, M);
  auto be = make_backend("cpu");
  Model piped(cfg, Recipe::from_name("fp8"), *be, 3), serial(cfg, Recipe::from_name("fp8"), *be, 3);
  std::mt19937_64 rng(17);  // the same micro-batches on every rank
  std::vector<Tensor> tok, tgt;
  for (int m = 0; m < M; ++m) {
    tok.push_back(Tensor::host(DType::i32, {cfg.batch_size, cfg.seq_len}));
    tgt.push_back(Tensor::host(DType::i32, {cfg.batch_size, cfg.seq_len}));
    for (int64_t i = 0; i < tok.back().numel(); ++i) tok.back().ptr<int32_t>()[i] = int32_t(rng() % 256);
    for (int64_t i = 0; i < tgt.back().numel(); ++i) tgt.back().ptr<int32_t>()[i] = int32_t(rng() % 256);
  }
  pipeline::Executor ex(piped, schedule, pipeline::balanced_split(cfg, stages), &world);
  piped.zero_grad();
  const std::vector<StepStats> got = ex.run(tok, tgt, 1.0 / M);
  ex.sum_gradients();
  be->synchronize();

  const std::vector<pipeline::Op>& want = schedule.rank_ops[size_t(me)];
  ASSERT_EQ(ex.executed().size(), want.size()) << "rank " << me;
  for (size_t i = 0; i < want.size(); ++i) {
    const pipeline::Op &a = ex.executed()[i].op, &b = want[i];
    EXPECT_TRUE(a.kind == b.kind && a.pass == b.pass && a.backward_pass == b.backward_pass &&
                a.defers_weights == b.defers_weights && a.peer == b.peer)
        << "rank " << me << " op " << i << ": ran " << op_label(schedule, a) << ", the schedule has " << op_label(schedule, b);
  }

  serial.zero_grad();
  ASSERT_EQ(int(got.size()), M);
  for (int m = 0; m < M; ++m) {
    const StepStats want_st = serial.forward_backward(tok[size_t(m)].view(), tgt[size_t(m)].view(), 1.0 / M);
    EXPECT_EQ(got[size_t(m)].loss, want_st.loss) << "micro-batch " << m;
    EXPECT_EQ(got[size_t(m)].main_loss, want_st.main_loss) << "micro-batch " << m;
    EXPECT_EQ(got[size_t(m)].balance_loss, want_st.balance_loss) << "micro-batch " << m;
    EXPECT_EQ(got[size_t(m)].expert_loads, want_st.expert_loads) << "micro-batch " << m;
  }
  be->synchronize();
  const bool exact = method != pipeline::Method::DualPipe;
  for (size_t i = 0; i < piped.parameters().size(); ++i) {
    const Parameter &a = piped.parameters()[i], &b = serial.parameters()[i];
    if (!a.trainable) continue;
    const Tensor ha = be->to_host(a.grad), hb = be->to_host(b.grad);
    double diff = 0, norm = 0;
    int64_t unequal = 0;
    for (int64_t j = 0; j < ha.numel(); ++j) {
      const float x = ha.ptr<float>()[j], y = hb.ptr<float>()[j];
      unequal += x != y;
      diff = std::max(diff, std::abs(double(x) - double(y)));
      norm = std::max(norm, std::abs(double(y)));
    }
    if (exact) EXPECT_EQ(unequal, 0) << a.name << ": largest difference " << diff;
    else EXPECT_LE(diff, 1e-5 * norm) << a.name;
  }
}

TEST(PipelineExecutor, OneFOneB) { check_method(pipeline::Method::OneFOneB); }
TEST(PipelineExecutor, ZB1P) { check_method(pipeline::Method::ZB1P); }
TEST(PipelineExecutor, DualPipe) { check_method(pipeline::Method::DualPipe); }
TEST(PipelineExecutor, DualPipeV) { check_method(pipeline::Method::DualPipeV); }

}  // namespace
}  // namespace fp8moe

int main(int argc, char** argv) { return fp8moe::testing::mpi_test_main(argc, argv, fp8moe::g_world); }
