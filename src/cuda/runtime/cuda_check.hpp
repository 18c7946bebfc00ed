// Return-code checks for the CUDA runtime, driver and cuBLASLt, and cached device properties.
// Every failing call throws fp8moe::Error naming the call, the error and the source line.
#pragma once
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "fp8moe/error.hpp"

namespace fp8moe::cuda {

[[noreturn]] void throw_cuda_error(const char* call, const char* what, const char* file, int line);

// Properties of the current device (queried once per device).
const cudaDeviceProp& device_props();

// A pointer on a 16-byte boundary (vector loads and stores, TMA).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace fp8moe::cuda

#define FP8MOE_CUDA_CHECK(call)                                                              \
  do {                                                                                       \
    cudaError_t fp8moe_e_ = (call);                                                          \
    if (fp8moe_e_ != cudaSuccess)                                                            \
      ::fp8moe::cuda::throw_cuda_error(#call, cudaGetErrorString(fp8moe_e_), __FILE__, __LINE__); \
  } while (0)

#define FP8MOE_CUBLAS_CHECK(call)                                                              \
  do {                                                                                         \
    cublasStatus_t fp8moe_s_ = (call);                                                         \
    if (fp8moe_s_ != CUBLAS_STATUS_SUCCESS)                                                    \
      ::fp8moe::cuda::throw_cuda_error(#call, cublasLtGetStatusString(fp8moe_s_), __FILE__, __LINE__); \
  } while (0)

// Checks the launch just made (configuration errors); asynchronous faults surface at the next
// synchronizing call.
#define FP8MOE_CUDA_CHECK_LAUNCH(name) FP8MOE_CUDA_CHECK(cudaGetLastError())
