// The pipeline executor on CPU ranks, under mpirun (registered with ctest at 1, 2 and 4 ranks): for
// each of 1F1B, ZB1P, DualPipe and DualPipeV over every rank of the world, one step of the
// executor on a 4-layer MoE model, each rank's holding only its stages' parameters, against
// Model::forward_backward of the whole model on the same rank:
//   - the ops each rank ran, recorded by the executor as it ran them, are its schedule's list;
//   - every micro-batch's losses and expert loads are bitwise those of the sequential loop;
//   - after sum_gradients (over the ranks holding each parameter) the gradients are the
//     sequential loop's, bitwise where every stage's parameters sit on one rank (DualPipe's two copies of a stage add up in another order:
//     there within a relative 1e-5 of the gradient's norm);
//   - the F&B chunks overlapped on two streams (the default) and serial on one give the same op
//     order, the same losses and the same gradients, bit for bit.
// At one rank DualPipeV runs both its stages there, F&B chunks included.
// Removals tried once on a scratch copy of the executor, each failing here at 2 ranks: a B always
// computing its weight gradients (ZB1P, DualPipe, DualPipeV: W finds no pass), DualPipeV's turn
// on the last rank sent instead of handed over (nothing sends it), and the losses and loads not
// gathered over the pipeline ranks (every schedule).
//   mpirun --oversubscribe -np 4 build/tests/parallel/test_pipeline_mpi
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <random>

#include "fp8moe/backend.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/pipeline_executor.hpp"
#include "micro_batches.hpp"
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
  if (m == pipeline::Method::DualPipeV) return 2 * std::max(ranks, 2);  // at one rank: 4, for F&B chunks
  return m == pipeline::Method::DualPipe ? 2 * ranks : ranks;
}

// One executor step: each micro-batch's StepStats, and the summed gradients of `model` on the host.
struct StepResult {
  std::vector<StepStats> stats;
  std::map<std::string, Tensor> grads;
  std::vector<pipeline::ExecutedOp> executed;
};
StepResult run_step(Model& model, Backend& be, const pipeline::Schedule& schedule, const pipeline::StageSplit& split,
                    pipeline::FbMode mode, const std::vector<Tensor>& tok, const std::vector<Tensor>& tgt) {
  pipeline::Executor ex(model, schedule, split, g_world);
  ex.set_fb_mode(mode);
  model.zero_grad();
  StepResult r;
  r.stats = ex.run(tok, tgt, 1.0 / double(tok.size()));
  ex.sum_gradients();
  be.synchronize();
  for (const Parameter& p : model.parameters())
    if (p.trainable) r.grads[p.name] = be.to_host(p.grad);
  r.executed = ex.executed();
  return r;
}

