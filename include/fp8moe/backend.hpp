// The backend interface: every op the model, the trainer and the parallel code run, implemented
// once per device. The CPU backend (src/cpu) is the executable specification; the CUDA backend
// (src/cuda) is tested against it op by op. Tensors passed to a backend live on its device.
// As in ggml, `supports(op)` lets a test or a caller report "unsupported" instead of failing.
// Op contracts (shapes, dtypes, layouts, errors) are those of quantize.hpp and gemm_ref.hpp.
#pragma once
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/gemm_ref.hpp"
#include "fp8moe/quantize.hpp"

namespace fp8moe {

enum class Op : uint8_t {
  quantize_1x128,
  quantize_128x128,
  quantize_128x1,
  requantize_128x1,
  dequantize,
  gemm_fp8,
  gemm_bf16,
};
std::string_view op_name(Op op);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  virtual bool supports(Op op) const = 0;

  // Memory: a zero-filled tensor on this backend's device; copies between any two devices.
  virtual Tensor empty(DType dtype, std::initializer_list<int64_t> shape) = 0;
  virtual void copy(const TensorView& dst, const TensorView& src) = 0;
  virtual void synchronize() {}
  QuantizedTensor empty_quantized(int64_t rows, int64_t cols, DType dtype, ScaleKind kind);
  // A host copy of `t` (or `t` itself when it is already on the host).
  Tensor to_host(const Tensor& t);

  virtual void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode mode) = 0;
  virtual void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode mode) = 0;
  virtual void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode mode) = 0;
  virtual void requantize_128x1(const QuantizedView& in, const QuantizedView& out, ScaleMode mode) = 0;
  virtual void dequantize(const QuantizedView& in, const TensorView& out) = 0;
  virtual void gemm_fp8(const QuantizedView& a, const QuantizedView& b, const TensorView& d,
                        const GemmOptions& opt) = 0;
  // D [M, N] f32 | bf16 = A [M, K] bf16 * B [N, K]^T bf16 (+ D when accumulate).
  virtual void gemm_bf16(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate) = 0;
};

// "cpu" or "cuda" (the CUDA backend exists when built with CUDA and a GPU is present).
std::unique_ptr<Backend> make_backend(std::string_view name);
std::vector<std::string> available_backends();
// "cuda" when a GPU is usable, else "cpu".
std::string default_backend_name();

}  // namespace fp8moe
