// The expert-parallel routed experts of the MoE layers (DeepSeek-V3 §3.2.2, §3.3.3), through the
// communicator's all_to_all_v (any backend) or the NVLink kernels (ep_nvlink.hpp: --ep-transport),
// which deliver the same rows in the same order:
//   forward   the layer's routing (idx, w) -> dispatch layout -> h quantized to 1x128 E4M3 tiles with
//             power-of-two scales, one row per (token, destination rank) with its expert ids and
//             weights (ep_exchange.hpp: one hop, or two across nodes) -> on the expert rank, per
//             source rank: the rows dequantized (exact) and requantized into the expert-sorted
//             layout (the same values), the grouped FP8 MLP of the model (mlp_forward) -> one
//             BF16 row per (token, expert) back to the source (one hop, or two across nodes:
//             inside the expert's node, then across) -> moe_combine there, weighted, in slot order.
//   backward  dy the same way in FP8 (the activation gradient before the down projection is
//             w * dequantized dy on the expert rank), the input gradients back in BF16 and the
//             combine weights' gradients (rows_dot) in FP32.
// Each source rank's rows run through the experts on their own, in the layout one rank holding
// every expert would build for that micro-batch (tokens ascending, segments padded to 128), and
// the experts' weight gradients add up source after source: the expert numbers do not depend on
// how many ranks hold the experts. The BF16 combines and the FP8 dy make this layer differ from
// the in-process one (src/model/moe.cpp) by those roundings; with --ep 1 it runs on one rank.
// Tested through training against one rank: ctest -R ParallelTrain (tests/parallel/parallel_train.sh).
#include <cstring>
#include <optional>

#include "dispatch_layout.hpp"
#include "ep_exchange.hpp"
#include "ep_nvlink.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/parallel.hpp"
#include "model/model_internal.hpp"

namespace fp8moe {

namespace {

using model::Ctx;
using model::prefix_rows;
using model::rows_of;

constexpr int64_t kAlign = 128;  // rows per expert segment: the grouped GEMMs' M tile

using ep::rows_tensor;
using ep::total;

Tensor i32_tensor(Ctx& c, const std::vector<int32_t>& v, int64_t rows, int64_t cols) {
  FP8MOE_CHECK(int64_t(v.size()) == rows * cols, "i32_tensor: " << v.size() << " values for [" << rows << ", " << cols << "]");
  Tensor h = Tensor::host(DType::i32, {std::max<int64_t>(rows, 1), cols});
  if (!v.empty()) std::memcpy(h.view().data, v.data(), v.size() * sizeof(int32_t));
  return prefix_rows(model::to_backend(c, h), rows);
}

Tensor flat(const Tensor& t) { return model::reshaped(t, {t.numel()}); }

class ExpertParallel final : public RoutedExperts {
 public:
  ExpertParallel(Model& m, Comm& ep, const ParallelLayout& l) : model_(m), ep_(ep), l_(l) {
    const Recipe& r = m.recipe();
    FP8MOE_CHECK(r.is_fp8() && !r.f32_cache && r.groups_experts(),
                 "--ep: expert parallelism dispatches FP8 tiles and runs the grouped FP8 experts: recipe '"
                     << r.name << "' does not (use an FP8 recipe that groups the experts, e.g. fp8)");
    FP8MOE_CHECK(ep.size() == l.ep && ep.rank() == l.ep_rank(),
                 "expert parallel: communicator rank " << ep.rank() << " of " << ep.size() << ", layout "
                                                       << l.ep_rank() << " of " << l.ep);
    FP8MOE_CHECK(m.config().n_routed_experts == l.experts, "expert parallel: the model has "
                                                               << m.config().n_routed_experts
                                                               << " routed experts, the layout " << l.experts);
    const ExpertShard held = m.expert_shard();
    FP8MOE_CHECK(held.first <= l.first_expert() && l.first_expert() + l.experts_per_rank <= held.first + held.count,
                 "expert parallel: rank " << l.ep_rank() << " runs routed experts [" << l.first_expert() << ", "
                                          << l.first_expert() + l.experts_per_rank << "), the model holds ["
                                          << held.first << ", " << held.first + held.count << ")");
    if (l.nodes > 1) {  // the two-hop dispatch: across nodes at this in-node index, then inside the node
      const int node = int(l.ep_rank() / l.ranks_per_node), local = int(l.ep_rank() % l.ranks_per_node);
      rail_ = ep.split(local, node);
      node_ = ep.split(node, local);
    }
    if (ep::use_nvlink(m.backend(), ep, l, r.act_dtype))
      nvlink_ = ep::make_nvlink_transport(ep, l, m.config().hidden_size, m.config().num_experts_per_tok);
  }

