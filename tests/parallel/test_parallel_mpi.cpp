// Multi-rank pieces on CPU ranks, under mpirun (registered with ctest at 1, 2 and 4 ranks):
//   the expert-parallel dispatch with rows that name their source rank and token (as DeepEP's
//   tests do), and the combine's rows back that name the rank and the slot that made them;
//   ZeRO-1 AdamW against AdamW on one rank with the rank-order sum of the gradients (bitwise),
//   its checkpoint moments, and its per-rank memory against the formula.
//   mpirun --oversubscribe -np 4 build/tests/parallel/test_parallel_mpi
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <random>
#include <set>

#include "fp8moe/backend.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/optimizer.hpp"
#include "fp8moe/zero1.hpp"
#include "moe_routing.hpp"
#include "parallel/runtime/dispatch_layout.hpp"
#include "parallel/runtime/ep_exchange.hpp"

namespace fp8moe {
namespace {

Comm* g_world = nullptr;
uint64_t g_seed = 0;

// Rank r's routing of T tokens to top-k distinct experts of E (every rank can make every rank's).
std::vector<int32_t> routing(int r, int64_t T, int64_t K, int64_t E) {
  std::mt19937_64 rng(g_seed + uint64_t(r) * 7919);
  return testing::random_expert_ids(rng, T, K, E);
}
int64_t tokens_of(int r) { return 20 + 7 * r; }  // ragged: every rank its own count

// The first n rows of t, sharing its storage.
Tensor prefix(const Tensor& t, int64_t n) {
  TensorView v = t.view();
  v.shape[0] = n;
  return Tensor(std::shared_ptr<void>(std::make_shared<Tensor>(t), v.data), v);
}

// Every received row names its source and token, in one hop and, with nodes of `rpn` ranks, in
// two; the combine's rows back name the rank and the slot that made them; the rows that crossed
// nodes and stayed inside match a count made from the routing alone.
void check_dispatch(int64_t rpn) {
  Comm& comm = *g_world;
  auto be = make_backend("cpu");
  const int P = comm.size(), me = comm.rank();
  const int64_t K = 3, epr = 4, D = 256, T = tokens_of(me);  // E = 4P >= K
  // x[t]: tile 0 = source rank + 1, tile 1 column c = bit c of t (both exact in E4M3 with
  // power-of-two scales), so each received row says where it came from.
  Tensor x = Tensor::host(DType::f32, {T, D});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < D; ++c) x.ptr<float>()[t * D + c] = c < 128 ? float(me + 1) : float((t >> (c - 128)) & 1);
  const std::vector<int32_t> idx = routing(me, T, K, P * epr);
  const ep::DispatchLayout plan = ep::dispatch_layout(idx.data(), T, K, P, epr);
  std::unique_ptr<Comm> rail, node;
  if (rpn < P) {
    rail = comm.split(int(me % rpn), int(me / rpn));
    node = comm.split(int(me / rpn), int(me % rpn));
  }
  const ep::DispatchRoute route(*be, comm, rail.get(), node.get(), idx.data(), T, K, epr);
  const Tensor got = ep::dispatch_fp8(*be, route, x, ScaleMode::pow2);
  const std::vector<int64_t>& recv = route.recv_counts();
  // What each source sent here, from its routing; the combine's rows back: (rank + 1, token, slot).
  int64_t row = 0, cross = 0, inside = 0;
  std::vector<int64_t> ret_send(size_t(P), 0);
  std::vector<float> ret;
  for (int s = 0; s < P; ++s) {
    const std::vector<int32_t> sidx = routing(s, tokens_of(s), K, P * epr);
    const ep::DispatchLayout sp = ep::dispatch_layout(sidx.data(), tokens_of(s), K, P, epr);
    for (int64_t t = 0; t < tokens_of(s); ++t) {  // the links this token uses, counted from its routing
      std::set<int64_t> nodes, ranks;
      for (int64_t j = 0; j < K; ++j) {
        ranks.insert(sidx[size_t(t * K + j)] / epr);
        nodes.insert(sidx[size_t(t * K + j)] / epr / rpn);
      }
      if (rpn < P) {
        cross += int64_t(nodes.size()) - int64_t(nodes.count(s / rpn));
        for (int64_t d : ranks) inside += d % rpn != s % rpn;  // the relay (same in-node index) forwards
      } else {
        inside += int64_t(ranks.size()) - int64_t(ranks.count(s));
      }
    }
    ASSERT_EQ(recv[size_t(s)], sp.tokens_per_rank[size_t(me)]) << "rows from rank " << s;
    int64_t first = 0;
    for (int d = 0; d < me; ++d) first += sp.tokens_per_rank[size_t(d)];
    for (int64_t i = 0; i < recv[size_t(s)]; ++i, ++row) {
      const int32_t t = sp.send_token[size_t(first + i)];
      int64_t token = 0;
      for (int64_t c = 128; c < D; ++c) token |= int64_t(got.ptr<float>()[row * D + c] != 0) << (c - 128);
      ASSERT_EQ(got.ptr<float>()[row * D], float(s + 1)) << "row " << row << " names its source";
      ASSERT_EQ(token, t) << "row " << row << " from rank " << s << " names its token";
      for (int64_t j = 0; j < K; ++j)
        if (sp.send_expert[size_t((first + i) * K + j)] >= 0) {
          ret.insert(ret.end(), {float(me + 1), float(t), float(j)});
          ++ret_send[size_t(s)];
        }
    }
  }
  EXPECT_EQ(row, got.size(0));
  Tensor sent = Tensor::host(DType::f64, {2});
  sent.ptr<double>()[0] = double(route.cross_node_rows());
  sent.ptr<double>()[1] = double(route.in_node_rows());
  comm.all_reduce(sent.view(), be->stream());
  EXPECT_EQ(sent.ptr<double>()[0], double(cross)) << "rows across nodes";
  EXPECT_EQ(sent.ptr<double>()[1], double(inside)) << "rows inside nodes";
  if (me == 0)
    std::cout << "[ links    ] " << P << " ranks, " << rpn << " per node: " << double(cross) / double(P * 20 + 7 * P * (P - 1) / 2)
              << " cross-node and " << double(inside) / double(P * 20 + 7 * P * (P - 1) / 2) << " in-node rows per token\n";
  Tensor r = Tensor::host(DType::f32, {std::max<int64_t>(ep::total(ret_send), 1), 3});
  std::memcpy(r.view().data, ret.data(), ret.size() * sizeof(float));
  r = prefix(r, ep::total(ret_send));
  const Tensor back = ep::exchange_rows(*be, comm, r, ret_send, plan.slots_per_rank, DType::bf16);
  ASSERT_EQ(back.size(0), T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const uint16_t* b = back.ptr<uint16_t>() + int64_t(plan.slot_row[size_t(t * K + j)]) * 3;
      EXPECT_EQ(bf16_decode(b[0]), float(idx[size_t(t * K + j)] / epr + 1)) << "slot (" << t << ", " << j << ")";
      EXPECT_EQ(bf16_decode(b[1]), float(t));
      EXPECT_EQ(bf16_decode(b[2]), float(j));
    }
}

TEST(ExpertParallelDispatch, OneHopRowsNameTheirSourceAndToken) { check_dispatch(g_world->size()); }

TEST(ExpertParallelDispatch, TwoHopsAcrossNodesOfTwoRanks) {
  if (g_world->size() % 2 || g_world->size() < 4) GTEST_SKIP() << "needs 2 nodes of 2 ranks or more";
  check_dispatch(2);
}

// n parameters of ragged sizes, decay mixed; values identical on every rank.
struct Params {
  std::vector<Tensor> w, g;
  std::vector<ParamRef> refs;
};
Params make_params(uint64_t seed) {
  Params p;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t sizes[] = {37, 128, 5, 301, 64, 1};
  for (size_t i = 0; i < std::size(sizes); ++i) {
    p.w.push_back(Tensor::host(DType::f32, {sizes[i]}));
    p.g.push_back(Tensor::host(DType::f32, {sizes[i]}));
    for (int64_t j = 0; j < sizes[i]; ++j) p.w.back().ptr<float>()[j] = nd(rng);
    p.refs.push_back({"p" + std::to_string(i), p.w.back().view(), p.g.back().view(), i % 3 != 1});
  }
  return p;
}
// Rank r's gradients at step k.
void fill_grads(Params& p, int r, int k) {
  std::mt19937_64 rng(g_seed ^ (uint64_t(r) << 20) ^ uint64_t(k));
  std::normal_distribution<float> nd(0.f, 1.f);
  for (Tensor& g : p.g)
    for (int64_t j = 0; j < g.numel(); ++j) g.ptr<float>()[j] = nd(rng);
}

TEST(Zero1AdamW, BitwiseAdamWOnTheRankOrderSumOfTheGradients) {
  Comm& comm = *g_world;
  auto be = make_backend("cpu");
  const int P = comm.size();
  AdamWConfig cfg;
  Params z = make_params(g_seed), ref = make_params(g_seed);
  Zero1AdamW zero(*be, comm, z.refs, cfg);
  AdamW adam(*be, ref.refs, cfg);
  for (int k = 0; k < 3; ++k) {
    fill_grads(z, comm.rank(), k);
    for (size_t i = 0; i < ref.g.size(); ++i) {  // the reference: sum over ranks 0, 1, ... in FP32
      for (int64_t j = 0; j < ref.g[i].numel(); ++j) ref.g[i].ptr<float>()[j] = 0;
      for (int r = 0; r < P; ++r) {
        Params other = make_params(g_seed);
        fill_grads(other, r, k);
        for (int64_t j = 0; j < ref.g[i].numel(); ++j) ref.g[i].ptr<float>()[j] += other.g[i].ptr<float>()[j];
      }
    }
    zero.reduce_gradients();
    const double norm = zero.grad_norm(), ref_norm = global_grad_norm(*be, ref.refs);
    EXPECT_NEAR(norm, ref_norm, 1e-12 * ref_norm);
    zero.step(1e-2f, clip_scale(ref_norm, 1.0f));
    adam.step(1e-2f, clip_scale(ref_norm, 1.0f));
    for (size_t i = 0; i < z.w.size(); ++i)
      ASSERT_EQ(std::memcmp(z.w[i].view().data, ref.w[i].view().data, z.w[i].view().nbytes()), 0)
          << z.refs[i].name << " after step " << k;
  }
  // The checkpoint's moments: whole, equal to one rank's, and a fresh optimizer continues from them.
  std::vector<Tensor> m, v;
  zero.gather_moments(m, v);
  for (size_t i = 0; i < m.size(); ++i) {
    ASSERT_EQ(std::memcmp(m[i].view().data, adam.first_moments()[i].view().data, m[i].view().nbytes()), 0) << i;
    ASSERT_EQ(std::memcmp(v[i].view().data, adam.second_moments()[i].view().data, v[i].view().nbytes()), 0) << i;
  }
  Params z2 = make_params(g_seed);
  for (size_t i = 0; i < z2.w.size(); ++i) std::memcpy(z2.w[i].view().data, z.w[i].view().data, z.w[i].view().nbytes());
  Zero1AdamW resumed(*be, comm, z2.refs, cfg);
  std::vector<TensorView> mv, vv;
  for (size_t i = 0; i < m.size(); ++i) {
    mv.push_back(m[i].view());
    vv.push_back(v[i].view());
  }
  resumed.load_moments(mv, vv);
  resumed.set_steps(zero.steps());
  fill_grads(z, comm.rank(), 9);
  fill_grads(z2, comm.rank(), 9);
  zero.reduce_gradients();
  resumed.reduce_gradients();
  zero.step(1e-2f);
  resumed.step(1e-2f);
  for (size_t i = 0; i < z.w.size(); ++i)
    ASSERT_EQ(std::memcmp(z.w[i].view().data, z2.w[i].view().data, z.w[i].view().nbytes()), 0) << i;
}

TEST(Zero1AdamW, OptimizerMemoryPerRankIsTheFormula) {
  Comm& comm = *g_world;
  auto be = make_backend("cpu");
  // A parameter count large beside the rank count, as a model's: the shard padding is negligible.
  const int64_t N = 100003;
  Tensor w = be->zeros(DType::f32, {N}), g = be->zeros(DType::f32, {N});
  Zero1AdamW zero(*be, comm, {{"w", w.view(), g.view(), true}}, AdamWConfig{});
  const Zero1AdamW::Memory mem = zero.memory();
  // FP32 master (4 bytes) and two BF16 moments (2 + 2) per parameter, over D ranks.
  const double formula = 8.0 * double(N) / double(comm.size());
  const double measured = double(mem.master + mem.moments);
  if (comm.rank() == 0)
    std::cout << "[ memory   ] D = " << comm.size() << ": optimizer state " << measured << " bytes per rank, formula "
              << formula << " (" << measured / double(N) << " bytes per parameter; gradient bucket " << mem.bucket
              << ")\n";
  EXPECT_LE(std::abs(measured - formula), 0.1 * formula);
}

}  // namespace
}  // namespace fp8moe

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<fp8moe::Comm> world = fp8moe::make_comm("mpi");
  fp8moe::g_world = world.get();
  uint64_t seed = 0;  // rank 0's (FP8MOE_SEED or fresh), printed so a failure can be replayed
  if (const char* s = std::getenv("FP8MOE_SEED")) seed = std::strtoull(s, nullptr, 10);
  else seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  const auto seeds = world->exchange(std::string(reinterpret_cast<const char*>(&seed), sizeof seed));
  std::memcpy(&fp8moe::g_seed, seeds[0].data(), sizeof seed);
  if (world->rank() == 0) std::cout << "[ seed     ] FP8MOE_SEED=" << fp8moe::g_seed << " on " << world->size() << " ranks\n";
  else GTEST_FLAG_SET(brief, true);
  const int rc = RUN_ALL_TESTS();
  fp8moe::g_world = nullptr;
  world.reset();
  return rc;
}
