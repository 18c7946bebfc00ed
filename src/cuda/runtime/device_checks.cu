// Device-side checks, immediate or deferred (device_checks.hpp).
#include "cuda/runtime/device_checks.hpp"

#include <mutex>
#include <string>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

namespace {

constexpr int kRangeSlots = 1024;  // range checks recorded between two synchronizations

struct RangeRecord {
  std::string what;
  int64_t lo, hi;
};

struct FlagRecord {
  int* flag;
  std::string message;
};

struct State {
  std::mutex mu;
  bool deferred = false;
  unsigned long long* slots = nullptr;  // [kRangeSlots] first failing index, ~0 = none
  std::vector<RangeRecord> ranges;      // the records of slots[0..size)
  std::vector<FlagRecord> flags;        // flags armed since the last raise (deduplicated)
};

State& state() {
  static State s;
  return s;
}

__global__ void first_out_of_range_kernel(const int32_t* __restrict__ idx, int64_t n, int64_t lo, int64_t hi,
                                          unsigned long long* first) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t v = idx[i];
    if (v < lo || v >= hi) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

void launch_range(const int32_t* idx, int64_t n, int64_t lo, int64_t hi, unsigned long long* first,
                  cudaStream_t stream) {
  first_out_of_range_kernel<<<ops::grid_for(n, 256, 4096), 256, 0, stream>>>(idx, n, lo, hi, first);
  FP8MOE_CUDA_CHECK_LAUNCH("first_out_of_range_kernel");
}

}  // namespace

bool checks_deferred() { return state().deferred; }

void set_checks_deferred(bool deferred) {
  if (!deferred && state().deferred) raise_deferred_checks();
  state().deferred = deferred;
}

void raise_deferred_checks() {
  State& s = state();
  std::vector<RangeRecord> ranges;
  std::vector<FlagRecord> flags;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ranges.swap(s.ranges);
    flags.swap(s.flags);
  }
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
  std::string failure;
  if (!ranges.empty()) {
    std::vector<unsigned long long> first(ranges.size());
    FP8MOE_CUDA_CHECK(cudaMemcpy(first.data(), s.slots, first.size() * sizeof(unsigned long long),
                                 cudaMemcpyDeviceToHost));
    FP8MOE_CUDA_CHECK(cudaMemset(s.slots, 0xFF, first.size() * sizeof(unsigned long long)));
    for (size_t i = 0; i < ranges.size() && failure.empty(); ++i)
      if (first[i] != ~0ull)
        failure = ranges[i].what + "[" + std::to_string(first[i]) + "] outside [" + std::to_string(ranges[i].lo) +
                  ", " + std::to_string(ranges[i].hi) + ")";
  }
  for (const FlagRecord& f : flags) {
    int v = 0;
    FP8MOE_CUDA_CHECK(cudaMemcpy(&v, f.flag, sizeof(int), cudaMemcpyDeviceToHost));
    FP8MOE_CUDA_CHECK(cudaMemset(f.flag, 0, sizeof(int)));
    if (v && failure.empty()) failure = f.message;
  }
  FP8MOE_CHECK(failure.empty(), failure << " (deferred check, raised at synchronize)");
}

struct DeferredChecks {
  std::vector<RangeRecord> ranges;
  std::vector<FlagRecord> flags;
};

std::shared_ptr<const DeferredChecks> take_deferred_checks() {
  State& s = state();
  auto out = std::make_shared<DeferredChecks>();
  std::lock_guard<std::mutex> lock(s.mu);
  out->ranges.swap(s.ranges);
  out->flags.swap(s.flags);
  return out;
}

void put_deferred_checks(const DeferredChecks& checks) {
  State& s = state();
  bool pending = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    pending = !s.ranges.empty() || !s.flags.empty();
  }
  if (pending) raise_deferred_checks();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ranges = checks.ranges;
  s.flags = checks.flags;
}

void clear_flag(int* flag, cudaStream_t stream) {
  if (!checks_deferred()) FP8MOE_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream));
}

void raise_if_flag_set(int* flag, cudaStream_t stream, const char* what, const char* message) {
  State& s = state();
  if (s.deferred) {
    std::lock_guard<std::mutex> lock(s.mu);
    for (const FlagRecord& f : s.flags)
      if (f.flag == flag) return;
    s.flags.push_back({flag, message});
    return;
  }
  int v = 0;
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(&v, flag, sizeof(int), cudaMemcpyDeviceToHost, stream));
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  FP8MOE_CHECK(v == 0, what << ": " << message);
}

namespace ops {

int64_t first_out_of_range(const int32_t* idx, int64_t n, int64_t lo, int64_t hi, int32_t* value, const char* what,
                           cudaStream_t stream) {
  if (n <= 0) return -1;
  State& s = state();
  if (s.deferred) {
    bool full = false;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      full = s.ranges.size() == size_t(kRangeSlots);
    }
    if (full) raise_deferred_checks();
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.slots) {
      FP8MOE_CUDA_CHECK(cudaMalloc(&s.slots, kRangeSlots * sizeof(unsigned long long)));
      FP8MOE_CUDA_CHECK(cudaMemset(s.slots, 0xFF, kRangeSlots * sizeof(unsigned long long)));
    }
    launch_range(idx, n, lo, hi, s.slots + s.ranges.size(), stream);
    s.ranges.push_back({what, lo, hi});
    return -1;
  }
  DeviceBuffer first(sizeof(unsigned long long), stream);
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(first.as<void>(), 0xFF, sizeof(unsigned long long), stream));
  launch_range(idx, n, lo, hi, first.as<unsigned long long>(), stream);
  unsigned long long h = 0;
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(&h, first.as<void>(), sizeof(h), cudaMemcpyDeviceToHost, stream));
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (h == ~0ull) return -1;
  FP8MOE_CUDA_CHECK(cudaMemcpyAsync(value, idx + h, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return int64_t(h);
}

}  // namespace ops

}  // namespace fp8moe::cuda
