// Multi-rank pieces on CPU ranks, under mpirun (registered with ctest at 1, 2 and 4 ranks):
//   the expert-parallel dispatch with rows that name their source rank and token (as DeepEP's
//   tests do), and the combine's rows back that name the rank and the slot that made them;
//   what the expert-parallel layer sends across ranks, recorded at the communicator (FP8 dispatch
//   with power-of-two scales, BF16 combine, forward and backward; ctest parallel_mpi_wire_np*);
//   ZeRO-1 AdamW against AdamW on one rank with the rank-order sum of the gradients (bitwise),
//   the routed experts' bucket over their expert-data-parallel ranks, its checkpoint moments, and
//   its per-rank memory against the formula, a model holding 1/E of the experts included.
//   mpirun --oversubscribe -np 4 build/tests/parallel/test_parallel_mpi
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <random>
#include <set>

#include "fp8moe/backend.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/parallel.hpp"
#include "fp8moe/optimizer.hpp"
#include "fp8moe/zero1.hpp"
#include "moe_routing.hpp"
#include "parallel/runtime/dispatch_layout.hpp"
#include "mpi_test_main.hpp"
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
// two; the combine's rows back (one hop or two) name the rank and the slot that made them, in the
// one-hop order; the rows that crossed nodes and stayed inside, both ways, match a count made
// from the routing alone.
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
  int64_t row = 0, cross = 0, inside = 0, back_cross = 0, back_inside = 0;
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
      for (int64_t j = 0; j < K; ++j) {  // the combine: one row per slot, back from its expert's rank d
        const int64_t d = sidx[size_t(t * K + j)] / epr;
        back_cross += d / rpn != s / rpn;
        back_inside += rpn < P ? d % rpn != s % rpn : d != s;  // two hops: to the relay of the source's index
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
  // Every rank's rows sent across and inside nodes against the counts from the routing.
  auto check_links = [&](int64_t sent_cross, int64_t sent_inside, int64_t want_cross, int64_t want_inside,
                         const std::string& what) {
    Tensor sent = Tensor::host(DType::f64, {2});
    sent.ptr<double>()[0] = double(sent_cross);
    sent.ptr<double>()[1] = double(sent_inside);
    comm.all_reduce(sent.view(), be->stream());
    EXPECT_EQ(sent.ptr<double>()[0], double(want_cross)) << what << " rows across nodes";
    EXPECT_EQ(sent.ptr<double>()[1], double(want_inside)) << what << " rows inside nodes";
    const double tokens = double(P * 20 + 7 * P * (P - 1) / 2);
    if (me == 0)
      std::cout << "[ links    ] " << P << " ranks, " << rpn << " per node, " << what << ": " << double(want_cross) / tokens
                << " cross-node and " << double(want_inside) / tokens << " in-node rows per token\n";
  };
  check_links(route.cross_node_rows(), route.in_node_rows(), cross, inside, "dispatch");
  Tensor r = Tensor::host(DType::f32, {std::max<int64_t>(ep::total(ret_send), 1), 3});
  std::memcpy(r.view().data, ret.data(), ret.size() * sizeof(float));
  r = prefix(r, ep::total(ret_send));
  const ep::CombineRoute combine(*be, comm, rail.get(), node.get(), ret_send, plan.slots_per_rank);
  const Tensor back = combine.carry(*be, r, DType::bf16);
  check_links(combine.cross_node_rows(), combine.in_node_rows(), back_cross, back_inside, "combine");
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

// ---- What crosses ranks in the expert-parallel layer: FP8 dispatch, BF16 combine (§3.3.3) ----
// A Comm that forwards every call to the real MPI communicator (the data still travels through
// Open MPI) and records each all_to_all_v: dtype, row width, counts, and the send buffer's bytes.
// Its splits (the two-hop dispatch's rail and node groups) record into the same log.
struct WireCall {
  DType dtype;
  int64_t cols = 0;                            // elements per row
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<uint8_t> send;                   // the rows as sent, destination-major
  int64_t row_bytes() const { return int64_t(dtype_bytes(dtype, cols)); }
};
class RecordingComm final : public Comm {
 public:
  RecordingComm(Comm& inner, std::shared_ptr<std::vector<WireCall>> log, std::unique_ptr<Comm> owned = nullptr)
      : inner_(inner), owned_(std::move(owned)), log_(std::move(log)) {}
  const std::vector<WireCall>& log() const { return *log_; }
  std::string name() const override { return inner_.name(); }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::unique_ptr<Comm> split(int color, int key) override {
    std::unique_ptr<Comm> sub = inner_.split(color, key);
    Comm& ref = *sub;
    return std::make_unique<RecordingComm>(ref, log_, std::move(sub));
  }
  void send(const TensorView& t, int peer, const Stream& s) override { inner_.send(t, peer, s); }
  void recv(const TensorView& t, int peer, const Stream& s) override { inner_.recv(t, peer, s); }
  CommRequest isend(const TensorView& t, int peer, const Stream& s) override { return inner_.isend(t, peer, s); }
  CommRequest irecv(const TensorView& t, int peer, const Stream& s) override { return inner_.irecv(t, peer, s); }
  void all_to_all_v(const TensorView& send, std::span<const int64_t> sc, const TensorView& recv,
                    std::span<const int64_t> rc, const Stream& s) override {
    FP8MOE_CHECK(send.device == Device::cpu, "RecordingComm: CPU ranks only");
    int64_t cols = 1;  // the row shape (empty exchanges too)
    for (int d = 1; d < send.ndim; ++d) cols *= send.size(d);
    WireCall w{send.dtype, cols, {sc.begin(), sc.end()}, {rc.begin(), rc.end()}, {}};
    w.send.resize(send.nbytes());
    if (!w.send.empty()) std::memcpy(w.send.data(), send.data, w.send.size());
    log_->push_back(std::move(w));
    inner_.all_to_all_v(send, sc, recv, rc, s);
  }
  void all_gather(const TensorView& a, const TensorView& b, const Stream& s) override { inner_.all_gather(a, b, s); }
  void reduce_scatter(const TensorView& a, const TensorView& b, const Stream& s) override { inner_.reduce_scatter(a, b, s); }
  CommRequest ireduce_scatter(const TensorView& a, const TensorView& b, const Stream& s) override {
    return inner_.ireduce_scatter(a, b, s);
  }
  CommRequest iall_gather(const TensorView& a, const TensorView& b, const Stream& s) override {
    return inner_.iall_gather(a, b, s);
  }
  void all_reduce(const TensorView& t, const Stream& s) override { inner_.all_reduce(t, s); }
  void broadcast(const TensorView& t, int root, const Stream& s) override { inner_.broadcast(t, root, s); }
  void barrier() override { inner_.barrier(); }
  std::vector<std::string> exchange(std::string_view mine) override { return inner_.exchange(mine); }

 private:
  Comm& inner_;
  std::unique_ptr<Comm> owned_;
  std::shared_ptr<std::vector<WireCall>> log_;
};

// The expert-parallel layer behind a recorder of its inputs: which exchanges each forward and
// backward made (calls [first, last) of the log), with h or dy, idx and w on the host.
struct LayerCall {
  bool backward = false;
  size_t first = 0, last = 0;
  Tensor x, idx, w;  // x: h (forward) or dy (backward)
};
class RecordingExperts final : public RoutedExperts {
 public:
  RecordingExperts(std::shared_ptr<RoutedExperts> inner, const RecordingComm& comm) : inner_(std::move(inner)), comm_(comm) {}
  std::vector<LayerCall> calls;
  std::unique_ptr<State> forward(model::Ctx& c, int64_t layer, const Tensor& h, const Tensor& idx, const Tensor& w,
                                 const Tensor& y) override {
    LayerCall lc{false, comm_.log().size(), 0, h, idx, w};
    auto s = inner_->forward(c, layer, h, idx, w, y);
    lc.last = comm_.log().size();
    states_[s.get()] = {idx, w};
    calls.push_back(std::move(lc));
    return s;
  }
  void backward_input(model::Ctx& c, State& s, const Tensor& dy, const Tensor& w, const Tensor& dh,
                      const Tensor& dw) override {
    LayerCall lc{true, comm_.log().size(), 0, dy, states_.at(&s).first, w};
    inner_->backward_input(c, s, dy, w, dh, dw);
    lc.last = comm_.log().size();
    calls.push_back(std::move(lc));
  }
  void backward_weight(model::Ctx& c, State& s) override {
    inner_->backward_weight(c, s);
    states_.erase(&s);
  }

 private:
  std::shared_ptr<RoutedExperts> inner_;
  const RecordingComm& comm_;
  std::map<const State*, std::pair<Tensor, Tensor>> states_;
};

bool is_pow2(float s) {
  int e;
  return s > 0 && std::frexp(s, &e) == 0.5f;
}

// Forward and backward of the tiny MoE config without MTP (hidden 384: three 1x128 tiles per row) through the
// expert-parallel layer on every rank of the world (one hop; nodes of `rpn` ranks: two hops, the
// token to one node), the layer's exchanges recorded at the communicator. For each forward:
// the rows of width D (the hidden size) that cross are exactly two exchanges, the dispatch
// (e4m3, 1 byte per element, followed at once by the same counts of f32 rows of D / 128 scales,
// every scale a power of two) and the combine (bf16, 2 bytes per element); for each backward the
// same, the dispatched dy in e4m3 with power-of-two scales and the combine gradient in bf16. One
// hop: each destination's e4m3 rows and scales are bit for bit the 1x128 power-of-two quantization
// of the tokens the routing sends there (the dispatch layout), the combine's rows come back one per
// (token, expert) slot, and the bytes per destination are rows x (D + 4 D / 128) out and
// rows x 2 D back; the whole layer's exchanges are exactly these plus the weights, ids and the
// combine weights' FP32 gradients.
// Removals tried on a scratch copy of src/parallel/runtime; each made both tests fail at 2 and 4
// ranks (one hop at 2, one and two hops at 4), and the reverted source passes:
//   dispatch_fp8 carrying BF16 rows (no scales)      dispatch "bf16", 768 bytes per row, 0 scale exchanges
//   dispatch_fp8 carrying the f32 rows               dispatch "f32", 1536 bytes per row, 0 scale exchanges
//   dispatch_fp8 quantizing to e5m2                  dispatch "e5m2"
//   dispatch_fp8 given ScaleMode::fp32 (both ways)   96 of 96 scales not powers of two (2 ranks), forward and backward
//   ScaleMode::fp32 for the backward's dy only       the backward's scales only, 96 of 96
//   return_rows' default dtype f32 (both combines)   combine "f32", 1536 bytes per row, forward and backward
//   the backward's combine gradient in f32 only      backward combine "f32", 1536 bytes per row
void check_wire(int64_t rpn) {
  Comm& world = *g_world;
  auto be = make_backend("cpu");
  const int P = world.size(), me = world.rank();
  ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  cfg.hidden_size = 384;  // three 1x128 tiles per row (D / 128 apart from top-k)
  cfg.seq_len = 16;
  cfg.num_nextn_predict_layers = 0;  // one MoE layer: oversubscribed CPU ranks are slow
  ParallelOptions opt;
  opt.ep = P;
  if (rpn < P) {
    opt.ranks_per_node = rpn;
    opt.max_nodes = 1;
  }
  const ParallelLayout layout = make_parallel_layout(opt, P, me, cfg);
  apply_node_limited_routing(layout, cfg);
  ParallelGroups groups = make_parallel_groups(world, layout);
  auto log = std::make_shared<std::vector<WireCall>>();
  RecordingComm ep(*groups.ep, log);
  Model model(cfg, Recipe::from_name("fp8"), *be, 5, {layout.first_expert(), layout.experts_per_rank});
  auto rec = std::make_shared<RecordingExperts>(make_expert_parallel(model, ep, layout), ep);
  model.set_routed_experts(rec);
  std::mt19937_64 rng(g_seed + uint64_t(me) * 104729);  // every rank its own tokens
  Tensor tok = Tensor::host(DType::i32, {2, cfg.seq_len}), tgt = Tensor::host(DType::i32, {2, cfg.seq_len});
  for (int64_t i = 0; i < tok.numel(); ++i) tok.ptr<int32_t>()[i] = int32_t(rng() % uint64_t(cfg.vocab_size));
  for (int64_t i = 0; i < tgt.numel(); ++i) tgt.ptr<int32_t>()[i] = int32_t(rng() % uint64_t(cfg.vocab_size));
  model.zero_grad();
  model.forward_backward(tok.view(), tgt.view());
  be->synchronize();

  const int64_t D = cfg.hidden_size, G = D / 128, K = cfg.num_experts_per_tok, epr = layout.experts_per_rank;
  ASSERT_GE(rec->calls.size(), 2u);
  int64_t fp8_bytes = 0, bf16_bytes = 0, dispatched = 0, combined = 0, tokens = 0, layers = 0;
  int64_t combine_link_bytes[4] = {};  // two hops: sent inside, across; counted from the routing: inside, across
  for (const LayerCall& lc : rec->calls) {
    const char* what = lc.backward ? "backward" : "forward";
    const Tensor x = be->to_host(lc.x), idx = be->to_host(lc.idx);
    const int64_t T = x.size(0);
    if (!lc.backward) tokens += T, ++layers;
    std::vector<size_t> wide, scales;  // the exchanges of rows of width D; of f32 rows of D / 128
    for (size_t i = lc.first; i < lc.last; ++i) {
      if (log->at(i).cols == D) wide.push_back(i);
      if (log->at(i).cols == G && log->at(i).dtype == DType::f32) scales.push_back(i);
    }
    const size_t hops = rpn < P ? 2 : 1;
    ASSERT_EQ(wide.size(), 2 * hops) << what << ": exchanges of " << D << "-wide rows (dispatch, combine)";
    // The dispatch (one call per hop), then its scales hop by hop.
    for (size_t h = 0; h < hops; ++h) {
      EXPECT_EQ(dtype_name(log->at(wide[h]).dtype), "e4m3") << what << " dispatch hop " << h;
      EXPECT_EQ(log->at(wide[h]).row_bytes(), D) << what << " dispatch: 1 byte per element";
    }
    ASSERT_EQ(scales.size(), hops) << what << ": exchanges of " << G << " f32 per row (a scale per 128 columns)";
    for (size_t h = 0; h < hops; ++h) {
      const WireCall& v = log->at(wide[h]);
      const WireCall& sc = log->at(scales[h]);
      EXPECT_EQ(sc.send_counts, v.send_counts) << what << ": a scale row per dispatched row";
      int64_t bad = 0;
      const float* s = reinterpret_cast<const float*>(sc.send.data());
      for (size_t i = 0; i < sc.send.size() / 4; ++i) bad += !is_pow2(s[i]);
      EXPECT_EQ(bad, 0) << what << ": dispatch scales not powers of two, of " << sc.send.size() / 4;
    }
    for (size_t h = hops; h < 2 * hops; ++h) {  // the combine (forward) or its gradient (backward), hop by hop
      EXPECT_EQ(dtype_name(log->at(wide[h]).dtype), "bf16") << what << " combine hop " << h - hops;
      EXPECT_EQ(log->at(wide[h]).row_bytes(), 2 * D) << what << " combine: 2 bytes per element";
    }
    const WireCall& cb = log->at(wide.back());
    if (rpn < P && !::testing::Test::HasFailure()) {
      // Two hops: the combine's bytes to the other ranks of this node (hop 1) and to the other
      // nodes (hop 2, as the relay), against this rank's slots counted from its own routing (the
      // sums over ranks are the same: every row crosses each link once).
      const WireCall& c1 = log->at(wide[hops]);
      const WireCall& c2 = log->at(wide[hops + 1]);
      for (size_t l = 0; l < c1.send_counts.size(); ++l)
        if (int64_t(l) != me % rpn) combine_link_bytes[0] += c1.send_counts[l] * c1.row_bytes();
      for (size_t n = 0; n < c2.send_counts.size(); ++n)
        if (int64_t(n) != me / rpn) combine_link_bytes[1] += c2.send_counts[n] * c2.row_bytes();
      for (int64_t i = 0; i < T * K; ++i) {
        const int64_t d = idx.ptr<int32_t>()[i] / epr;
        combine_link_bytes[2] += (d % rpn != me % rpn) * 2 * D;
        combine_link_bytes[3] += (d / rpn != me / rpn) * 2 * D;
      }
    }
    if (rpn < P || ::testing::Test::HasFailure()) continue;
    // One hop: the exact rows and bytes the routing implies.
    const ep::DispatchLayout plan = ep::dispatch_layout(idx.ptr<int32_t>(), T, K, P, epr);
    const WireCall& v = log->at(wide[0]);
    const WireCall& sc = log->at(scales[0]);
    QuantizedTensor q = be->empty_quantized(T, D, DType::e4m3, ScaleKind::tile_1x128);
    be->quantize_1x128(x.view(), q, ScaleMode::pow2);
    const int64_t ld = scale_ld(T);
    int64_t row = 0, code_diff = 0, scale_diff = 0;
    for (int d = 0; d < P; ++d) {
      EXPECT_EQ(v.send_counts[size_t(d)], plan.tokens_per_rank[size_t(d)]) << what << ": rows to rank " << d;
      EXPECT_EQ(int64_t(v.send_counts[size_t(d)]) * v.row_bytes() + sc.send_counts[size_t(d)] * sc.row_bytes(),
                plan.tokens_per_rank[size_t(d)] * (D + 4 * G))
          << what << ": dispatch bytes to rank " << d;
      // The combine rows this rank receives from d: one per slot of its tokens on d's experts.
      EXPECT_EQ(cb.recv_counts[size_t(d)] * cb.row_bytes(), plan.slots_per_rank[size_t(d)] * 2 * D)
          << what << ": combine bytes from rank " << d;
      for (int64_t i = 0; i < plan.tokens_per_rank[size_t(d)]; ++i, ++row) {
        const int64_t t = plan.send_token[size_t(row)];
        code_diff += std::memcmp(v.send.data() + row * D, q.values.ptr<uint8_t>() + t * D, size_t(D)) != 0;
        for (int64_t g = 0; g < G; ++g)
          scale_diff += reinterpret_cast<const float*>(sc.send.data())[row * G + g] != q.scales.ptr<float>()[g * ld + t];
      }
      if (d != me) {
        fp8_bytes += v.send_counts[size_t(d)] * v.row_bytes() + sc.send_counts[size_t(d)] * sc.row_bytes();
        bf16_bytes += cb.recv_counts[size_t(d)] * cb.row_bytes();
        dispatched += v.send_counts[size_t(d)];
        combined += cb.recv_counts[size_t(d)];
      }
    }
    EXPECT_EQ(code_diff, 0) << what << ": dispatched rows whose e4m3 codes are not the 1x128 pow2 quantization, of " << row;
    EXPECT_EQ(scale_diff, 0) << what << ": dispatched scales not those of the 1x128 pow2 quantization";
    // Everything else the layer exchanged: forward the weights (act) and expert ids (i32) with the
    // dispatch's counts, backward the combine weights' gradients (f32, one per slot).
    std::vector<std::pair<std::string_view, int64_t>> seen, want;
    for (size_t i = lc.first; i < lc.last; ++i) seen.emplace_back(dtype_name(log->at(i).dtype), log->at(i).cols);
    if (lc.backward) want = {{"e4m3", D}, {"f32", G}, {"bf16", D}, {"f32", 1}};
    else want = {{"e4m3", D}, {"f32", G}, {dtype_name(lc.w.dtype()), K}, {"i32", K}, {"bf16", D}};
    EXPECT_EQ(seen, want) << what << ": the layer's exchanges (dtype, row width)";
  }
  if (rpn < P) {
    Tensor links = Tensor::host(DType::f64, {4});
    for (int i = 0; i < 4; ++i) links.ptr<double>()[i] = double(combine_link_bytes[i]);
    world.all_reduce(links.view(), be->stream());
    const double* a = links.ptr<double>();
    EXPECT_GT(a[1], 0);
    EXPECT_EQ(a[0], a[2]) << "combine bytes inside nodes, forward and backward";
    EXPECT_EQ(a[1], a[3]) << "combine bytes across nodes, forward and backward";
    if (me == 0)
      std::cout << "[ wire     ] " << P << " ranks, " << rpn << " per node: the combines sent " << a[1]
                << " bytes across nodes and " << a[0] << " inside (bf16 rows, forward and backward)\n";
    return;
  }
  Tensor sum = Tensor::host(DType::f64, {6});
  const double mine[] = {double(fp8_bytes), double(bf16_bytes), double(dispatched), double(combined), double(tokens),
                         double(layers)};
  std::memcpy(sum.view().data, mine, sizeof mine);
  world.all_reduce(sum.view(), be->stream());
  const double* a = sum.ptr<double>();
  if (me == 0)
    std::cout << "[ wire     ] " << P << " ranks, D = " << D << ", forward + backward of " << a[5] / P
              << " MoE layer(s): " << a[0] / a[2] << " bytes per dispatched row across ranks (bf16: " << 2 * D
              << "), " << a[1] / a[3] << " per combine row; per token and pass " << a[2] / (2 * a[4])
              << " dispatched and " << a[3] / (2 * a[4]) << " combine rows to other ranks\n";
}

TEST(ExpertParallelWire, Fp8DispatchBf16CombineOneHop) {
  if (g_world->size() < 2) GTEST_SKIP() << "nothing crosses ranks on one";
  check_wire(g_world->size());
}

TEST(ExpertParallelWire, Fp8DispatchBf16CombineTwoHops) {
  if (g_world->size() % 2 || g_world->size() < 4) GTEST_SKIP() << "needs 2 nodes of 2 ranks or more";
  check_wire(2);
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

// Pipeline ranks each holding their own parameters (here the world as the pp group, dp one rank):
// parameter i counts on rank i mod P only, as a parameter two pipeline ranks hold counts on the
// lower one; the norm is the square root of those squares over every rank.
TEST(Zero1AdamW, NormOverPipelineRanksCountsEachParameterOnce) {
  Comm& world = *g_world;
  auto be = make_backend("cpu");
  const int P = world.size(), me = world.rank();
  std::unique_ptr<Comm> dp = world.split(me, 0);
  Params z = make_params(g_seed);
  std::vector<bool> counted;
  for (size_t i = 0; i < z.refs.size(); ++i) counted.push_back(int(i) % P == me);
  Zero1AdamW zero(*be, *dp, z.refs, AdamWConfig{});
  zero.count_norm_over(world, counted);
  fill_grads(z, me, 4);
  zero.reduce_gradients();
  double want = 0;
  for (int r = 0; r < P; ++r) {
    Params other = make_params(g_seed);
    fill_grads(other, r, 4);
    for (size_t i = 0; i < other.g.size(); ++i)
      if (int(i) % P == r)
        for (int64_t j = 0; j < other.g[i].numel(); ++j) want += double(other.g[i].ptr<float>()[j]) * other.g[i].ptr<float>()[j];
  }
  const double norm = zero.grad_norm();
  EXPECT_NEAR(norm, std::sqrt(want), 1e-12 * std::sqrt(want));
}

// Expert parallelism over E ranks (E = 2 when the world is even): every rank holds the
// replicated parameters and its ep rank's experts (rank r: r mod E), the same on its
// expert-data-parallel ranks. The experts' bucket is AdamW on the sum over those ranks only, in
// rank order; the norm is the whole model's, every expert once.
TEST(Zero1AdamW, ExpertBucketIsAdamWOnTheSumOverTheExpertsReplicas) {
  Comm& world = *g_world;
  auto be = make_backend("cpu");
  const int P = world.size(), me = world.rank(), E = P % 2 == 0 ? 2 : 1;
  std::unique_ptr<Comm> edp = world.split(me % E, me);
  const uint64_t expert_seed = g_seed + 1000;
  auto experts_of = [&](int ep_rank) { return make_params(expert_seed + uint64_t(ep_rank)); };
  auto fill_expert_grads = [](Params& p, int r, int k) { fill_grads(p, r, k + 100); };
  Params rep = make_params(g_seed), ex = experts_of(me % E);
  Params ref_rep = make_params(g_seed), ref_ex = experts_of(me % E);
  std::vector<ParamRef> refs = rep.refs, ref_refs = ref_rep.refs;
  std::vector<bool> expert(rep.refs.size(), false);
  for (ParamRef r : ex.refs) {
    r.name = "x" + r.name;
    refs.push_back(r);
    expert.push_back(true);
  }
  for (ParamRef r : ref_ex.refs) ref_refs.push_back(r);
  AdamWConfig cfg;
  Zero1AdamW zero(*be, world, refs, cfg, edp.get(), expert);
  AdamW adam(*be, ref_refs, cfg);
  auto sum_into = [](Params& dst, const Params& src) {
    for (size_t i = 0; i < dst.g.size(); ++i)
      for (int64_t j = 0; j < dst.g[i].numel(); ++j) dst.g[i].ptr<float>()[j] += src.g[i].ptr<float>()[j];
  };
  auto zero_grads = [](Params& p) {
    for (Tensor& g : p.g) std::memset(g.view().data, 0, g.view().nbytes());
  };
  for (int k = 0; k < 3; ++k) {
    fill_grads(rep, me, k);
    fill_expert_grads(ex, me, k);
    zero_grads(ref_rep);
    zero_grads(ref_ex);
    double ss_experts = 0;  // every ep rank's experts, summed over their replicas
    for (int g = 0; g < E; ++g) {
      Params sum = experts_of(g);
      zero_grads(sum);
      for (int r = 0; r < P; ++r) {
        if (r % E != g) continue;
        Params other = experts_of(g);
        fill_expert_grads(other, r, k);
        sum_into(sum, other);
      }
      for (const Tensor& t : sum.g) ss_experts += be->sum_squares(t.view());
      if (g == me % E) sum_into(ref_ex, sum);
    }
    for (int r = 0; r < P; ++r) {
      Params other = make_params(g_seed);
      fill_grads(other, r, k);
      sum_into(ref_rep, other);
    }
    const double ref_norm = std::sqrt(std::pow(global_grad_norm(*be, ref_rep.refs), 2) + ss_experts);
    zero.reduce_gradients();
    const double norm = zero.grad_norm();
    EXPECT_NEAR(norm, ref_norm, 1e-12 * ref_norm);
    zero.step(1e-2f, clip_scale(ref_norm, 1.0f));
    adam.step(1e-2f, clip_scale(ref_norm, 1.0f));
    for (size_t i = 0; i < refs.size(); ++i)
      ASSERT_EQ(std::memcmp(refs[i].value.data, ref_refs[i].value.data, refs[i].value.nbytes()), 0)
          << refs[i].name << " after step " << k;
  }
  std::vector<Tensor> m, v;  // whole moments of this rank's parameters, its experts' included
  zero.gather_moments(m, v);
  ASSERT_EQ(m.size(), refs.size());
  for (size_t i = 0; i < m.size(); ++i) {
    ASSERT_EQ(std::memcmp(m[i].view().data, adam.first_moments()[i].view().data, m[i].view().nbytes()), 0) << i;
    ASSERT_EQ(std::memcmp(v[i].view().data, adam.second_moments()[i].view().data, v[i].view().nbytes()), 0) << i;
  }
}

// Each rank of --dp D --ep E holds the replicated parameters and 1/E of the routed experts, with
// their gradients and gradient buckets (4 + 4 + 4 bytes each), and 1/D of the optimizer state
// (FP32 master, two BF16 moments, the FP32 gradient shard: 4 + 2 + 2 + 4 bytes per parameter of
// the whole model).
TEST(ExpertShard, PerRankParameterAndOptimizerBytesAreTheFormula) {
  Comm& world = *g_world;
  auto be = make_backend("cpu");
  const int P = world.size();
  const ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  int64_t n_experts = 0;  // the whole model's routed-expert parameters
  for (int64_t l = 0; l < cfg.num_layers_total(); ++l)
    if (cfg.is_moe_layer(l)) n_experts += cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size;
  const int64_t n_all = count_parameters(cfg).total;
  for (int64_t E : {1, 2, 4}) {
    if (P % E != 0 || cfg.n_routed_experts % E != 0) continue;
    ParallelOptions opt;
    opt.dp = P;
    opt.ep = E;
    const ParallelLayout layout = make_parallel_layout(opt, P, world.rank(), cfg);
    ParallelGroups groups = make_parallel_groups(world, layout);
    const int64_t El = layout.experts_per_rank, first = layout.first_expert();
    Model model(cfg, Recipe::from_name("fp8"), *be, 5, {first, El});
    // Its experts only, n_routed / E per layer and matrix, stacked: local expert i at rows i * R.
    // "<layer>.mlp.experts." and ".<matrix>.weight" -> the experts held
    std::map<std::pair<std::string, std::string>, std::vector<int64_t>> held;
    int64_t expert_numel = 0, numel = 0, param_bytes = 0;
    std::vector<ParamRef> refs;
    std::vector<bool> expert;
    for (Parameter& p : model.parameters()) {
      numel += p.weight.numel();
      param_bytes += int64_t(p.weight.view().nbytes() + p.grad.view().nbytes());
      const size_t at = p.name.find(".mlp.experts.");
      if (at != std::string::npos) {
        const size_t e0 = at + 13, e1 = p.name.find('.', e0);
        held[{p.name.substr(0, e0), p.name.substr(e1)}].push_back(std::stoll(p.name.substr(e0, e1 - e0)));
        expert_numel += p.weight.numel();
      }
      if (!p.trainable) continue;
      refs.push_back({p.name, p.weight.view(), p.grad.view(), p.decay});
      expert.push_back(at != std::string::npos);
    }
    ASSERT_FALSE(held.empty());
    for (const auto& [stack, ids] : held) {
      const auto& [prefix, rest] = stack;
      ASSERT_EQ(int64_t(ids.size()), El) << prefix << "*" << rest;
      const TensorView w0 = model.parameter(prefix + std::to_string(first) + rest).weight.view();
      for (int64_t i = 0; i < El; ++i) {
        ASSERT_EQ(ids[size_t(i)], first + i) << prefix << "*" << rest;
        EXPECT_EQ(static_cast<const char*>(model.parameter(prefix + std::to_string(first + i) + rest).weight.view().data),
                  static_cast<const char*>(w0.data) + i * int64_t(w0.nbytes()))
            << prefix << first + i << rest << ": not row group " << i << " of the stack";
      }
      for (int64_t e = 0; e < cfg.n_routed_experts; ++e)
        if (e < first || e >= first + El) EXPECT_EQ(model.find_parameter(prefix + std::to_string(e) + rest), nullptr);
    }
    EXPECT_EQ(expert_numel * E, n_experts);
    EXPECT_EQ(numel, n_all - n_experts + n_experts / E);
    Zero1AdamW zero(*be, *groups.dp, refs, AdamWConfig{}, groups.edp.get(), expert);
    const Zero1AdamW::Memory mem = zero.memory();
    const double measured = double(param_bytes + mem.master + mem.moments + mem.gradient_shard + mem.bucket);
    const double formula = 12.0 * double(n_all - n_experts + n_experts / E) + 12.0 * double(n_all) / double(P);
    const double unsharded = 12.0 * double(n_all) + 12.0 * double(n_all) / double(P);  // every expert on every rank
    if (world.rank() == 0)
      std::cout << "[ memory   ] D = " << P << ", E = " << E << ": parameters, gradients, buckets and optimizer state "
                << int64_t(measured) << " bytes per rank, formula " << int64_t(formula) << " ("
                << measured / double(n_all) << " bytes per parameter; " << int64_t(unsharded)
                << " with every expert on every rank); routed experts "
                << expert_numel << " of " << n_experts << " parameters per rank\n";
    EXPECT_LE(std::abs(measured - formula), 0.1 * formula);
    const double optimizer = 8.0 * double(n_all) / double(P);  // master and moments, as without experts
    EXPECT_LE(std::abs(double(mem.master + mem.moments) - optimizer), 0.1 * optimizer);
  }
}

// The step with its collectives overlapped (the default) against the one that waits for each at
// once: the same bits, on the tiny model's parameters at --dp P --ep 2 (P even; the experts'
// bucket over P / 2 ranks). Prints the optimizer's time per step both ways (reduce_gradients +
// grad_norm + step, the median of 20 steps, the ranks started together):
//   OMP_NUM_THREADS=1 mpirun --oversubscribe -np 4 build/tests/parallel/test_parallel_mpi --gtest_filter='Zero1AdamW.Overlap*'
TEST(Zero1AdamW, OverlapGivesTheBitsOfOneBucketAfterTheOther) {
  Comm& world = *g_world;
  auto be = make_backend("cpu");
  const int P = world.size(), me = world.rank();
  const ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  ParallelOptions opt;
  opt.dp = P;
  opt.ep = P % 2 == 0 ? 2 : 1;
  const ParallelLayout layout = make_parallel_layout(opt, P, me, cfg);
  ParallelGroups groups = make_parallel_groups(world, layout);
  struct Run {
    std::unique_ptr<Model> model;
    std::vector<ParamRef> refs;
    std::unique_ptr<Zero1AdamW> zero;
    std::vector<double> seconds;
  } runs[2];
  for (int k = 0; k < 2; ++k) {
    Run& r = runs[k];
    r.model = std::make_unique<Model>(cfg, Recipe::from_name("fp8"), *be, 5,
                                      ExpertShard{layout.first_expert(), layout.experts_per_rank});
    std::vector<bool> expert;
    for (Parameter& p : r.model->parameters()) {
      if (!p.trainable) continue;
      r.refs.push_back({p.name, p.weight.view(), p.grad.view(), p.decay});
      expert.push_back(p.name.find(".mlp.experts.") != std::string::npos);
    }
    r.zero = std::make_unique<Zero1AdamW>(*be, *groups.dp, r.refs, AdamWConfig{}, groups.edp.get(), expert);
    r.zero->set_overlap(k == 0);
  }
  for (int step = 0; step < 20; ++step) {
    std::mt19937_64 rng(g_seed ^ (uint64_t(me) << 20) ^ uint64_t(step));
    std::normal_distribution<float> nd(0.f, 1e-2f);
    for (size_t i = 0; i < runs[0].refs.size(); ++i) {
      float* g = static_cast<float*>(runs[0].refs[i].grad.data);
      for (int64_t j = 0; j < runs[0].refs[i].grad.numel(); ++j) g[j] = nd(rng);
      std::memcpy(runs[1].refs[i].grad.data, g, runs[0].refs[i].grad.nbytes());
    }
    for (int k : {step % 2, 1 - step % 2}) {  // each first every other step
      Run& r = runs[k];
      world.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      r.zero->reduce_gradients();
      const double norm = r.zero->grad_norm();
      r.zero->step(1e-3f, clip_scale(norm, 1.0f));
      r.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    for (size_t i = 0; i < runs[0].refs.size(); ++i)
      ASSERT_EQ(std::memcmp(runs[0].refs[i].value.data, runs[1].refs[i].value.data, runs[0].refs[i].value.nbytes()), 0)
          << runs[0].refs[i].name << " after step " << step;
  }
  auto median_ms = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return 1e3 * v[v.size() / 2];
  };
  if (me == 0)
    std::cout << "[ overlap  ] D = " << P << ", E = " << opt.ep << ", " << runs[0].zero->numel()
              << " parameters per rank: optimizer step " << median_ms(runs[0].seconds) << " ms overlapped, "
              << median_ms(runs[1].seconds) << " ms one bucket after the other (median of 20, rank 0)\n";
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

int main(int argc, char** argv) { return fp8moe::testing::mpi_test_main(argc, argv, fp8moe::g_world, fp8moe::g_seed); }