  struct Source {  // the rows one source rank sent here
    int64_t r0 = 0, n = 0, used = 0;  // received rows [r0, r0 + n); rows of its expert layout
    Tensor row_slot;                  // [used] i32
    model::ExpertGroups groups;       // the local experts' segments
    model::MlpState mlp;
    Tensor ret_rows;                  // [ret] i32: the layout rows returned, in slot order
    int64_t ret = 0;
  };
  struct State : RoutedExperts::State {
    int64_t layer = 0;
    ep::DispatchLayout plan;
    std::unique_ptr<ep::DispatchRoute> route;  // how this micro-batch's tokens reach the experts
    std::unique_ptr<ep::CombineRoute> back;    // how the expert rows return to their sources
    Tensor idx;          // nvlink: the routing, for the backward's dispatch
    Tensor slot_row;     // [T, k] i32: row of each slot among the returned rows
    std::vector<int64_t> recv_counts, ret_send, ret_recv;  // rows per rank
    Tensor w_recv;       // [received, k] act: the sources' combine weights
    std::vector<Source> src;
  };

  std::unique_ptr<RoutedExperts::State> forward(Ctx& c, int64_t layer, const Tensor& h, const Tensor& idx,
                                                const Tensor& w, const Tensor& y) override {
    auto s = std::make_unique<State>();
    const int64_t T = h.size(0), D = h.size(1), K = idx.size(1), P = l_.ep, El = l_.experts_per_rank;
    s->layer = layer;
    const Tensor idx_h = c.be.to_host(idx);
    s->plan = ep::dispatch_layout(idx_h.ptr<int32_t>(), T, K, P, El);
    // Dispatch: FP8 rows, their expert ids and weights.
    Tensor xr, ids;  // [nr, D] the rows, dequantized; [nr, k] global ids
    if (nvlink_) {
      ep::NvlinkTransport::Dispatched d = nvlink_->dispatch(c.be, h, w, idx, c.recipe.pow2_mode);
      s->idx = idx;
      s->recv_counts = d.recv_counts;
      count_traffic(idx_h.ptr<int32_t>(), T, K, std::nullopt, d.in_node_rows);
      xr = d.x;
      s->w_recv = d.weights;
      ids = d.ids;
    } else {
      s->route = std::make_unique<ep::DispatchRoute>(c.be, ep_, rail_.get(), node_.get(), idx_h.ptr<int32_t>(), T, K, El);
      s->recv_counts = s->route->recv_counts();
      count_traffic(idx_h.ptr<int32_t>(), T, K, s->route->cross_node_rows(), s->route->in_node_rows());
      xr = ep::dispatch_fp8(c.be, *s->route, h, c.recipe.pow2_mode);
      s->w_recv = s->route->carry(c.be, w);
      ids = s->route->carry(c.be, idx);
    }
    const int64_t nr = xr.size(0);
    const Tensor ids_h = c.be.to_host(ids);
    std::vector<int32_t> local(size_t(nr * K));  // this rank's local expert of each slot, or -1
    for (int64_t i = 0; i < nr * K; ++i) {
      const int32_t e = ids_h.ptr<int32_t>()[i];
      local[size_t(i)] = e / El == l_.ep_rank() ? int32_t(e - l_.first_expert()) : -1;
    }
    const Tensor rids = i32_tensor(c, local, nr, K);
    // The local experts, source by source.
    s->src.resize(size_t(P));
    std::vector<Tensor> ye(static_cast<size_t>(P));
    int64_t r0 = 0;
    for (int64_t p = 0; p < P; ++p) {
      Source& so = s->src[size_t(p)];
      so.r0 = r0;
      so.n = s->recv_counts[size_t(p)];
      r0 += so.n;
      if (so.n == 0) continue;
      ye[size_t(p)] = run_experts(c, layer, so, rows_of(xr, so.r0, so.n), rows_of(rids, so.r0, so.n),
                                  local.data() + so.r0 * K, K);
    }
    s->ret_send.assign(size_t(P), 0);
    for (int64_t p = 0; p < P; ++p) s->ret_send[size_t(p)] = s->src[size_t(p)].ret;
    s->ret_recv = s->plan.slots_per_rank;
    s->back = std::make_unique<ep::CombineRoute>(c.be, ep_, rail_.get(), node_.get(), s->ret_send, s->ret_recv);
    if (nvlink_) {  // its combine is one hop, across nodes where the expert rank is on another
      for (int64_t p = 0; p < P; ++p)
        if (p != l_.ep_rank())
          (p / l_.ranks_per_node == l_.ep_rank() / l_.ranks_per_node ? traffic_.combine_in_node_rows
                                                                     : traffic_.combine_cross_node_rows) +=
              s->ret_send[size_t(p)];
    } else {
      traffic_.combine_cross_node_rows += s->back->cross_node_rows();
      traffic_.combine_in_node_rows += s->back->in_node_rows();
    }
    // Combine: the expert outputs back in BF16, one row per slot.
    s->slot_row = i32_tensor(c, s->plan.slot_row, T, K);
    if (nvlink_) {
      nvlink_->combine(c.be, gather_returned(c, *s, ye, D), w, y);
    } else {
      const Tensor out = return_rows(c, *s, ye, D);
      if (T > 0) c.be.moe_combine(out.view(), s->slot_row.view(), w.view(), y.view(), true);
    }
    const std::string name = "layers." + std::to_string(layer) + ".moe";
    for (const Source& so : s->src) {
      if (so.n == 0) continue;
      so.mlp.in.account(s->kept, name, "experts.in");
      so.mlp.account(s->kept, name, "experts.");
    }
    return s;
  }

