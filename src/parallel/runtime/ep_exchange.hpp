// The exchanges of the expert-parallel layer over a communicator (all_to_all_v): FP8 rows out to
// the ranks that hold the experts, rows back to their sources. Used by expert_parallel.cpp and
// tested on their own with rows that name their source rank and token
// (tests/parallel/test_parallel_mpi.cpp).
#pragma once
#include <functional>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/comm.hpp"

namespace fp8moe::ep {

// One all_to_all_v of a route: the rows of the previous stage gathered in send order, exchanged.
struct Hop {
  Comm* comm = nullptr;
  std::vector<int32_t> gather;        // rows of the previous stage, in send order
  std::vector<int64_t> send, recv;    // rows per peer
  Tensor gather_dev;                  // [gather] i32 on the backend
};

// How per-token rows travel from their source to the ranks that hold the token's experts, one
// copy per destination rank, arriving ordered by source rank and then token (the dispatch
// layout's order) either way:
//   one hop   all_to_all_v over the expert-parallel group;
//   two hops  with nodes of G ranks (§3.2.2): first to the rank with the same in-node index on
//             every node that holds one of the token's experts (over `rail`, the ranks with this
//             in-node index, by node: the cross-node link), then within that node to each rank
//             holding one (over `node`, this node's ranks by in-node index: NVLink).
class DispatchRoute {
 public:
  // idx [T, k] (host) global expert ids of this rank's tokens; P = ep.size() ranks of epr experts.
  // rail and node null: one hop. Collective over the expert-parallel group (rail and node too).
  DispatchRoute(Backend& be, Comm& ep, Comm* rail, Comm* node, const int32_t* idx, int64_t tokens, int64_t topk,
                int64_t experts_per_rank);
  // rows [T, C] of this rank's tokens -> [received, C]: the rows that reach this rank.
  Tensor carry(Backend& be, const Tensor& rows) const;
  int64_t received() const { return received_; }
  const std::vector<int64_t>& recv_counts() const { return recv_counts_; }  // per source rank
  // Rows this rank sent over a link between nodes (the first hop, to another node) and within a
  // node (the second hop, to another rank); one hop: all to other ranks counted as within.
  int64_t cross_node_rows() const { return cross_rows_; }
  int64_t in_node_rows() const { return in_rows_; }

 private:
  static Hop make_hop(Backend& be, Comm& comm, int64_t rows, const int32_t* ids, int64_t stride, int64_t topk,
                      const std::function<int64_t(int32_t)>& peer_of, int64_t& other);
  std::vector<Hop> hops_;
  std::vector<int32_t> order_;  // two hops: the received rows into (source, token) order
  Tensor order_dev_;
  std::vector<int64_t> recv_counts_;
  int64_t received_ = 0, cross_rows_ = 0, in_rows_ = 0;
};

// How the combine's rows travel back from the expert ranks to their sources, mirroring the
// dispatch (§3.2.2), arriving at the source ordered by expert rank (the one-hop order) either way:
//   one hop   all_to_all_v over the expert-parallel group;
//   two hops  first inside the expert's node to the rank with the source's in-node index (over
//             `node`: NVLink), which forwards them across nodes to the source (over `rail`: the
//             cross-node link).
// The rows travel one per (token, expert) slot, unsummed: the source adds a token's k rows in
// slot order with moe_combine's roundings, so partial sums at the relay (one row per token and
// node) would change the bits.
class CombineRoute {
 public:
  // send[s]: rows this rank returns to source s (the rows given to carry are source-major);
  // recv[d]: rows this rank gets back from expert rank d. rail and node null: one hop.
  // Collective over the expert-parallel group (rail and node too).
  CombineRoute(Backend& be, Comm& ep, Comm* rail, Comm* node, std::vector<int64_t> send, std::vector<int64_t> recv);
  // rows [sum send, C] converted to `dtype` -> [sum recv, C] of `dtype`, expert-rank-major.
  Tensor carry(Backend& be, const Tensor& rows, DType dtype) const;
  // Rows this rank sends per carry over a link between nodes (the second hop, as the relay) and
  // within a node (the first hop, to another rank); one hop: all to other ranks counted as within.
  int64_t cross_node_rows() const { return cross_rows_; }
  int64_t in_node_rows() const { return in_rows_; }

 private:
  Comm& ep_;
  std::vector<int64_t> send_, recv_;
  std::vector<Hop> hops_;  // two hops only
  int64_t cross_rows_ = 0, in_rows_ = 0;
};

// recv_counts[q] = the send_counts[me] of rank q (host exchange of the counts).
std::vector<int64_t> transposed_counts(Comm& comm, const std::vector<int64_t>& send_counts);

// x [T, D] f32 (D % 128 == 0) quantized to 1x128 E4M3 tiles with `mode` scales, one quantization per
// token, the values and the per-token scales carried by the route; returns what reached this rank,
// dequantized: [received, D] f32 in the route's order (exact: codes times the scales).
Tensor dispatch_fp8(Backend& be, const DispatchRoute& route, const Tensor& x, ScaleMode mode);

// rows [sum send_counts, C] f32 converted to `dtype` (bf16: the combine; f32) and exchanged;
// returns [sum recv_counts, C] of `dtype`, source-major.
Tensor exchange_rows(Backend& be, Comm& comm, const Tensor& rows, const std::vector<int64_t>& send_counts,
                     const std::vector<int64_t>& recv_counts, DType dtype);

// n rows of `cols` (allocated with at least one row: an empty exchange still has a buffer).
Tensor rows_tensor(Backend& be, DType dt, int64_t n, int64_t cols);
int64_t total(const std::vector<int64_t>& counts);

}  // namespace fp8moe::ep
