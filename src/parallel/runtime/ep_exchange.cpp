// The expert-parallel exchanges (ep_exchange.hpp).
#include "ep_exchange.hpp"

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

Tensor dispatch_fp8(Backend& be, Comm& comm, const Tensor& x, const Tensor& send_token,
                    const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts, ScaleMode mode) {
  const int64_t T = x.size(0), D = x.size(1), G = D / 128, ns = send_token.size(0), nr = total(recv_counts);
  FP8MOE_CHECK(D % 128 == 0, "dispatch_fp8: x " << x.view().str() << " needs D % 128 == 0 (1x128 tiles)");
  FP8MOE_CHECK(total(send_counts) == ns, "dispatch_fp8: send_counts sum to " << total(send_counts) << ", send_token has "
                                                                             << ns << " rows");
  // Sender: one quantization per token; the scales token-major [ld(T), G] to travel by row.
  QuantizedTensor q = be.empty_quantized(T, D, DType::e4m3, ScaleKind::tile_1x128);  // scales [G, ld(T)]
  be.quantize_1x128(x.view(), q, mode);
  Tensor by_token = be.empty(DType::f32, {scale_ld(T), G});
  be.transpose(q.scales.view(), by_token.view());
  Tensor sv = rows_tensor(be, DType::e4m3, ns, D), ss = rows_tensor(be, DType::f32, ns, G);  // [ns, D], [ns, G]
  if (ns > 0) {
    be.gather_rows(q.values.view(), send_token.view(), TensorView(), sv.view());
    be.gather_rows(by_token.view(), send_token.view(), TensorView(), ss.view());
  }
  // Receiver: values [nr, D], scales [ld(nr), G] token-major (the rows past nr: the quantized
  // layout's padding, 1).
  const int64_t ld = scale_ld(std::max<int64_t>(nr, 1));
  Tensor rv = rows_tensor(be, DType::e4m3, nr, D), rs = be.empty(DType::f32, {ld, G});
  comm.all_to_all_v(sv.view(), send_counts, rv.view(), recv_counts, be.stream());
  comm.all_to_all_v(ss.view(), send_counts, rows(rs, 0, nr).view(), recv_counts, be.stream());
  Tensor out = rows_tensor(be, x.dtype(), nr, D);
  if (nr == 0) return out;
  if (ld > nr) {
    Tensor ones = Tensor::host(DType::f32, {ld - nr, G});
    for (int64_t i = 0; i < ones.numel(); ++i) ones.ptr<float>()[i] = 1.0f;
    be.copy(rows(rs, nr, ld - nr).view(), ones.view());
  }
  Tensor scales = be.empty(DType::f32, {G, ld});  // [G, ld(nr)] group-major, as the quantizers write
  be.transpose(rs.view(), scales.view());
  be.dequantize(QuantizedView{rv.view(), scales.view(), ScaleKind::tile_1x128}, out.view());
  return out;
}

Tensor exchange_rows(Backend& be, Comm& comm, const Tensor& r, const std::vector<int64_t>& send_counts,
                     const std::vector<int64_t>& recv_counts, DType dtype) {
  const int64_t n = total(send_counts), C = r.size(1);
  FP8MOE_CHECK(r.size(0) == n, "exchange_rows: " << r.view().str() << " for " << n << " rows to send");
  Tensor send = r;
  if (dtype != r.dtype()) {
    send = rows_tensor(be, dtype, n, C);
    if (n > 0) be.convert(r.view(), send.view());
  }
  Tensor back = rows_tensor(be, dtype, total(recv_counts), C);
  comm.all_to_all_v(send.view(), send_counts, back.view(), recv_counts, be.stream());
  return back;
}

}  // namespace fp8moe::ep
