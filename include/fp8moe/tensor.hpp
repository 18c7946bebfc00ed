// Tensor views and owning tensors.
// A TensorView is a non-owning (pointer, dtype, device, shape, strides) of up to 4 dimensions,
// strides in elements, row-major by default. A Tensor owns its storage (host or device memory,
// allocated by a Backend) and hands out views. Kernels and ops take views; model code keeps Tensors.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>

#include "fp8moe/dtype.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {

constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements

  TensorView() = default;
  TensorView(void* p, DType t, std::initializer_list<int64_t> dims, Device dev = Device::cpu);

  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t numel() const;
  size_t nbytes() const { return dtype_bytes(dtype, numel()); }  // contiguous storage
  bool is_contiguous() const;
  bool defined() const { return data != nullptr; }
  template <class T> T* ptr() const { return static_cast<T*>(data); }
  std::string str() const;  // "[M, K] e4m3 cpu" for messages
};

// The same elements of a contiguous view in another shape (the same count); Error otherwise.
TensorView reshape(const TensorView& t, std::initializer_list<int64_t> shape);

// Argument checks shared by every op. Each throws fp8moe::Error naming `arg`.
void check_tensor(const TensorView& t, const char* arg, DType dtype, int ndim);
void check_tensor(const TensorView& t, const char* arg, std::initializer_list<DType> dtypes, int ndim);
void check_shape(const TensorView& t, const char* arg, std::initializer_list<int64_t> shape);
// Backend::copy_cols's shapes: 2-D src and dst with the same rows, columns [src_col, src_col +
// ncols) of src and [dst_col, dst_col + ncols) of dst existing; messages start "copy_cols: ".
void check_copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col, int64_t ncols);
// Backend::mla_split_kv's shapes (kv and ckv, or dkv and dckv, with k and v or dk and dv):
// {T, H, dn, dr, dv}; messages start with `op`.
std::array<int64_t, 5> check_mla_split_kv(const char* op, const TensorView& kv, const TensorView& ckv, int64_t pe_col,
                                          const TensorView& k, const TensorView& v);

class Tensor {
 public:
  Tensor() = default;
  // Takes ownership of `storage` (freed by its deleter) holding a contiguous tensor.
  Tensor(std::shared_ptr<void> storage, DType t, std::initializer_list<int64_t> dims, Device dev);
  // Takes ownership of `storage` holding the contiguous tensor described by `view` (view.data is
  // replaced by storage.get()).
  Tensor(std::shared_ptr<void> storage, TensorView view);
  // Host tensor, zero-initialized.
  static Tensor host(DType t, std::initializer_list<int64_t> dims);
  // Contiguous zero-initialized host tensor with the dtype and shape of `like`.
  static Tensor host_like(const TensorView& like);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  template <class T> T* ptr() const { return view_.ptr<T>(); }
  int64_t size(int d) const { return view_.size(d); }
  int64_t numel() const { return view_.numel(); }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  bool defined() const { return view_.defined(); }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace fp8moe
