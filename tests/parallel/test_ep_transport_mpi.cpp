// The expert-parallel layer's transports against each other, under mpirun (one rank per process):
//   on GPUs (CUDA, sm_90, every rank on one host; several processes may share one GPU), a model
//   forward and backward with --ep-transport comm and nvlink on the same weights and tokens: every
//   MoE layer's output y, input gradient dh and combine-weight gradient dw, the loss and every
//   parameter's gradient byte for byte, as one node and (an even number of ranks) as two nodes,
//   where both take two hops and count the same rows across nodes and inside them;
//   on CPU ranks, nvlink refused with an error on every rank and auto falling back to comm.
// Skips the GPU case without a GPU.
//   mpirun --oversubscribe -np 2 build/tests/parallel/test_ep_transport_mpi   (and -np 4)
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>

#include "fp8moe/backend.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/parallel.hpp"
#include "model/model_internal.hpp"
#include "mpi_test_main.hpp"

#ifdef FP8MOE_HAVE_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace fp8moe {
namespace {

Comm* g_world = nullptr;
uint64_t g_seed = 0;

// What one MoE layer call produced, on the host: y after the forward, dh and dw after the backward.
struct LayerCall {
  bool backward = false;
  std::vector<Tensor> outputs;
};

// The expert-parallel layer behind a recorder of its outputs.
class Recorder final : public RoutedExperts {
 public:
  explicit Recorder(std::shared_ptr<RoutedExperts> inner) : inner_(std::move(inner)) {}
  std::unique_ptr<State> forward(model::Ctx& c, int64_t layer, const Tensor& h, const Tensor& idx, const Tensor& w,
                                 const Tensor& y) override {
    auto s = inner_->forward(c, layer, h, idx, w, y);
    calls.push_back({false, {c.be.to_host(y)}});
    return s;
  }
  void backward_input(model::Ctx& c, State& s, const Tensor& dy, const Tensor& w, const Tensor& dh,
                      const Tensor& dw) override {
    inner_->backward_input(c, s, dy, w, dh, dw);
    calls.push_back({true, {c.be.to_host(dh), c.be.to_host(dw)}});
  }
  void backward_weight(model::Ctx& c, State& s) override { inner_->backward_weight(c, s); }
  const RoutedExperts& inner() const { return *inner_; }
  std::vector<LayerCall> calls;

