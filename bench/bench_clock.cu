// The benchmarks' SM clock probe (bench_util.hpp, Timer::clocks): one block per SM records its SM
// id, its cycle counter and the global nanosecond timer; two probes around a timed launch give each
// SM's cycles over nanoseconds, the mean SM clock of the launch (and the short gaps around it).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "bench/bench_util.hpp"

namespace fp8moe::cuda::bench {

namespace {

__global__ void clock_stamp_kernel(ClockStamp* __restrict__ out) {
  if (threadIdx.x != 0) return;
  ClockStamp s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s.sm));
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(s.ns));
  s.cycles = clock64();
  out[blockIdx.x] = s;
}

}  // namespace

int clock_stamp_blocks() { return device_props().multiProcessorCount; }

void clock_stamp(ClockStamp* slot, cudaStream_t stream) {
  clock_stamp_kernel<<<clock_stamp_blocks(), 32, 0, stream>>>(slot);
  FP8MOE_CUDA_CHECK_LAUNCH("clock_stamp_kernel");
}

double clock_ghz(const ClockStamp* before, const ClockStamp* after, int blocks) {
  std::map<uint32_t, ClockStamp> first;  // per SM, its earliest stamp of `before`
  for (int i = 0; i < blocks; ++i) {
    auto it = first.find(before[i].sm);
    if (it == first.end() || before[i].ns < it->second.ns) first[before[i].sm] = before[i];
  }
  std::vector<double> ghz;
  for (int i = 0; i < blocks; ++i) {
    const auto it = first.find(after[i].sm);
    if (it == first.end() || after[i].ns <= it->second.ns) continue;
    ghz.push_back(double(after[i].cycles - it->second.cycles) / double(after[i].ns - it->second.ns));
  }
  if (ghz.empty()) return NAN;
  std::nth_element(ghz.begin(), ghz.begin() + ghz.size() / 2, ghz.end());
  return ghz[ghz.size() / 2];
}

}  // namespace fp8moe::cuda::bench
