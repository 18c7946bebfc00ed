// Checks whose answer is computed on the device: index ranges of the model ops and NaN/Inf
// reaching a quantizer (Backend::set_checks).
//   immediate  each check reads its answer back (one host synchronization per op) and raises at once.
//   deferred   each check records its failure on the device and the op goes on (kernels never
//              write out of bounds on a bad index: they skip it); raise_deferred_checks(), called by
//              CudaBackend::synchronize(), reads the records and raises the first failure.
// NOTES: the mode and the records are per process, shared by every CUDA backend of it (the records
// live on the device the kernels run on; one device per process).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

namespace fp8moe::cuda {

bool checks_deferred();
void set_checks_deferred(bool deferred);

// Synchronizes the device, raises the first failed deferred check (in issue order) and clears all.
void raise_deferred_checks();

// The deferred checks recorded since the last raise, taken out of the process's list (a graph's
// capture), and put back (after each replay of that graph, whose kernels write the same records'
// slots). put_deferred_checks first raises any recorded since (so that the slots line up).
struct DeferredChecks;
std::shared_ptr<const DeferredChecks> take_deferred_checks();
void put_deferred_checks(const DeferredChecks& checks);

// A device flag a kernel sets to nonzero on failure (e.g. a quantizer's NaN/Inf flag, a __device__
// int of its translation unit). Immediate mode: clear_flag zeroes it before the kernel and
// raise_if_flag_set reads it back after (synchronizing) and raises "<what>: <message>". Deferred
// mode: both leave the flag alone, which raise_deferred_checks() reads (then zeroes) with message.
void clear_flag(int* flag, cudaStream_t stream);
void raise_if_flag_set(int* flag, cudaStream_t stream, const char* what, const char* message);

}  // namespace fp8moe::cuda
