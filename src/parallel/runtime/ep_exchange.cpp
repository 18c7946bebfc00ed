// The expert-parallel exchanges (ep_exchange.hpp).
#include "ep_exchange.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "fp8moe/error.hpp"

namespace fp8moe::ep {

namespace {

// Rows [r0, r0 + n) of a contiguous tensor, sharing its storage.
Tensor rows(const Tensor& t, int64_t r0, int64_t n) {
  TensorView v = t.view();
  FP8MOE_CHECK(r0 >= 0 && r0 + n <= v.size(0), "rows [" << r0 << ", " << r0 + n << ") outside " << v.str());
  v.data = static_cast<char*>(v.data) + r0 * v.strides[0] * int64_t(dtype_size(v.dtype));
  v.shape[0] = n;
  auto keep = std::make_shared<Tensor>(t);
  return Tensor(std::shared_ptr<void>(keep, v.data), v);
}

// t [n, 1] seen as [n].
Tensor model_flat(const Tensor& t) {
  TensorView v = t.view();
  TensorView f(v.data, v.dtype, {v.numel()}, v.device);
  return Tensor(std::shared_ptr<void>(std::make_shared<Tensor>(t), f.data), f);
}

}  // namespace

int64_t total(const std::vector<int64_t>& counts) {
  int64_t s = 0;
  for (int64_t x : counts) s += x;
  return s;
}

Tensor rows_tensor(Backend& be, DType dt, int64_t n, int64_t cols) {
  return rows(be.empty(dt, {std::max<int64_t>(n, 1), cols}), 0, n);
}

std::vector<int64_t> transposed_counts(Comm& comm, const std::vector<int64_t>& send) {
  FP8MOE_CHECK(int64_t(send.size()) == comm.size(), "transposed_counts: " << send.size() << " counts for "
                                                                         << comm.size() << " ranks");
  const std::string mine(reinterpret_cast<const char*>(send.data()), send.size() * sizeof(int64_t));
  const std::vector<std::string> all = comm.exchange(mine);
  std::vector<int64_t> recv(all.size());
  for (size_t q = 0; q < all.size(); ++q) {
    FP8MOE_CHECK(all[q].size() == send.size() * sizeof(int64_t), "transposed_counts: rank " << q << " sent "
                                                                     << all[q].size() << " bytes of counts");
    std::memcpy(&recv[q], all[q].data() + size_t(comm.rank()) * sizeof(int64_t), sizeof(int64_t));
  }
  return recv;
}

namespace {

Tensor i32_rows(Backend& be, const std::vector<int32_t>& v, int64_t n, int64_t cols) {
  Tensor h = Tensor::host(DType::i32, {std::max<int64_t>(n, 1), cols});
  if (!v.empty()) std::memcpy(h.view().data, v.data(), v.size() * sizeof(int32_t));
  Tensor d = be.empty(DType::i32, {std::max<int64_t>(n, 1), cols});
  be.copy(d.view(), h.view());
  return rows(d, 0, n);
}

// The previous stage's rows [gather] exchanged over one hop.
Tensor hop_carry(Backend& be, const Hop& h, const Tensor& stage) {
  const int64_t n = h.gather_dev.size(0), C = stage.size(1);
  Tensor out = rows_tensor(be, stage.dtype(), n, C);
  if (n > 0) be.gather_rows(stage.view(), model_flat(h.gather_dev).view(), TensorView(), out.view());
  Tensor got = rows_tensor(be, stage.dtype(), total(h.recv), C);
  h.comm->all_to_all_v(out.view(), h.send, got.view(), h.recv, be.stream());
  return got;
}

// A hop whose send order is the given row order (gather), counts known on both sides.
Hop counted_hop(Backend& be, Comm& comm, std::vector<int32_t> gather, std::vector<int64_t> send,
                std::vector<int64_t> recv) {
  Hop h;
  h.comm = &comm;
  h.gather = std::move(gather);
  h.send = std::move(send);
  h.recv = std::move(recv);
  h.gather_dev = i32_rows(be, h.gather, int64_t(h.gather.size()), 1);
  return h;
}

// Rows of the blocks `order` of a layout of consecutive blocks of `sizes` rows, in that order.
std::vector<int32_t> block_rows(const std::vector<int64_t>& sizes, const std::vector<size_t>& order) {
  std::vector<int64_t> start(sizes.size() + 1, 0);
  for (size_t b = 0; b < sizes.size(); ++b) start[b + 1] = start[b] + sizes[b];
  std::vector<int32_t> rows;
  for (size_t b : order)
    for (int64_t i = start[b]; i < start[b + 1]; ++i) rows.push_back(int32_t(i));
  return rows;
}

}  // namespace

Hop DispatchRoute::make_hop(Backend& be, Comm& comm, int64_t rows, const int32_t* ids, int64_t stride, int64_t K,
                             const std::function<int64_t(int32_t)>& peer_of, int64_t& other) {
  // Row i goes to every peer holding one of its experts ids[i * stride + j], peer-major, rows
  // ascending; `other` counts the rows to peers other than this rank.
  std::vector<int32_t> gather;
  std::vector<int64_t> send(size_t(comm.size()), 0);
  for (int64_t d = 0; d < comm.size(); ++d)
    for (int64_t i = 0; i < rows; ++i) {
      bool here = false;
      for (int64_t j = 0; j < K; ++j) here |= peer_of(ids[i * stride + j]) == d;
      if (!here) continue;
      gather.push_back(int32_t(i));
      ++send[size_t(d)];
      if (d != comm.rank()) ++other;
    }
  std::vector<int64_t> recv = transposed_counts(comm, send);
  return counted_hop(be, comm, std::move(gather), std::move(send), std::move(recv));
}

DispatchRoute::DispatchRoute(Backend& be, Comm& ep, Comm* rail, Comm* node, const int32_t* idx, int64_t T, int64_t K,
                             int64_t epr) {
  FP8MOE_CHECK((rail == nullptr) == (node == nullptr), "DispatchRoute: rail and node communicators go together");
  const int64_t P = ep.size(), me = ep.rank();
  if (!rail) {  // one hop
    hops_.push_back(make_hop(be, ep, T, idx, K, K, [&](int32_t e) { return int64_t(e) / epr; }, in_rows_));
    recv_counts_ = hops_[0].recv;
    received_ = total(recv_counts_);
    return;
  }
  const int64_t G = node->size(), N = rail->size(), my_node = me / G, my_local = me % G;
  FP8MOE_CHECK(G * N == P && node->rank() == my_local && rail->rank() == my_node,
               "DispatchRoute: rank " << me << " of " << P << " is not " << my_local << " of a node of " << node->size()
                                      << " and node " << my_node << " of " << rail->size());
  // Hop 1: each token once to every node holding one of its experts, at this in-node index.
  hops_.push_back(make_hop(be, *rail, T, idx, K, K, [&](int32_t e) { return int64_t(e) / epr / G; }, cross_rows_));
  const Hop& h1 = hops_[0];
  // The rows carry (source rank, token, expert ids) for the relay and the receiver.
  std::vector<int32_t> meta;
  for (int64_t t = 0; t < T; ++t) {
    meta.insert(meta.end(), {int32_t(me), int32_t(t)});
    meta.insert(meta.end(), idx + t * K, idx + (t + 1) * K);
  }
  const Tensor d1 = hop_carry(be, h1, i32_rows(be, meta, T, 2 + K));
  const Tensor m1 = be.to_host(d1);
  // Hop 2: the relayed rows to each rank of this node holding one of their experts.
  hops_.push_back(make_hop(be, *node, m1.size(0), m1.ptr<int32_t>() + 2, 2 + K, K,
                           [&](int32_t e) { return int64_t(e) / epr - my_node * G; }, in_rows_));
  const Hop& h2 = hops_[1];
  const Tensor m2 = be.to_host(hop_carry(be, h2, d1));
  received_ = m2.size(0);
  const int32_t* r2 = m2.ptr<int32_t>();
  // Into (source, token) order: the one-hop order.
  order_.resize(size_t(received_));
  for (int64_t i = 0; i < received_; ++i) order_[size_t(i)] = int32_t(i);
  std::sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
    return std::pair(r2[a * (2 + K)], r2[a * (2 + K) + 1]) < std::pair(r2[b * (2 + K)], r2[b * (2 + K) + 1]);
  });
  recv_counts_.assign(size_t(P), 0);
  for (int64_t i = 0; i < received_; ++i) ++recv_counts_[size_t(r2[i * (2 + K)])];
  order_dev_ = i32_rows(be, order_, received_, 1);
}