  void backward_input(Ctx& c, RoutedExperts::State& saved, const Tensor& dy, const Tensor& w, const Tensor& dh,
                      const Tensor& dw) override {
    auto& s = static_cast<State&>(saved);
    const int64_t T = dy.size(0), D = dy.size(1), K = w.size(1), P = l_.ep;
    const Tensor dyr = nvlink_ ? nvlink_->dispatch(c.be, dy, w, s.idx, c.recipe.pow2_mode).x
                               : ep::dispatch_fp8(c.be, *s.route, dy, c.recipe.pow2_mode);  // [nr, D]
    const ScaleMode pow2 = c.recipe.pow2_mode;
    std::vector<Tensor> dxe(static_cast<size_t>(P)), cg(static_cast<size_t>(P));
    for (int64_t p = 0; p < P; ++p) {
      Source& so = s.src[size_t(p)];
      if (so.n == 0) continue;
      Tensor dye = c.empty({so.used, D});  // w * dy of the layout's rows: the down projection's output gradient
      c.be.moe_permute(rows_of(dyr, so.r0, so.n).view(), so.row_slot.view(), K, rows_of(s.w_recv, so.r0, so.n).view(),
                       dye.view());
      dxe[size_t(p)] = c.empty({so.used, D});
      cg[size_t(p)] = c.empty({so.used});
      model::mlp_backward_input(c, params(s.layer, so), so.mlp, dye, dxe[size_t(p)], false, pow2, &cg[size_t(p)]);
      cg[size_t(p)] = model::reshaped(cg[size_t(p)], {so.used, 1});
    }
    if (nvlink_) nvlink_->combine(c.be, gather_returned(c, s, dxe, D), Tensor(), dh);
    const Tensor back = nvlink_ ? Tensor() : return_rows(c, s, dxe, D);  // [T * k, D] bf16
    const Tensor cg_back = return_rows(c, s, cg, 1, DType::f32);
    if (T == 0) return;
    if (!nvlink_) c.be.moe_combine(back.view(), s.slot_row.view(), TensorView(), dh.view(), true);
    // NOTES: w > 0 always (sigmoid affinities, positive scaling factor, validated).
    c.be.moe_combine_weight_grad(flat(cg_back).view(), s.slot_row.view(), w.view(), dw.view());
  }

