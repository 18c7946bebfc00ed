// Backend registry: builds a backend by name, and the shared helpers of the Backend class.
#include "cpu/cpu_backend.hpp"
#include "fp8moe/backend.hpp"
#ifdef FP8MOE_HAVE_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace fp8moe {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::quantize_1x128: return "quantize_1x128";
    case Op::quantize_128x128: return "quantize_128x128";
    case Op::quantize_128x1: return "quantize_128x1";
    case Op::requantize_128x1: return "requantize_128x1";
    case Op::dequantize: return "dequantize";
    case Op::gemm_fp8: return "gemm_fp8";
    case Op::gemm_bf16: return "gemm_bf16";
  }
  return "?";
}

QuantizedTensor Backend::empty_quantized(int64_t rows, int64_t cols, DType dtype, ScaleKind kind) {
  auto ss = scale_shape(kind, rows, cols);
  return {empty(dtype, {rows, cols}), empty(DType::f32, {ss[0], ss[1]}), kind};
}

Tensor Backend::to_host(const Tensor& t) {
  if (t.device() == Device::cpu) return t;
  Tensor h = Tensor::host_like(t.view());
  copy(h.view(), t.view());
  synchronize();
  return h;
}

std::unique_ptr<Backend> make_backend(std::string_view name) {
  if (name == "cpu") return make_cpu_backend();
#ifdef FP8MOE_HAVE_CUDA
  if (name == "cuda") {
    FP8MOE_CHECK(cuda_device_available(), "backend 'cuda': no usable CUDA device");
    return make_cuda_backend();
  }
#endif
  FP8MOE_CHECK(false, "unknown or unavailable backend '" << name << "' (available: "
                          << [] {
                               std::string s;
                               for (auto& b : available_backends()) s += (s.empty() ? "" : ", ") + b;
                               return s;
                             }() << ")");
}

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"cpu"};
#ifdef FP8MOE_HAVE_CUDA
  if (cuda_device_available()) names.push_back("cuda");
#endif
  return names;
}

std::string default_backend_name() { return available_backends().back(); }

}  // namespace fp8moe