Tensor DispatchRoute::carry(Backend& be, const Tensor& x) const {
  Tensor stage = x;
  for (const Hop& h : hops_) stage = hop_carry(be, h, stage);
  if (order_.empty()) return stage;
  Tensor out = rows_tensor(be, stage.dtype(), received_, stage.size(1));
  be.gather_rows(stage.view(), model_flat(order_dev_).view(), TensorView(), out.view());
  return out;
}

Tensor dispatch_fp8(Backend& be, const DispatchRoute& route, const Tensor& x, ScaleMode mode) {
  const int64_t T = x.size(0), D = x.size(1), G = D / 128, nr = route.received();
  FP8MOE_CHECK(D % 128 == 0, "dispatch_fp8: x " << x.view().str() << " needs D % 128 == 0 (1x128 tiles)");
  // One quantization per token; the scales token-major [ld(T), G] to travel by row.
  QuantizedTensor q = be.empty_quantized(T, D, DType::e4m3, ScaleKind::tile_1x128);  // scales [G, ld(T)]
  be.quantize_1x128(x.view(), q, mode);
  Tensor by_token = be.empty(DType::f32, {scale_ld(T), G});
  be.transpose(q.scales.view(), by_token.view());
  const Tensor rv = route.carry(be, q.values);                     // [nr, D] e4m3
  const Tensor rs = route.carry(be, rows(by_token, 0, T));         // [nr, G] f32
  Tensor out = rows_tensor(be, x.dtype(), nr, D);
  if (nr == 0) return out;
  // The quantized layout wants [G, ld(nr)] group-major; the rows past nr are its padding, 1.
  const int64_t ld = scale_ld(nr);
  Tensor padded = be.empty(DType::f32, {ld, G});
  be.copy(rows(padded, 0, nr).view(), rs.view());
  if (ld > nr) {
    Tensor ones = Tensor::host(DType::f32, {ld - nr, G});
    for (int64_t i = 0; i < ones.numel(); ++i) ones.ptr<float>()[i] = 1.0f;
    be.copy(rows(padded, nr, ld - nr).view(), ones.view());
  }
  Tensor scales = be.empty(DType::f32, {G, ld});
  be.transpose(padded.view(), scales.view());
  be.dequantize(QuantizedView{rv.view(), scales.view(), ScaleKind::tile_1x128}, out.view());
  return out;
}

