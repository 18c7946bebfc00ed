// The CUDA step-statistics ops (moe_expert_loads, moe_balance_loss, sum_in_order) against the CPU
// backend bit for bit, on random routing (uniform and skewed loads, dropped slots and ids past the
// experts for the loads), several sequence counts and lengths; and a training step's host waits:
// the pipeline executor's step (1F1B over one stage, two micro-batches, the FP8 recipe, the balance
// loss on) reads back once, at its end. Skips without a GPU (the step: without a Hopper GPU).
// Run: build/tests/cuda/test_cuda_step_stats
#include <filesystem>
#include <random>
#include <vector>

#include "cuda_test_util.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/pipeline_executor.hpp"
#include "micro_batches.hpp"
#include "moe_routing.hpp"

namespace fp8moe::testing {
namespace {

void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.view().nbytes(), want.view().nbytes()) << what;
  EXPECT_EQ(first_mismatch(got, want), -1) << what;
}

TEST(StepStatsCuda, ExpertLoadsEqualTheCpu) {
  FP8MOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend();
  auto cpu = make_backend("cpu");
  std::mt19937_64 rng(11);
  for (const RoutingSpec& spec : {RoutingSpec{2048, 4, 32, 0.0, 0.0, {}}, RoutingSpec{1000, 8, 256, 1.5, 0.1, {3, 7}},
                                  RoutingSpec{5, 2, 8, 0.0, 0.5, {}}}) {
    Tensor ids = random_routing(rng, spec);
    ids.ptr<int32_t>()[0] = int32_t(spec.groups);  // past the experts: not counted
    Tensor want = Tensor::host(DType::f64, {spec.groups});
    cpu->moe_expert_loads(ids.view(), want.view());
    Tensor got = gpu->zeros(DType::f64, {spec.groups});
    gpu->moe_expert_loads(to_device(*gpu, ids).view(), got.view());
    expect_same(gpu->to_host(got), want, "loads of " + std::to_string(spec.tokens) + " tokens");
  }
}

TEST(StepStatsCuda, BalanceLossAndGradientEqualTheCpu) {
  FP8MOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend();
  auto cpu = make_backend("cpu");
  std::mt19937_64 rng(12);
  struct Shape {
    int64_t B, S, E, K;
    double skew;
  };
  for (const Shape& s : {Shape{8, 256, 32, 4, 0.0}, Shape{1, 512, 256, 8, 1.5}, Shape{3, 7, 8, 2, 0.0},
                         Shape{2, 300, 300, 3, 0.5}}) {
    const int64_t T = s.B * s.S;
    const Tensor ids = random_routing(rng, {T, s.K, s.E, s.skew, 0.0, {}});
    Tensor scores = Tensor::host(DType::f32, {T, s.E});
    std::uniform_real_distribution<float> u(1e-3f, 1.0f);
    for (int64_t i = 0; i < scores.numel(); ++i) scores.ptr<float>()[i] = u(rng);
    Tensor loss = Tensor::host(DType::f64, {1}), ds = Tensor::host(DType::f32, {T, s.E});
    cpu->moe_balance_loss(scores.view(), ids.view(), s.S, 1e-4, 0.125, loss.view(), ds.view());
    const Tensor dscores = to_device(*gpu, scores), dids = to_device(*gpu, ids);
    Tensor gl = gpu->zeros(DType::f64, {1}), gds = gpu->zeros(DType::f32, {T, s.E});
    gpu->moe_balance_loss(dscores.view(), dids.view(), s.S, 1e-4, 0.125, gl.view(), gds.view());
    const std::string what = std::to_string(s.B) + " x " + std::to_string(s.S) + ", E " + std::to_string(s.E);
    expect_same(gpu->to_host(gl), loss, "loss " + what);
    expect_same(gpu->to_host(gds), ds, "dscores " + what);
    // Each output alone: the same bits.
    Tensor gl2 = gpu->zeros(DType::f64, {1}), gds2 = gpu->zeros(DType::f32, {T, s.E});
    gpu->moe_balance_loss(dscores.view(), dids.view(), s.S, 1e-4, 0.125, gl2.view(), TensorView());
    gpu->moe_balance_loss(dscores.view(), dids.view(), s.S, 1e-4, 0.125, TensorView(), gds2.view());
    expect_same(gpu->to_host(gl2), loss, "loss alone " + what);
    expect_same(gpu->to_host(gds2), ds, "dscores alone " + what);
  }
}

TEST(StepStatsCuda, SumInOrderEqualsTheCpu) {
  FP8MOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend();
  auto cpu = make_backend("cpu");
  std::mt19937_64 rng(13);
  std::lognormal_distribution<float> v(0.0f, 3.0f);
  for (int64_t n : {1, 2, 2048, 100000}) {
    Tensor x = Tensor::host(DType::f32, {n});
    for (int64_t i = 0; i < n; ++i) x.ptr<float>()[i] = v(rng);
    Tensor want = Tensor::host(DType::f64, {1});
    cpu->sum_in_order(x.view(), want.view());
    Tensor got = gpu->zeros(DType::f64, {1});
    gpu->sum_in_order(to_device(*gpu, x).view(), got.view());
    expect_same(gpu->to_host(got), want, "sum of " + std::to_string(n));
  }
}

// A training step through the pipeline executor, as the trainer runs it on one GPU: the host
// waits once, when the step's statistics are read at its end (before, each MoE layer read its
// routing back and each head its targets and losses).
TEST(StepStatsCuda, ExecutorStepWaitsForTheDeviceOnce) {
  FP8MOE_REQUIRE_SM90();
  auto be = make_cuda_backend();
  be->set_checks(Backend::Checks::deferred);
  const std::string in_sources = std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json";
  ModelConfig cfg = load_config(std::filesystem::exists(in_sources) ? in_sources : "configs/tiny.json");
  ASSERT_GT(cfg.aux_loss_alpha, 0);
  const int M = 2;
  Model model(cfg, Recipe::from_name("fp8"), *be, 3);
  pipeline::Executor ex(model, pipeline::one_f_one_b_schedule(1, M), pipeline::balanced_split(cfg, 1), nullptr);
  std::vector<Tensor> tok, tgt;
  seeded_micro_batches(cfg, M, 5, tok, tgt);
  ASSERT_GE(be->host_waits(), 0);
  for (int step = 0; step < 3; ++step) {
    model.zero_grad();
    const int64_t before = be->host_waits();
    const std::vector<StepStats> st = ex.run(tok, tgt, 1.0 / M);
    EXPECT_EQ(be->host_waits() - before, 1) << "step " << step;
    ASSERT_EQ(st.size(), size_t(M));
    EXPECT_GT(st[0].balance_loss, 0);
    EXPECT_EQ(st[0].expert_loads.size(), 2u);  // layer 1 and the MTP module's
    int64_t slots = 0;
    for (int64_t n : st[0].expert_loads[0]) slots += n;
    EXPECT_EQ(slots, cfg.batch_size * cfg.seq_len * cfg.num_experts_per_tok);
    be->synchronize();
  }
}

}  // namespace
}  // namespace fp8moe::testing
