// Scalar codecs: see include/fp8moe/codecs.hpp for the formats and the NaN/Inf policy.
// The generic minifloat encoder works in double: every float is exact there, and scaling by a
// power of two before std::nearbyint gives round-to-nearest-even at the target's quantum.
#include "fp8moe/codecs.hpp"

#include <bit>
#include <cmath>
#include <cstring>

#include "fp8moe/error.hpp"
#include "fp8moe/minifloat_encode.hpp"

namespace fp8moe {

namespace {
uint32_t nan_code(const MiniFloatFormat& f) {
  return (1u << (f.exp_bits + f.man_bits)) - 1;  // exponent and mantissa all ones
}
}  // namespace

uint32_t minifloat_encode(const MiniFloatFormat& f, float x, Saturate sat) {
  return minifloat_encode_bits(std::bit_cast<uint32_t>(x), f.exp_bits, f.man_bits, f.bias, f.has_inf,
                               sat == Saturate::finite);
}

double minifloat_decode(const MiniFloatFormat& f, uint32_t code) {
  const int width = 1 + f.exp_bits + f.man_bits;
  const bool neg = (code >> (width - 1)) & 1;
  const uint32_t field = (code >> f.man_bits) & ((1u << f.exp_bits) - 1);
  const uint32_t man = code & ((1u << f.man_bits) - 1);
  double v;
  if (f.has_inf && field == (1u << f.exp_bits) - 1) {
    v = man ? std::nan("") : INFINITY;
  } else if (!f.has_inf && (code & nan_code(f)) == nan_code(f)) {
    v = std::nan("");
  } else if (field == 0) {
    v = std::ldexp(double(man), 1 - f.bias - f.man_bits);
  } else {
    v = std::ldexp(double(man | (1u << f.man_bits)), int(field) - f.bias - f.man_bits);
  }
  return neg ? -v : v;
}

namespace {
// Every code of a format decoded once: decoding is a table lookup on the hot paths (GEMM
// operands, dequantization).
template <int kCodes>
struct DecodeTable {
  float v[kCodes];
  explicit DecodeTable(const MiniFloatFormat& f) {
    for (int c = 0; c < kCodes; ++c) v[c] = float(minifloat_decode(f, uint32_t(c)));
  }
};
const DecodeTable<256> kE4M3Table(kE4M3), kE5M2Table(kE5M2);
const DecodeTable<4096> kE5M6Table(kE5M6);
}  // namespace

uint8_t e4m3_encode(float x, Saturate sat) { return uint8_t(minifloat_encode(kE4M3, x, sat)); }
float e4m3_decode(uint8_t code) { return kE4M3Table.v[code]; }
uint8_t e5m2_encode(float x, Saturate sat) { return uint8_t(minifloat_encode(kE5M2, x, sat)); }
float e5m2_decode(uint8_t code) { return kE5M2Table.v[code]; }
uint16_t e5m6_encode(float x, Saturate sat) { return uint16_t(minifloat_encode(kE5M6, x, sat)); }
float e5m6_decode(uint16_t code) { return kE5M6Table.v[code & 0xFFF]; }

void e5m6_pack(const uint16_t* codes, int64_t n, uint8_t* packed) {
  for (int64_t j = 0; j + 1 < n; j += 2) e5m6_pack2(codes[j] & 0xFFF, codes[j + 1] & 0xFFF, packed + j / 2 * 3);
  if (n % 2) {  // the odd last value: two bytes, upper nibble zero
    packed[(n - 1) / 2 * 3] = uint8_t(codes[n - 1]);
    packed[(n - 1) / 2 * 3 + 1] = uint8_t((codes[n - 1] >> 8) & 0xF);
  }
}

void e5m6_unpack(const uint8_t* packed, int64_t n, uint16_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = e5m6_load(packed, i);
}

uint16_t bf16_encode(float x, Saturate sat) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return uint16_t((u >> 16) & 0x8000) | 0x7FFF;
  if (sat == Saturate::finite && std::isinf(x)) return uint16_t((u >> 16) & 0x8000) | 0x7F7F;
  uint32_t rounded = u + 0x7FFF + ((u >> 16) & 1);  // RNE on the low 16 bits
  uint16_t r = uint16_t(rounded >> 16);
  if (sat == Saturate::finite && (r & 0x7FFF) == 0x7F80) r = uint16_t((r & 0x8000) | 0x7F7F);
  return r;
}

float bf16_decode(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

uint8_t ue8m0_encode(float x, bool round_up, Saturate sat) {
  if (std::isnan(x)) return 0xFF;
  float a = std::fabs(x);
  if (std::isinf(a)) return sat == Saturate::finite ? 0xFE : 0xFF;
  uint32_t u = std::bit_cast<uint32_t>(a);
  int field = int(u >> 23);  // biased exponent, 0 for zero/subnormals
  uint32_t man = u & 0x7FFFFF;
  if (field == 0) {
    // Below 2^-126: round toward zero gives 2^-127 (code 0) for all; toward +Inf gives code 0 up
    // to exactly 2^-127 and code 1 above.
    return (round_up && man > 0x400000) ? 1 : 0;
  }
  if (round_up && man != 0) ++field;
  if (field >= 255) return sat == Saturate::finite ? 0xFE : 0xFF;
  return uint8_t(field);
}

float ue8m0_decode(uint8_t code) {
  if (code == 0xFF) return NAN;
  return std::ldexp(1.0f, int(code) - 127);
}

const MiniFloatFormat& format_of(DType t) {
  switch (t) {
    case DType::e4m3: return kE4M3;
    case DType::e5m2: return kE5M2;
    case DType::e5m6: return kE5M6;
    default: break;
  }
  FP8MOE_CHECK(false, "dtype " << dtype_name(t) << " is not an FP8/E5M6 format (expected e4m3|e5m2|e5m6)");
}

double max_finite(DType t) { return format_of(t).max_finite; }

}  // namespace fp8moe
