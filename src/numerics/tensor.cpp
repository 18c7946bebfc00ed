// TensorView / Tensor helpers and the argument checks every op uses.
#include "fp8moe/tensor.hpp"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <tuple>

namespace fp8moe {

TensorView::TensorView(void* p, DType t, std::initializer_list<int64_t> dims, Device dev)
    : data(p), dtype(t), device(dev), ndim(int(dims.size())) {
  FP8MOE_CHECK(ndim <= kMaxDims, "tensor has " << ndim << " dims, at most " << kMaxDims);
  int i = 0;
  for (int64_t d : dims) {
    FP8MOE_CHECK(d >= 0, "tensor dim " << i << " is negative (" << d << ")");
    shape[i++] = d;
  }
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = s;
    s *= shape[d];
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

std::string TensorView::str() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "] " << dtype_name(dtype) << " " << device_name(device);
  return os.str();
}

static void check_common(const TensorView& t, const char* arg, int ndim) {
  FP8MOE_CHECK(t.data != nullptr, arg << ": null data pointer");
  FP8MOE_CHECK(t.ndim == ndim, arg << ": expected " << ndim << " dims, got " << t.str());
  FP8MOE_CHECK(t.is_contiguous(), arg << ": expected a contiguous row-major tensor, got " << t.str());
}

void check_tensor(const TensorView& t, const char* arg, DType dtype, int ndim) {
  check_common(t, arg, ndim);
  FP8MOE_CHECK(t.dtype == dtype, arg << ": expected dtype " << dtype_name(dtype) << ", got " << t.str());
}

void check_tensor(const TensorView& t, const char* arg, std::initializer_list<DType> dtypes, int ndim) {
  check_common(t, arg, ndim);
  bool ok = false;
  std::string names;
  for (DType d : dtypes) {
    ok |= (t.dtype == d);
    names += (names.empty() ? "" : "|") + std::string(dtype_name(d));
  }
  FP8MOE_CHECK(ok, arg << ": expected dtype " << names << ", got " << t.str());
}

void check_shape(const TensorView& t, const char* arg, std::initializer_list<int64_t> shape) {
  bool ok = int(shape.size()) == t.ndim;
  int i = 0;
  std::ostringstream want;
  want << "[";
  for (int64_t d : shape) {
    want << (i ? ", " : "") << d;
    ok = ok && t.shape[i] == d;
    ++i;
  }
  want << "]";
  FP8MOE_CHECK(ok, arg << ": expected shape " << want.str() << ", got " << t.str());
}

TensorView reshape(const TensorView& t, std::initializer_list<int64_t> shape) {
  TensorView v(t.data, t.dtype, shape, t.device);
  FP8MOE_CHECK(v.numel() == t.numel() && t.is_contiguous(), "reshape: " << t.str() << " to " << v.str());
  return v;
}

void check_copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col, int64_t ncols) {
  FP8MOE_CHECK(src.size(0) == dst.size(0), "copy_cols: src " << src.str() << " and dst " << dst.str() << " differ in rows");
  for (const auto& [t, arg, col] : {std::tuple{&src, "src", src_col}, std::tuple{&dst, "dst", dst_col}})
    FP8MOE_CHECK(col >= 0 && ncols >= 0 && col + ncols <= t->size(1),
                 "copy_cols: columns [" << col << ", " << col + ncols << ") outside " << arg << " " << t->str());
}

std::array<int64_t, 5> check_mla_split_kv(const char* op, const TensorView& kv, const TensorView& ckv, int64_t pe_col,
                                          const TensorView& k, const TensorView& v) {
  FP8MOE_CHECK(k.ndim == 3 && v.ndim == 3 && kv.ndim == 2 && ckv.ndim == 2,
               op << ": expected k, v [T, H, *], kv and ckv [T, *]; got k " << k.str() << ", v " << v.str() << ", kv "
                  << kv.str() << ", ckv " << ckv.str());
  const int64_t T = k.size(0), H = k.size(1), dr = ckv.size(1) - pe_col, dn = k.size(2) - dr, dv = v.size(2);
  FP8MOE_CHECK(pe_col >= 0 && dr > 0 && dr % 2 == 0 && dn >= 0,
               op << ": the shared key ckv[:, " << pe_col << ":] of ckv " << ckv.str() << " must be an even number of columns "
                  << "no wider than k " << k.str());
  FP8MOE_CHECK(v.size(0) == T && v.size(1) == H && ckv.size(0) == T && kv.size(0) == T && kv.size(1) == H * (dn + dv),
               op << ": k " << k.str() << ", v " << v.str() << ", ckv " << ckv.str() << " and kv " << kv.str()
                  << " must be [T, H, dn + dr], [T, H, dv], [T, pe_col + dr] and [T, H * (dn + dv)]");
  return {T, H, dn, dr, dv};
}

Tensor::Tensor(std::shared_ptr<void> storage, DType t, std::initializer_list<int64_t> dims, Device dev)
    : storage_(std::move(storage)), view_(storage_.get(), t, dims, dev) {}

Tensor::Tensor(std::shared_ptr<void> storage, TensorView view) : storage_(std::move(storage)), view_(view) {
  view_.data = storage_.get();
}

Tensor Tensor::host(DType t, std::initializer_list<int64_t> dims) { return host_like(TensorView(nullptr, t, dims)); }

Tensor Tensor::host_like(const TensorView& like) {
  TensorView v = like;
  int64_t s = 1;  // contiguous strides
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = s;
    s *= v.shape[d];
  }
  v.device = Device::cpu;
  size_t bytes = std::max<size_t>(v.nbytes(), 1);
  // 64-byte alignment: vector loads and the alignment rules of the GPU copies.
  void* p = std::aligned_alloc(64, size_t(round_up(int64_t(bytes), 64)));
  FP8MOE_CHECK(p != nullptr, "host allocation of " << bytes << " bytes failed");
  std::memset(p, 0, bytes);
  return Tensor(std::shared_ptr<void>(p, std::free), v);
}

}  // namespace fp8moe
