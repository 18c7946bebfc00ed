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

namespace fp8moe {

// Packed E5M6 (dtype.hpp): the 12-bit codes of elements 2j and 2j+1 in bytes 3j..3j+2, little-endian
// as one 24-bit word: byte 3j = a[7:0], byte 3j+1 = a[11:8] | b[3:0] << 4, byte 3j+2 = b[11:4]. A
// pair is one 24-bit load or store; four values are six bytes (three uint16), eight are twelve (three
// uint32), which is what lets the kernels move them with aligned vector accesses.
FP8MOE_HOST_DEVICE void e5m6_pack2(uint16_t a, uint16_t b, uint8_t* p) {
  p[0] = uint8_t(a);
  p[1] = uint8_t(((a >> 8) & 0xF) | ((b & 0xF) << 4));
  p[2] = uint8_t(b >> 4);
}
// The 24 bits of a pair -> its two codes.
FP8MOE_HOST_DEVICE uint16_t e5m6_lo(uint32_t w24) { return uint16_t(w24 & 0xFFF); }
FP8MOE_HOST_DEVICE uint16_t e5m6_hi(uint32_t w24) { return uint16_t((w24 >> 12) & 0xFFF); }
// Code of element i of a packed array.
FP8MOE_HOST_DEVICE uint16_t e5m6_load(const uint8_t* data, int64_t i) {
  const uint8_t* p = data + (i >> 1) * 3;
  return (i & 1) ? uint16_t((p[1] >> 4) | (uint32_t(p[2]) << 4)) : uint16_t(p[0] | ((uint32_t(p[1]) & 0xF) << 8));
}
// Writes element i's code, leaving its pair's other code as it is (not thread-safe between the two
// elements of one pair).
FP8MOE_HOST_DEVICE void e5m6_store(uint8_t* data, int64_t i, uint16_t code) {
  uint8_t* p = data + (i >> 1) * 3;
  if (i & 1) {
    p[1] = uint8_t((p[1] & 0x0F) | ((code & 0xF) << 4));
    p[2] = uint8_t(code >> 4);
  } else {
    p[0] = uint8_t(code);
    p[1] = uint8_t((p[1] & 0xF0) | ((code >> 8) & 0xF));
  }
}

}  // namespace fp8moe
