// Launchers of the expert-parallel kernels (ep_notify.cu, ep_dispatch.cu, ep_combine.cu,
// ep_low_latency.cu), called
// by ep_group.cpp after its argument checks.
#pragma once
#include <cuda_runtime.h>

#include "cuda/ep/ep_args.hpp"

namespace fp8moe::cuda::ep {

void launch_notify(const StepArgs& a, const int32_t* idx, cudaStream_t stream);
void launch_dispatch(const StepArgs& a, const uint8_t* x, const float* x_scales, int64_t x_ld, const float* weights,
                     const int32_t* idx, int32_t* slot_row, cudaStream_t stream);
// Over several nodes (StepArgs::ranks_per_node < ranks): ep_dispatch_two_hop.cu.
void launch_two_hop_dispatch(const StepArgs& a, const uint8_t* x, const float* x_scales, int64_t x_ld,
                             const float* weights, const int32_t* idx, int32_t* slot_row, cudaStream_t stream);
void launch_combine(const StepArgs& a, const void* rows, const int32_t* slot_row, const float* weights, float* out,
                    bool accumulate, cudaStream_t stream);
// For the residency check: the kernels' block sizes and entry points.
int dispatch_threads();
int combine_threads();
const void* dispatch_kernel_ptr(int blocks_per_sm);
const void* two_hop_dispatch_kernel_ptr(int blocks_per_sm);
const void* combine_kernel_ptr(int blocks_per_sm);

// Low-latency mode (ep_low_latency.cu). phases: kPhaseSend, kPhaseReceive or both (one launch).
constexpr int kPhaseSend = 1, kPhaseReceive = 2;
void launch_ll_dispatch(const LlArgs& a, const uint8_t* x, const float* x_scales, int64_t x_ld, const int32_t* idx,
                        int phases, cudaStream_t stream);
void launch_ll_combine(const LlArgs& a, const void* rows, const float* weights, float* out, bool accumulate,
                       int phases, cudaStream_t stream);
int ll_threads();
const void* ll_dispatch_kernel_ptr();
const void* ll_combine_kernel_ptr();

}  // namespace fp8moe::cuda::ep