CombineRoute::CombineRoute(Backend& be, Comm& ep, Comm* rail, Comm* node, std::vector<int64_t> send,
                           std::vector<int64_t> recv)
    : ep_(ep), send_(std::move(send)), recv_(std::move(recv)) {
  FP8MOE_CHECK((rail == nullptr) == (node == nullptr), "CombineRoute: rail and node communicators go together");
  const int64_t P = ep.size(), me = ep.rank();
  FP8MOE_CHECK(int64_t(send_.size()) == P && int64_t(recv_.size()) == P,
               "CombineRoute: " << send_.size() << " send and " << recv_.size() << " receive counts for " << P << " ranks");
  if (!rail) {  // one hop
    for (int64_t s = 0; s < P; ++s)
      if (s != me) in_rows_ += send_[size_t(s)];
    return;
  }
  const int64_t G = node->size(), N = rail->size(), my_node = me / G, my_local = me % G;
  FP8MOE_CHECK(G * N == P && node->rank() == my_local && rail->rank() == my_node,
               "CombineRoute: rank " << me << " of " << P << " is not " << my_local << " of a node of " << node->size()
                                     << " and node " << my_node << " of " << rail->size());
  auto rank_of = [&](int64_t n, int64_t l) { return size_t(n * G + l); };
  // Hop 1, inside the node: to in-node index l the rows for the sources n * G + l, by node n.
  std::vector<size_t> order;
  std::vector<int64_t> send1(size_t(G), 0);
  for (int64_t l = 0; l < G; ++l)
    for (int64_t n = 0; n < N; ++n) {
      order.push_back(rank_of(n, l));
      send1[size_t(l)] += send_[rank_of(n, l)];
      if (l != my_local) in_rows_ += send_[rank_of(n, l)];
    }
  // What each rank of this node returns to each source: this rank relays those of its in-node index.
  const std::string mine(reinterpret_cast<const char*>(send_.data()), send_.size() * sizeof(int64_t));
  const std::vector<std::string> all = node->exchange(mine);
  std::vector<int64_t> block(size_t(G * N));  // [d, n]: rows rank d of this node returns to source (n, my_local)
  std::vector<int64_t> recv1(size_t(G), 0), send2(size_t(N), 0);
  for (int64_t d = 0; d < G; ++d) {
    FP8MOE_CHECK(all[size_t(d)].size() == mine.size(), "CombineRoute: in-node rank " << d << " sent "
                                                            << all[size_t(d)].size() << " bytes of counts");
    const auto* c = reinterpret_cast<const int64_t*>(all[size_t(d)].data());
    for (int64_t n = 0; n < N; ++n) {
      block[size_t(d * N + n)] = c[rank_of(n, my_local)];
      recv1[size_t(d)] += block[size_t(d * N + n)];
      send2[size_t(n)] += block[size_t(d * N + n)];
    }
  }
  hops_.push_back(counted_hop(be, *node, block_rows(send_, order), std::move(send1), std::move(recv1)));
  // Hop 2, across nodes: to node n its source's rows from every rank d of this node, by d; they
  // arrive at the source node-major, then by in-node rank: expert-rank-major, as one hop delivers.
  order.clear();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t d = 0; d < G; ++d) order.push_back(size_t(d * N + n));
    if (n != my_node) cross_rows_ += send2[size_t(n)];
  }
  std::vector<int64_t> recv2(size_t(N), 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t l = 0; l < G; ++l) recv2[size_t(n)] += recv_[rank_of(n, l)];
  hops_.push_back(counted_hop(be, *rail, block_rows(block, order), std::move(send2), std::move(recv2)));
}

