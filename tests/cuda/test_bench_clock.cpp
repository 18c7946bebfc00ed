// The benchmarks' SM clock probe (bench/bench_clock.cu, Timer::clocks in bench_util.hpp): the
// per-SM matching of two probes on the host (no GPU), and the probe around interleaved timed
// launches (GPU).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "bench/bench_util.hpp"
#include "cuda_test_util.hpp"

using fp8moe::cuda::bench::clock_ghz;
using fp8moe::cuda::bench::ClockStamp;

TEST(BenchClock, MatchesStampsBySmAndTakesTheMedian) {
  // SM 7 at 1.5 GHz, SM 3 at 1.2 GHz, SM 5 at 1.8 GHz; SM 9 only before, SM 11 only after; a
  // second block on SM 7 before (later: ignored, the earliest stamp of an SM counts).
  const std::vector<ClockStamp> before = {{7, 1000, 5000}, {3, 1000, 9000}, {5, 2000, 100}, {9, 10, 10}, {7, 1200, 9999}};
  const std::vector<ClockStamp> after = {{3, 3000, 11400}, {11, 5000, 5000}, {5, 3000, 1900}, {7, 3000, 8000}, {7, 3000, 8000}};
  // Per matched stamp of `after`: 1.2, 1.8, 1.5, 1.5 GHz -> median (upper) 1.5.
  EXPECT_DOUBLE_EQ(clock_ghz(before.data(), after.data(), int(before.size())), 1.5);
  // No SM in both, or time not advancing: NaN.
  const std::vector<ClockStamp> none = {{1, 0, 0}, {2, 0, 0}};
  EXPECT_TRUE(std::isnan(clock_ghz(none.data(), after.data(), 2)));
  EXPECT_TRUE(std::isnan(clock_ghz(after.data(), after.data(), int(after.size()))));
}

TEST(BenchClock, ProbesTheSmClockAroundTimedLaunches) {
  FP8MOE_REQUIRE_GPU();
  fp8moe::cuda::bench::Timer timer;
  fp8moe::cuda::bench::DeviceBuffer buf(size_t(256) << 20);
  auto fn = [&] { FP8MOE_CUDA_CHECK(cudaMemsetAsync(buf.p, 1, buf.bytes, nullptr)); };
  EXPECT_TRUE(std::isnan(timer.interleaved({fn}, 1, 3)[0].ghz));  // not asked for
  timer.clocks = true;
  // Two functions side by side: one result each, in their order (the second moves 4x the bytes).
  fp8moe::cuda::bench::DeviceBuffer buf4(size_t(1024) << 20);
  auto fn4 = [&] { FP8MOE_CUDA_CHECK(cudaMemsetAsync(buf4.p, 3, buf4.bytes, nullptr)); };
  const std::vector<fp8moe::cuda::bench::Timing> t = timer.interleaved({fn, fn4}, 1, 5);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_GT(t[0].us, 0.0);
  EXPECT_GT(t[1].us, 2.0 * t[0].us);
  int khz = 0;
  FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  // Between a tenth of the maximum SM clock and the maximum (5% for the timers' granularity).
  for (const auto& x : t) {
    EXPECT_GT(x.ghz, 0.1 * khz * 1e-6);
    EXPECT_LT(x.ghz, 1.05 * khz * 1e-6);
  }
}