  void backward_weight(Ctx& c, RoutedExperts::State& saved) override {
    auto& s = static_cast<State&>(saved);
    for (Source& so : s.src)  // source after source: the sums of one rank holding every expert
      if (so.n > 0) model::mlp_backward_weight(c, params(s.layer, so), so.mlp);
    s.src.clear();
    s.w_recv = Tensor();
  }

  const DispatchTraffic& traffic() const { return traffic_; }
  const char* transport() const { return nvlink_ ? "nvlink" : "comm"; }

 private:
  // The stacked matrices of this rank's experts of `layer`, grouped over so's layout.
  model::MlpParams params(int64_t layer, const Source& so) const {
    const std::string pre =
        "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(l_.first_expert()) + ".";
    model::MlpParams p;
    p.gate = &model_.parameter(pre + "gate_proj.weight");
    p.up = &model_.parameter(pre + "up_proj.weight");
    p.down = &model_.parameter(pre + "down_proj.weight");
    p.grouped = &so.groups;
    return p;
  }

  // One source's n received rows xr [n, D] with local expert ids [n, k] (ids_h on the host):
  // the expert layout, the grouped MLP; returns the expert outputs [used, D] and sets so.ret_rows.
  Tensor run_experts(Ctx& c, int64_t layer, Source& so, const Tensor& xr, const Tensor& ids, const int32_t* ids_h,
                     int64_t K) {
    const int64_t n = so.n, D = xr.size(1), El = l_.experts_per_rank;
    std::vector<int64_t> loads(size_t(El), 0);
    for (int64_t i = 0; i < n * K; ++i)
      if (ids_h[i] >= 0) ++loads[size_t(ids_h[i])];
    auto& g = so.groups;
    g.groups = El;
    g.start.assign(size_t(El), 0);
    g.count.assign(size_t(El), 0);
    for (int64_t e = 0; e < El; ++e) {
      g.count[size_t(e)] = (loads[size_t(e)] + kAlign - 1) / kAlign * kAlign;
      if (e > 0) g.start[size_t(e)] = g.start[size_t(e - 1)] + g.count[size_t(e - 1)];
    }
    so.used = g.start[size_t(El - 1)] + g.count[size_t(El - 1)];
    const int64_t R = moe_layout_rows(n * K, El, kAlign);
    Tensor row_slot = c.be.empty(DType::i32, {R}), row_group = c.be.empty(DType::i32, {R});
    Tensor slot_row = c.be.empty(DType::i32, {n, K});
    g.offsets = c.be.empty(DType::i32, {El + 1});
    c.be.moe_layout(ids.view(), kAlign, row_slot.view(), row_group.view(), slot_row.view(), g.offsets.view());
    so.row_slot = prefix_rows(row_slot, so.used);
    g.row_group = prefix_rows(row_group, so.used);
    so.mlp.in.rows = so.used;
    so.mlp.in.q = c.be.empty_quantized(so.used, D, DType::e4m3, ScaleKind::tile_1x128);
    c.be.moe_permute_quantize(xr.view(), so.row_slot.view(), K, TensorView(), so.mlp.in.q, c.recipe.pow2_mode);
    Tensor ye = c.empty({so.used, D});
    model::mlp_forward(c, params(layer, so), so.mlp, ye, c.recipe.pow2_mode);
    const Tensor slot_row_h = c.be.to_host(slot_row);
    const std::vector<int32_t> rows = ep::return_rows(ids_h, slot_row_h.ptr<int32_t>(), n, K);
    so.ret = int64_t(rows.size());
    so.ret_rows = model::reshaped(i32_tensor(c, rows, so.ret, 1), {so.ret});
    return ye;
  }

