// The CUDA backends of fp8moe (registered by src/backends.cpp when built with CUDA):
//   "cuda"     our sm_90a kernels: FP8 block-scaled GEMM (gemm_fp8), quantizers; BF16 GEMM and
//              the non-Hopper fallback of gemm_fp8 go through cuBLASLt.
//   "cublaslt" the same backend with gemm_fp8 routed to cuBLASLt's block-scaled FP8 GEMM: the
//              vendor baseline the benchmarks compare against.
// Tensors come from the caching allocator (runtime/caching_allocator.hpp); ops run on the backend's
// current stream (its own compute stream unless set_stream says otherwise).
#pragma once
#include <functional>
#include <memory>

#include "fp8moe/backend.hpp"

namespace fp8moe {

// True when the CUDA runtime sees at least one usable device.
bool cuda_device_available();
// Our kernels.
std::unique_ptr<Backend> make_cuda_backend();
// gemm_fp8 through cuBLASLt (everything else as make_cuda_backend()).
std::unique_ptr<Backend> make_cublaslt_backend();
// fp8moe/free_hold.hpp on the caching allocator: hold_frees() until the handle goes.
std::shared_ptr<void> hold_cuda_frees();
// fp8moe/free_hold.hpp's set_aside_frees: `work` between begin_set_aside(stream) and end_set_aside().
std::shared_ptr<void> set_aside_cuda_frees(void* stream, const std::function<void()>& work);

}  // namespace fp8moe