void check_method(pipeline::Method method) {
  Comm& world = *g_world;
  const int P = world.size(), me = world.rank();
  const ModelConfig cfg = deep_config();
  if (P == 1 && method == pipeline::Method::DualPipe) GTEST_SKIP() << "DualPipe pairs rank r with rank P - 1 - r";
  const int M = micro_batches_for(method, P), stages = pipeline::stages_for(method, P);
  const pipeline::Schedule schedule =
      pipeline::make_schedule(method, method == pipeline::Method::DualPipeV ? stages : P, M);
  auto be = make_backend("cpu");
  const pipeline::StageSplit split = pipeline::balanced_split(cfg, stages);
  // The pipelined model holds its stages' parameters only.
  Model piped(cfg, Recipe::from_name("fp8"), *be, 3, {}, pipeline::stage_shard(schedule, split, me)),
      serial(cfg, Recipe::from_name("fp8"), *be, 3);
  std::vector<Tensor> tok, tgt;
  testing::seeded_micro_batches(cfg, M, 17, tok, tgt);  // the same micro-batches on every rank
  const StepResult overlapped = run_step(piped, *be, schedule, split, pipeline::FbMode::overlap, tok, tgt);
  const StepResult one_stream = run_step(piped, *be, schedule, split, pipeline::FbMode::serial, tok, tgt);
  const std::vector<StepStats>& got = overlapped.stats;
  ASSERT_EQ(one_stream.stats.size(), got.size());
  for (size_t m = 0; m < got.size(); ++m) {
    EXPECT_EQ(one_stream.stats[m].loss, got[m].loss) << "micro-batch " << m << ": serial F&B against overlapped";
    EXPECT_EQ(one_stream.stats[m].expert_loads, got[m].expert_loads) << "micro-batch " << m;
  }
  for (const auto& [name, g] : overlapped.grads) {
    const Tensor& h = one_stream.grads.at(name);
    EXPECT_EQ(std::memcmp(g.view().data, h.view().data, g.view().nbytes()), 0) << name << ": serial F&B against overlapped";
  }

  const std::vector<pipeline::Op>& want = schedule.rank_ops[size_t(me)];
  for (const StepResult* run : {&overlapped, &one_stream}) {
    ASSERT_EQ(run->executed.size(), want.size()) << "rank " << me;
    for (size_t i = 0; i < want.size(); ++i) {
      const pipeline::Op &a = run->executed[i].op, &b = want[i];
      EXPECT_TRUE(a.kind == b.kind && a.pass == b.pass && a.backward_pass == b.backward_pass &&
                  a.defers_weights == b.defers_weights && a.peer == b.peer)
          << "rank " << me << " op " << i << ": ran " << op_label(schedule, a) << ", the schedule has " << op_label(schedule, b);
    }
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
  for (const Parameter& a : piped.parameters()) {
    const Parameter& b = serial.parameter(a.name);
    if (!a.trainable) continue;
    const Tensor &ha = overlapped.grads.at(a.name), hb = be->to_host(b.grad);
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

// The trainable parameters of trunk sublayer i of `cfg` (attention with its input norm, MLP or
// MoE with its post-attention norm), of the embedding and of the head side (final norm, head,
// MTP module), written out from the config.
int64_t attention_params(const ModelConfig& c) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const int64_t q = c.q_lora_rank > 0 ? c.q_lora_rank * D + c.q_lora_rank + H * dqk * c.q_lora_rank : H * dqk * D;
  return D + q + (c.kv_lora_rank + c.qk_rope_head_dim) * D + c.kv_lora_rank +
         H * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + D * H * c.v_head_dim;
}
int64_t mlp_params(const ModelConfig& c, int64_t layer) {
  const int64_t D = c.hidden_size;
  if (!c.is_moe_layer(layer)) return D + 3 * D * c.intermediate_size;
  const int64_t E = c.n_routed_experts;
  return D + E * D + E + 3 * D * c.n_shared_experts * c.moe_intermediate_size + E * 3 * D * c.moe_intermediate_size;
}
int64_t sublayer_params(const ModelConfig& c, int i) { return i % 2 == 0 ? attention_params(c) : mlp_params(c, i / 2); }

// Every pipeline rank of every method at 2 and 4 ranks holds its stages' parameters, the
// embedding with stage 0 and the head with the last stage (both on one DualPipe or DualPipeV rank),
// counted against the formula (the embedding also with the last stage when the MTP module reads
// it); their values are the whole model's, and the ranks together hold
// each parameter of the whole model.
TEST(PipelineShard, EachRankHoldsItsStages) {
  if (g_world->rank() != 0) GTEST_SKIP() << "models built on rank 0";
  auto be = make_backend("cpu");
  for (bool mtp : {false, true}) {
    ModelConfig cfg = deep_config();
    cfg.num_nextn_predict_layers = mtp ? 1 : 0;
    Model whole(cfg, Recipe::from_name("fp8"), *be, 5);
    const int64_t L = cfg.num_hidden_layers, D = cfg.hidden_size, V = cfg.vocab_size;
    const int64_t embed = V * D, head = D + V * D + (mtp ? 2 * D + 2 * D * D + attention_params(cfg) + mlp_params(cfg, L) + D : 0);
    for (pipeline::Method method : {pipeline::Method::OneFOneB, pipeline::Method::ZB1P, pipeline::Method::DualPipe,
                                    pipeline::Method::DualPipeV})
      for (int P : {2, 4}) {
        const int stages = pipeline::stages_for(method, P);
        const pipeline::Schedule schedule = pipeline::make_schedule(
            method, method == pipeline::Method::DualPipeV ? stages : P, micro_batches_for(method, P));
        const pipeline::StageSplit split = pipeline::balanced_split(cfg, stages);
        std::map<std::string, int> holders;
        for (int r = 0; r < P; ++r) {
          // The stages rank r runs, from the schedule's placement.
          std::set<int> mine;
          for (const auto& direction : schedule.stage_rank)
            for (int s = 0; s < stages; ++s)
              if (direction[size_t(s)] == r) mine.insert(s);
          int64_t want = 0;
          for (int s : mine)
            for (int i = split.first[size_t(s)]; i < split.first[size_t(s) + 1]; ++i) want += sublayer_params(cfg, i);
          const bool first = mine.count(0) > 0, last = mine.count(stages - 1) > 0;
          want += (first || (last && mtp) ? embed : 0) + (last ? head : 0);
          Model part(cfg, Recipe::from_name("fp8"), *be, 5, {}, pipeline::stage_shard(schedule, split, r));
          EXPECT_EQ(part.num_parameters(), want)
              << pipeline::method_name(method) << " P " << P << " rank " << r << " mtp " << mtp;
          // DualPipe: ranks 0 and P - 1 hold both ends; DualPipeV: rank 0 (stages 0 and 2 P - 1).
          if (method == pipeline::Method::DualPipe || method == pipeline::Method::DualPipeV) {
            const bool both = r == 0 || (method == pipeline::Method::DualPipe && r == P - 1);
            EXPECT_EQ(first && last, both) << "rank " << r << ": the embedding and the head on one rank";
          }
          std::printf("%s pp %d mtp %d rank %d: %lld of %lld parameters\n", std::string(pipeline::method_name(method)).c_str(),
                      P, int(mtp), r, (long long)part.num_parameters(), (long long)whole.num_parameters());
          for (const Parameter& p : part.parameters()) {
            ++holders[p.name];
            const Tensor a = be->to_host(p.weight), b = be->to_host(whole.parameter(p.name).weight);
            ASSERT_EQ(std::memcmp(a.view().data, b.view().data, size_t(a.numel()) * sizeof(float)), 0) << p.name;
          }
          const std::vector<Layer*> trunk = part.trunk();
          for (size_t i = 0; i < trunk.size(); ++i) {
            bool held = false;
            for (int s : mine) held = held || (int(i) >= split.first[size_t(s)] && int(i) < split.first[size_t(s) + 1]);
            EXPECT_EQ(trunk[i] != nullptr, held) << "sublayer " << i << " on rank " << r;
          }
        }
        EXPECT_EQ(holders.size(), whole.parameters().size()) << pipeline::method_name(method) << " P " << P;
      }
  }
}

// A model holding a stage shard refuses to run whole, and a part it does not hold names it.
TEST(PipelineShard, RefusesWhatItLacks) {
  auto be = make_backend("cpu");
  const ModelConfig cfg = deep_config();
  const pipeline::Schedule schedule = pipeline::make_schedule(pipeline::Method::OneFOneB, 2, 2);
  const pipeline::StageSplit split = pipeline::balanced_split(cfg, 2);
  Model last(cfg, Recipe::from_name("fp8"), *be, 5, {}, pipeline::stage_shard(schedule, split, 1));
  Tensor tok = Tensor::host(DType::i32, {1, 8});
  for (int64_t i = 0; i < tok.numel(); ++i) tok.ptr<int32_t>()[i] = int32_t(i);
  try {
    last.forward_backward(tok.view(), tok.view());
    ADD_FAILURE() << "a stage shard ran forward_backward";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("whole model"), std::string::npos) << e.what();
  }
  const Batch b = last.make_batch(tok.view(), tok.view());
  try {
    last.embed_forward(b);
    ADD_FAILURE() << "the last stage's shard ran the embedding";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the embedding"), std::string::npos) << e.what();
  }
  EXPECT_EQ(last.find_parameter("model.embed_tokens.weight"), nullptr);
  EXPECT_NE(last.find_parameter("lm_head.weight"), nullptr);
}

TEST(PipelineExecutor, OneFOneB) { check_method(pipeline::Method::OneFOneB); }
TEST(PipelineExecutor, ZB1P) { check_method(pipeline::Method::ZB1P); }
TEST(PipelineExecutor, DualPipe) { check_method(pipeline::Method::DualPipe); }
TEST(PipelineExecutor, DualPipeV) { check_method(pipeline::Method::DualPipeV); }

}  // namespace
}  // namespace fp8moe

int main(int argc, char** argv) { return fp8moe::testing::mpi_test_main(argc, argv, fp8moe::g_world); }
