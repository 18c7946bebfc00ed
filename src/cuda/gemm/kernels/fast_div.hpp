// Division by a run-time invariant divisor as a multiply-high, an add and a shift, for the tile
// scheduler's coordinates (two divisions per tile, on the path to the tile's first WGMMAs).
// Host and device: the host computes the same magic numbers, so that a CPU test checks them.
//
// For 1 <= d < 2^31 and n < 2^31 (Granlund and Montgomery, "Division by invariant integers using
// multiplication", PLDI 1994, round-up variant): s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1
// (< 2^32), and n / d = (umulhi(n, m) + n) >> s, where the sum stays below 2^32.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FP8MOE_HD __host__ __device__ __forceinline__
#else
#define FP8MOE_HD inline
#endif

namespace fp8moe::cuda {

struct FastDiv {
  uint32_t d = 1, m = 1, s = 0;

  FastDiv() = default;
  // divisor 0 is taken as 1 (a scheduler with no tiles never divides).
  FP8MOE_HD explicit FastDiv(uint32_t divisor) : d(divisor ? divisor : 1) {
#if defined(__CUDA_ARCH__)
    s = d > 1 ? 32 - __clz(d - 1) : 0;
#else
    s = d > 1 ? 32 - __builtin_clz(d - 1) : 0;
#endif
    // floor(x / d) for x = (2^s - d) 2^32 < 2^63, exact in a double (at most 31 significant bits):
    // x times the double nearest 1 / d (within 2^-20 of x / d < 2^32), corrected by one.
    // NOTES: a 64-bit integer division on the device is a long subroutine, a double division
    // ~60 instructions with its slow path; the reciprocal is MUFU.RCP64H and a few DFMAs.
#if defined(__CUDA_ARCH__)
    const double r = __drcp_rn(double(d));
#else
    const double r = 1.0 / double(d);
#endif
    const uint64_t x = uint64_t((1ull << s) - d) << 32;
    uint64_t q = uint64_t(double(x) * r);
    if (q * d > x) --q;
    else if (x - q * d >= d) ++q;
    m = uint32_t(q + 1);
  }

  FP8MOE_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, m);
#else
    const uint32_t hi = uint32_t((uint64_t(n) * m) >> 32);
#endif
    return (hi + n) >> s;
  }
};

}  // namespace fp8moe::cuda

#undef FP8MOE_HD
