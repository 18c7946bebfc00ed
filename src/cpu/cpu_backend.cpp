// CPU backend: forwards each op to the reference implementations in src/numerics, after checking
// that every tensor is in host memory.
#include "cpu_backend.hpp"

#include <cstring>

namespace fp8moe {

namespace {

void require_host(const TensorView& t, const char* arg) {
  FP8MOE_CHECK(t.device == Device::cpu, arg << ": the cpu backend needs host memory, got " << t.str());
}

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::cpu; }
  bool supports(Op) const override { return true; }

  Tensor empty(DType dtype, std::initializer_list<int64_t> shape) override { return Tensor::host(dtype, shape); }

  void copy(const TensorView& dst, const TensorView& src) override {
    require_host(dst, "dst");
    require_host(src, "src");
    FP8MOE_CHECK(dst.nbytes() == src.nbytes() && dst.dtype == src.dtype,
                 "copy: dst " << dst.str() << " and src " << src.str() << " differ in dtype or size");
    std::memcpy(dst.data, src.data, src.nbytes());
  }

  void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode mode) override {
    fp8moe::quantize_1x128(x, out, mode);
  }
  void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode mode) override {
    fp8moe::quantize_128x128(w, out, mode);
  }
  void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode mode) override {
    fp8moe::quantize_128x1(x, out, mode);
  }
  void requantize_128x1(const QuantizedView& in, const QuantizedView& out, ScaleMode mode) override {
    fp8moe::requantize_128x1(in, out, mode);
  }
  void dequantize(const QuantizedView& in, const TensorView& out) override {
    require_host(out, "out");
    fp8moe::dequantize(in, out);
  }
  void gemm_fp8(const QuantizedView& a, const QuantizedView& b, const TensorView& d,
                const GemmOptions& opt) override {
    gemm_fp8_ref(a, b, d, opt);
  }
  void gemm_bf16(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate) override {
    check_tensor(a, "a", DType::bf16, 2);
    check_tensor(b, "b", DType::bf16, 2);
    require_host(a, "a");
    require_host(b, "b");
    require_host(d, "d");
    gemm_ref(a, b, d, accumulate);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace fp8moe