 private:
  std::shared_ptr<RoutedExperts> inner_;
};

struct Outcome {
  double loss = 0;
  std::vector<LayerCall> calls;
  std::vector<Tensor> grads;  // every parameter's, on the host
  DispatchTraffic traffic;
};

// The tiny config: from the source tree the test was built in, or from the working directory (a
// build run from a copy of the tree at another path).
std::string tiny_config() {
  const std::string built = std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json";
  return std::filesystem::exists(built) ? built : "configs/tiny.json";
}

// One forward and backward of the tiny model (hidden 384: three 1x128 tiles; no MTP) on this
// rank's tokens, its routed experts expert-parallel over the world with `transport` (nodes of
// `ranks_per_node` ranks; 0: one node).
Outcome run(Backend& be, const std::string& transport, const char* expect, int ranks_per_node = 0) {
  Comm& world = *g_world;
  const int P = world.size(), me = world.rank();
  ModelConfig cfg = load_config(tiny_config());
  cfg.hidden_size = 384;
  cfg.seq_len = 64;
  cfg.num_nextn_predict_layers = 0;
  ParallelOptions opt;
  opt.ep = P;
  opt.ep_transport = transport;
  opt.ranks_per_node = ranks_per_node;
  const ParallelLayout layout = make_parallel_layout(opt, P, me, cfg);
  ParallelGroups groups = make_parallel_groups(world, layout);
  Model model(cfg, Recipe::from_name("fp8"), be, 5, {layout.first_expert(), layout.experts_per_rank});
  auto rec = std::make_shared<Recorder>(make_expert_parallel(model, *groups.ep, layout));
  EXPECT_EQ(expert_parallel_transport(rec->inner()), expect) << "--ep-transport " << transport;
  model.set_routed_experts(rec);
  std::mt19937_64 rng(g_seed + uint64_t(me) * 104729);  // every rank its own tokens
  Tensor tok = Tensor::host(DType::i32, {2, cfg.seq_len}), tgt = Tensor::host(DType::i32, {2, cfg.seq_len});
  for (int64_t i = 0; i < tok.numel(); ++i) tok.ptr<int32_t>()[i] = int32_t(rng() % uint64_t(cfg.vocab_size));
  for (int64_t i = 0; i < tgt.numel(); ++i) tgt.ptr<int32_t>()[i] = int32_t(rng() % uint64_t(cfg.vocab_size));
  Tensor tok_d = be.empty(DType::i32, {2, cfg.seq_len}), tgt_d = be.empty(DType::i32, {2, cfg.seq_len});
  be.copy(tok_d.view(), tok.view());
  be.copy(tgt_d.view(), tgt.view());
  model.zero_grad();
  Outcome r;
  r.loss = model.forward_backward(tok_d.view(), tgt_d.view()).loss;
  be.synchronize();
  r.calls = rec->calls;
  for (Parameter& p : model.parameters()) r.grads.push_back(be.to_host(p.grad));
  r.traffic = dispatch_traffic(rec->inner());
  return r;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.view().nbytes() == b.view().nbytes() && std::memcmp(a.view().data, b.view().data, a.view().nbytes()) == 0;
}

bool have_gpu() {
#ifdef FP8MOE_HAVE_CUDA
  return cuda_device_available();
#else
  return false;
#endif
}

// The two transports' outcomes byte for byte: every MoE call's outputs, the loss, the gradients.
void expect_same(const Outcome& comm, const Outcome& nvlink) {
  ASSERT_EQ(comm.calls.size(), nvlink.calls.size());
  ASSERT_GE(comm.calls.size(), 2u);
  int64_t bytes = 0;
  for (size_t i = 0; i < comm.calls.size(); ++i) {
    const LayerCall &a = comm.calls[i], &b = nvlink.calls[i];
    ASSERT_EQ(a.backward, b.backward);
    const char* names[] = {a.backward ? "dh" : "y", "dw"};
    for (size_t j = 0; j < a.outputs.size(); ++j) {
      EXPECT_TRUE(same_bytes(a.outputs[j], b.outputs[j]))
          << "rank " << g_world->rank() << ", MoE call " << i << " (" << (a.backward ? "backward" : "forward")
          << "): " << names[j] << " differs between the transports";
      bytes += a.outputs[j].view().nbytes();
    }
  }
  EXPECT_EQ(std::memcmp(&comm.loss, &nvlink.loss, sizeof(double)), 0) << comm.loss << " vs " << nvlink.loss;
  int64_t differ = 0;
  for (size_t i = 0; i < comm.grads.size(); ++i) differ += !same_bytes(comm.grads[i], nvlink.grads[i]);
  EXPECT_EQ(differ, 0) << "parameters whose gradient differs, of " << comm.grads.size();
  if (g_world->rank() == 0)
    std::cout << "[ compared ] " << comm.calls.size() << " MoE calls (" << bytes << " bytes of y, dh, dw) and "
              << comm.grads.size() << " gradients on rank 0, loss " << comm.loss << "\n";
}

TEST(EpTransport, NvlinkBitwiseTheCommPath) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (g_world->size() < 2) GTEST_SKIP() << "nothing crosses ranks on one";
  select_local_gpu(launch_info());
  auto be = make_backend("cuda");
  const Outcome comm = run(*be, "comm", "comm");
  expect_same(comm, run(*be, "nvlink", "nvlink"));
}

// The ranks as two nodes: the transport's two-hop dispatch against the Comm path's two hops, the
// same bytes and the same rows counted across nodes and inside them.
TEST(EpTransport, NvlinkTwoHopBitwiseTheCommPath) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int P = g_world->size();
  if (P < 2 || P % 2 != 0) GTEST_SKIP() << "two nodes need an even number of ranks, not " << P;
  select_local_gpu(launch_info());
  auto be = make_backend("cuda");
  const Outcome comm = run(*be, "comm", "comm", P / 2);
  const Outcome nvlink = run(*be, "nvlink", "nvlink", P / 2);
  expect_same(comm, nvlink);
  const DispatchTraffic &a = comm.traffic, &b = nvlink.traffic;
  EXPECT_GT(a.cross_node_rows, 0);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.token_nodes, b.token_nodes);
  EXPECT_EQ(a.cross_node_rows, b.cross_node_rows) << "rows of the first hop across nodes";
  EXPECT_EQ(a.in_node_rows, b.in_node_rows) << "rows sent inside the node";
  EXPECT_EQ(a.one_hop_cross_rows, b.one_hop_cross_rows);
}

TEST(EpTransport, NvlinkRefusedOnCpuRanks) {
  auto be = make_backend("cpu");
  try {
    run(*be, "nvlink", "nvlink");
    ADD_FAILURE() << "--ep-transport nvlink on CPU ranks did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--ep-transport nvlink: expert-parallel rank 0: "), std::string::npos)
        << e.what();
  }
}

TEST(EpTransport, AutoIsCommOnCpuRanks) {
  auto be = make_backend("cpu");
  const Outcome r = run(*be, "auto", "comm");
  EXPECT_GE(r.calls.size(), 2u);
}

}  // namespace
}  // namespace fp8moe

int main(int argc, char** argv) { return fp8moe::testing::mpi_test_main(argc, argv, fp8moe::g_world, fp8moe::g_seed); }
