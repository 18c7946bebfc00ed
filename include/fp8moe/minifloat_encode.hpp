// The round-to-nearest-even encoder of the minifloat formats (codecs.hpp) as one host/device
// function on the float's bits, integer arithmetic only, so the CPU codecs and the CUDA kernels
// that have no hardware conversion (E5M6) produce the same bits by construction.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FP8MOE_HOST_DEVICE __host__ __device__ inline
#else
#define FP8MOE_HOST_DEVICE inline
#endif

namespace fp8moe {

// u: the bits of a float. Format: 1 sign, exp_bits, man_bits, exponent bias; has_inf: IEEE-style
// top exponent (else the all-ones code is NaN, as E4M3). saturate: overflow to +-max finite, else
// to +-Inf (or NaN without Inf). NaN -> the canonical positive NaN.
FP8MOE_HOST_DEVICE uint32_t minifloat_encode_bits(uint32_t u, int exp_bits, int man_bits, int bias, bool has_inf,
                                                  bool saturate) {
  const uint32_t a = u & 0x7FFFFFFFu;
  const int width = 1 + exp_bits + man_bits;
  const uint32_t sign = (u >> 31) << (width - 1);
  const uint32_t nan_code = (1u << (exp_bits + man_bits)) - 1;
  const uint32_t inf_code = ((1u << exp_bits) - 1) << man_bits;
  const uint32_t max_code = has_inf ? inf_code - 1 : nan_code - 1;
  if (a > 0x7F800000u) return nan_code;
  const uint32_t overflow = saturate ? max_code : (has_inf ? inf_code : nan_code);
  if (a == 0x7F800000u) return sign | overflow;
  // NOTES: float subnormals (and zero) are far below half the smallest code of every format here.
  if ((a >> 23) == 0) return sign;
  const int fexp = int(a >> 23) - 127;  // |x| = mant * 2^(fexp - 23)
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const int emin = 1 - bias;            // exponent of the smallest normal
  const int e = fexp > emin ? fexp : emin;
  const int shift = 23 - man_bits + (e - fexp);
  uint32_t n = 0;                       // |x| in quanta of 2^(e - man_bits), rounded to nearest even
  if (shift < 32) {
    n = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (n & 1))) ++n;
  }
  if (n == 0) return sign;
  uint32_t code;
  if (n >= (1u << man_bits)) {          // normal (possibly rounded up into the next binade)
    int field = e + bias;
    if (n >= (2u << man_bits)) {
      n >>= 1;
      ++field;
    }
    code = (uint32_t(field) << man_bits) | (n - (1u << man_bits));
  } else {
    code = n;                           // subnormal: exponent field 0
  }
  return code > max_code ? sign | overflow : sign | code;
}

}  // namespace fp8moe
