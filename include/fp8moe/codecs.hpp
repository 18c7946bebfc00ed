// Bit-exact scalar codecs for the number formats of the FP8 recipe (docs/ACCURACY.md, "Codecs").
// All encoders round to nearest, ties to even. They are the specification the CUDA kernels must
// match bit for bit; tests/numerics/test_codecs.cpp checks them against cuda_fp8.h / cuda_bf16.h.
//
// Formats (sign, exponent, mantissa bits; bias; specials):
//   E4M3  1-4-3, bias 7.  No infinity. NaN = S.1111.111 (0x7F/0xFF). Max finite 448 (0x7E).
//         Subnormals: exponent field 0, value = m/8 * 2^-6 (min 2^-9).
//   E5M2  1-5-2, bias 15. IEEE-like: exponent 31 is Inf (m=0) or NaN (m!=0). Max finite 57344.
//   E5M6  1-5-6, bias 15. A code is the low 12 bits of a uint16 (bit 11 = sign, bits 15..12 = 0);
//         tensors store it packed, two codes in three bytes (e5m6_store/e5m6_load,
//         minifloat_encode.hpp), 1.5 bytes per value.
//         IEEE-like: exponent 31 is Inf (m=0) or NaN (m!=0; encoders write 0x7FF).
//         Max finite 65024 = 2^15 * (1 + 63/64). Subnormals: m/64 * 2^-14 (min 2^-20).
//         Same range as E5M2, three more mantissa bits: the report's format for the input of the
//         Linear after attention.
//   BF16  1-8-7, the upper half of an FP32. NaN is written as 0x7FFF|sign.
//   UE8M0 8-bit unsigned exponent, value 2^(e-127), 0xFF = NaN: power-of-two scales.
//
// NaN/Inf policy (encoders):
//   NaN in  -> the canonical positive NaN in both modes (E4M3 and E5M2 0x7F, E5M6 0x7FF), as
//              cuda_fp8.h does for float inputs; BF16 keeps the sign (0x7FFF|sign).
//   Saturate::finite : values (and +-Inf) beyond the largest finite clamp to +-max finite.
//   Saturate::none   : overflow gives +-Inf where the format has Inf, NaN for E4M3 (as __NV_NOSAT).
//   Overflow means: the value rounded to nearest-even in an unbounded-exponent format exceeds max.
#pragma once
#include <cstdint>

#include "fp8moe/dtype.hpp"

namespace fp8moe {

enum class Saturate : uint8_t { finite, none };

struct MiniFloatFormat {
  int exp_bits;
  int man_bits;
  int bias;
  bool has_inf;      // IEEE-style top exponent (E5M2, E5M6); false for E4M3 "fn" (top code is NaN)
  double max_finite;
};

constexpr MiniFloatFormat kE4M3{4, 3, 7, false, 448.0};
constexpr MiniFloatFormat kE5M2{5, 2, 15, true, 57344.0};
constexpr MiniFloatFormat kE5M6{5, 6, 15, true, 65024.0};

// Generic encoder/decoder for the formats above (code in the low 1+E+M bits).
uint32_t minifloat_encode(const MiniFloatFormat& f, float x, Saturate sat);
double minifloat_decode(const MiniFloatFormat& f, uint32_t code);

uint8_t e4m3_encode(float x, Saturate sat = Saturate::finite);
float e4m3_decode(uint8_t code);
uint8_t e5m2_encode(float x, Saturate sat = Saturate::finite);
float e5m2_decode(uint8_t code);
uint16_t e5m6_encode(float x, Saturate sat = Saturate::finite);
float e5m6_decode(uint16_t code);
// Packed E5M6 arrays (dtype_bytes(e5m6, n) bytes): n codes <-> packed bytes, and element access.
void e5m6_pack(const uint16_t* codes, int64_t n, uint8_t* packed);
void e5m6_unpack(const uint8_t* packed, int64_t n, uint16_t* codes);

uint16_t bf16_encode(float x, Saturate sat = Saturate::none);
float bf16_decode(uint16_t bits);
inline float bf16_round(float x) { return bf16_decode(bf16_encode(x)); }

// UE8M0 of |x| (the sign is ignored, as cvt.ue8m0 does). round_up=true rounds toward +Inf: the
// smallest power of two >= |x|, what a scale needs so that nothing overflows; false rounds toward
// zero. Below 2^-127 clamps to code 0 (round_up gives 2^-126 above 2^-127); NaN -> 0xFF;
// Inf -> 0xFE (finite) or 0xFF (none); values above 2^127 after rounding likewise.
uint8_t ue8m0_encode(float x, bool round_up = true, Saturate sat = Saturate::finite);
float ue8m0_decode(uint8_t code);

// Encoding by DType for the quantizers: e4m3, e5m2 (one byte) or e5m6 (12 bits, packed).
const MiniFloatFormat& format_of(DType t);
double max_finite(DType t);

}  // namespace fp8moe