  // The rows of `per_source` [used, cols] named by each source's ret_rows, sent back to their
  // sources (dtype: bf16, the combine, or f32); returns what came back [T * k, cols], rank-major.
  Tensor return_rows(Ctx& c, const State& s, const std::vector<Tensor>& per_source, int64_t cols,
                     DType dtype = DType::bf16) {
    return s.back->carry(c.be, gather_returned(c, s, per_source, cols), dtype);
  }

  // The rows of `per_source` named by each source's ret_rows, source-major: what goes back.
  Tensor gather_returned(Ctx& c, const State& s, const std::vector<Tensor>& per_source, int64_t cols) {
    const int64_t P = l_.ep, n = total(s.ret_send);
    Tensor rows = rows_tensor(c.be, c.act(), n, cols);  // gathered in the activation dtype
    int64_t off = 0;
    for (int64_t p = 0; p < P; ++p) {
      const Source& so = s.src[size_t(p)];
      if (so.ret == 0) continue;
      c.be.gather_rows(per_source[size_t(p)].view(), so.ret_rows.view(), TensorView(), rows_of(rows, off, so.ret).view());
      off += so.ret;
    }
    return rows;
  }

  // cross_node_rows: the transport's count, or none for the two-hop dispatch's first hop over
  // peer memory (a row per token and other node holding one of its experts: counted here).
  void count_traffic(const int32_t* idx, int64_t T, int64_t K, std::optional<int64_t> cross_node_rows,
                     int64_t in_node_rows) {
    const int64_t G = l_.ranks_per_node, me = l_.ep_rank() / G;
    traffic_.tokens += T;
    traffic_.cross_node_rows += cross_node_rows.value_or(0);
    traffic_.in_node_rows += in_node_rows;
    std::vector<int64_t> seen_rank(size_t(l_.ep), -1), seen_node(size_t(l_.nodes), -1);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t r = idx[t * K + j] / l_.experts_per_rank, n = r / G;
        if (seen_node[size_t(n)] != t) {
          seen_node[size_t(n)] = t;
          ++traffic_.token_nodes;
          if (!cross_node_rows && n != me) ++traffic_.cross_node_rows;
        }
        if (seen_rank[size_t(r)] != t) {
          seen_rank[size_t(r)] = t;
          if (n != me) ++traffic_.one_hop_cross_rows;
        }
      }
  }

  Model& model_;
  Comm& ep_;
  std::unique_ptr<Comm> rail_, node_;  // nodes > 1: the ranks with this in-node index; this node's
  std::unique_ptr<ep::NvlinkTransport> nvlink_;  // --ep-transport: the rows over peer memory
  ParallelLayout l_;
  DispatchTraffic traffic_;
};

}  // namespace

DispatchTraffic dispatch_traffic(const RoutedExperts& expert_parallel) {
  const auto* ep = dynamic_cast<const ExpertParallel*>(&expert_parallel);
  FP8MOE_CHECK(ep, "dispatch_traffic: the routed experts were not made by make_expert_parallel");
  return ep->traffic();
}

std::string expert_parallel_transport(const RoutedExperts& expert_parallel) {
  const auto* ep = dynamic_cast<const ExpertParallel*>(&expert_parallel);
  FP8MOE_CHECK(ep, "expert_parallel_transport: the routed experts were not made by make_expert_parallel");
  return ep->transport();
}

std::shared_ptr<RoutedExperts> make_expert_parallel(Model& model, Comm& ep, const ParallelLayout& layout) {
  return std::make_shared<ExpertParallel>(model, ep, layout);
}

}  // namespace fp8moe
