// Error helpers and device property cache of the CUDA backend (see cuda_check.hpp).
#include "cuda/runtime/cuda_check.hpp"

#include <memory>
#include <mutex>
#include <vector>

namespace fp8moe::cuda {

void throw_cuda_error(const char* call, const char* what, const char* file, int line) {
  throw Error(std::string(call) + " failed: " + what + " (" + file + ":" + std::to_string(line) + ")");
}

const cudaDeviceProp& device_props() {
  static std::mutex mu;
  static std::vector<std::unique_ptr<cudaDeviceProp>> cache;
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (size_t(dev) >= cache.size()) cache.resize(size_t(dev) + 1);
  if (!cache[size_t(dev)]) {
    auto p = std::make_unique<cudaDeviceProp>();
    FP8MOE_CUDA_CHECK(cudaGetDeviceProperties(p.get(), dev));
    cache[size_t(dev)] = std::move(p);
  }
  return *cache[size_t(dev)];
}

}  // namespace fp8moe::cuda
