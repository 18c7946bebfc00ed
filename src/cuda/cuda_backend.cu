// CudaBackend: the Backend interface on one NVIDIA GPU (see cuda_backend.hpp). Argument checks and
// kernels live in kernel_api.hpp's functions; this class owns memory and routes ops.
#include "cuda_backend.hpp"

#include <cuda_runtime.h>

#include "cuda_check.hpp"
#include "kernel_api.hpp"

namespace fp8moe {

bool cuda_device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return false;
  }
  return n > 0;
}

namespace {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(bool gemm_via_cublaslt) : cublaslt_(gemm_via_cublaslt) {
    FP8MOE_CUDA_CHECK(cudaFree(nullptr));  // create the context now, not inside the first timed call
  }

  std::string name() const override { return cublaslt_ ? "cublaslt" : "cuda"; }
  Device device() const override { return Device::cuda; }
  bool supports(Op) const override { return true; }

  Tensor empty(DType dtype, std::initializer_list<int64_t> shape) override {
    int64_t n = 1;
    for (int64_t s : shape) {
      FP8MOE_CHECK(s >= 0, "empty: negative dimension " << s);
      n *= s;
    }
    const size_t bytes = size_t(n) * dtype_size(dtype);
    void* p = nullptr;
    if (bytes > 0) {
      FP8MOE_CUDA_CHECK(cudaMalloc(&p, bytes));
      const cudaError_t e = cudaMemset(p, 0, bytes);
      if (e != cudaSuccess) cudaFree(p);
      FP8MOE_CUDA_CHECK(e);
    }
    std::shared_ptr<void> storage(p, [](void* q) {
      if (q) cudaFree(q);
    });
    return Tensor(std::move(storage), dtype, shape, Device::cuda);
  }

  void copy(const TensorView& dst, const TensorView& src) override {
    FP8MOE_CHECK(dst.nbytes() == src.nbytes() && dst.dtype == src.dtype,
                 "copy: dst " << dst.str() << " and src " << src.str() << " differ in dtype or size");
    FP8MOE_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy: dst and src must be contiguous");
    if (src.nbytes() == 0) return;
    FP8MOE_CUDA_CHECK(cudaMemcpy(dst.data, src.data, src.nbytes(), cudaMemcpyDefault));
  }

  void synchronize() override { FP8MOE_CUDA_CHECK(cudaDeviceSynchronize()); }

  void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode mode) override {
    cuda::quantize_1x128_cuda(x, out, mode, nullptr, /*check_finite=*/true);
  }
  void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode mode) override {
    cuda::quantize_128x128_cuda(w, out, mode, nullptr, true);
  }
  void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode mode) override {
    cuda::quantize_128x1_cuda(x, out, mode, nullptr, true);
  }
  void requantize_128x1(const QuantizedView& in, const QuantizedView& out, ScaleMode mode) override {
    cuda::requantize_128x1_cuda(in, out, mode, nullptr);
  }
  void dequantize(const QuantizedView& in, const TensorView& out) override { cuda::dequantize_cuda(in, out, nullptr); }

  void gemm_fp8(const QuantizedView& a, const QuantizedView& b, const TensorView& d, const GemmOptions& opt) override {
    // The hardware accumulates each 128-wide K block in the Tensor Cores and promotes to FP32:
    // AccumMode::fp32 (ideal promotion) up to Tensor Core rounding inside a block, and exactly the
    // tensor_core emulation's N_c = 128. Other accumulation settings exist only in the emulation.
    const AccumConfig& ac = opt.accum;
    FP8MOE_CHECK(ac.mode == AccumMode::fp32 || ac.promote_every == 128,
                 "gemm_fp8 on " << name() << ": accum.promote_every = " << ac.promote_every
                                << " unsupported (the kernels promote every 128 K elements; use the cpu backend's emulation)");
    if (cublaslt_ || !cuda::sm90_available())
      cuda::gemm_fp8_cublaslt(a, b, d, opt.accumulate, nullptr);
    else
      cuda::gemm_fp8_sm90(a, b, d, opt.accumulate, nullptr);
  }

  void gemm_bf16(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate) override {
    cuda::gemm_bf16_cublaslt(a, b, d, accumulate, nullptr);
  }

 private:
  bool cublaslt_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(false); }
std::unique_ptr<Backend> make_cublaslt_backend() { return std::make_unique<CudaBackend>(true); }

}  // namespace fp8moe