namespace {

// The n rows to send, r converted to `dtype` (r itself when it has it).
Tensor to_send(Backend& be, const Tensor& r, int64_t n, DType dtype, const char* what) {
  FP8MOE_CHECK(r.size(0) == n, what << ": " << r.view().str() << " for " << n << " rows to send");
  if (dtype == r.dtype()) return r;
  Tensor send = rows_tensor(be, dtype, n, r.size(1));
  if (n > 0) be.convert(r.view(), send.view());
  return send;
}

}  // namespace

Tensor CombineRoute::carry(Backend& be, const Tensor& rows, DType dtype) const {
  if (hops_.empty()) return exchange_rows(be, ep_, rows, send_, recv_, dtype);
  Tensor stage = to_send(be, rows, total(send_), dtype, "CombineRoute");
  for (const Hop& h : hops_) stage = hop_carry(be, h, stage);
  return stage;
}

Tensor exchange_rows(Backend& be, Comm& comm, const Tensor& r, const std::vector<int64_t>& send_counts,
                     const std::vector<int64_t>& recv_counts, DType dtype) {
  const int64_t C = r.size(1);
  const Tensor send = to_send(be, r, total(send_counts), dtype, "exchange_rows");
  Tensor back = rows_tensor(be, dtype, total(recv_counts), C);
  comm.all_to_all_v(send.view(), send_counts, back.view(), recv_counts, be.stream());
  return back;
}

}  // namespace fp8moe::ep
