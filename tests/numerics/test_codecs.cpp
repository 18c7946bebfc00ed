// Codecs against CUDA's own host conversion functions (cuda_fp8.h, cuda_bf16.h): every E4M3/E5M2/
// UE8M0 code and every BF16 bit pattern decoded, and encoders over a dense sweep of float32 inputs
// (every exponent with 2^8 mantissa prefixes and both signs, random bit patterns, the midpoints
// between consecutive codes and their neighbours, subnormals, overflow, Inf, NaN) in both
// saturation modes. E5M6 has no CUDA counterpart: it is checked against a brute-force nearest-value
// oracle over its 4096 codes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "fp8moe/codecs.hpp"
#include "fp8moe/minifloat_encode.hpp"
#include "fp8moe/quantize.hpp"

using namespace fp8moe;

namespace {

// Float inputs that exercise every rounding path.
std::vector<float> sweep_inputs() {
  std::vector<float> xs;
  for (uint32_t hi = 0; hi < (1u << 17); ++hi) xs.push_back(std::bit_cast<float>(hi << 15));  // sign, exp, 8 mantissa bits
  std::mt19937 rng(1234);
  for (int i = 0; i < (1 << 20); ++i) xs.push_back(std::bit_cast<float>(uint32_t(rng())));
  // Random values in the FP8 range, where most tie/rounding cases live.
  std::uniform_real_distribution<float> u(-70000.f, 70000.f);
  for (int i = 0; i < (1 << 18); ++i) xs.push_back(u(rng) * std::ldexp(1.0f, -int(rng() % 40)));
  for (float v : {0.f, -0.f, INFINITY, -INFINITY, NAN, -NAN, 448.f, 464.f, 464.0001f, 480.f, 57344.f, 61440.f,
                  61439.99f, 65024.f, 65535.f, 65536.f, 0x1p-9f, 0x1p-10f, 0x1.0001p-10f, 0x1p-16f, 0x1p-17f,
                  0x1p-127f, 0x1p-126f, 0x1.8p-127f, 0x1p127f, 0x1.0001p127f, 3.4e38f})
    xs.push_back(v);
  return xs;
}

// Midpoints between consecutive finite codes of a decoder, and their float neighbours.
template <class Decode>
void add_midpoints(std::vector<float>& xs, int ncodes, Decode decode) {
  std::vector<double> vals;
  for (int c = 0; c < ncodes; ++c) {
    double v = decode(c);
    if (std::isfinite(v)) vals.push_back(v);
  }
  std::sort(vals.begin(), vals.end());
  for (size_t i = 0; i + 1 < vals.size(); ++i) {
    float mid = float((vals[i] + vals[i + 1]) / 2);
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, INFINITY));
    xs.push_back(std::nextafter(mid, -INFINITY));
  }
}

float half_raw_to_float(__half_raw h) { return __half2float(__half(h)); }

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

void check_fp8_encoder(__nv_fp8_interpretation_t kind, uint8_t (*encode)(float, Saturate), float (*decode)(uint8_t)) {
  std::vector<float> xs = sweep_inputs();
  add_midpoints(xs, 256, [&](int c) { return double(decode(uint8_t(c))); });
  int64_t mismatches = 0;
  for (auto [sat, cuda_sat] : {std::pair{Saturate::finite, __NV_SATFINITE}, std::pair{Saturate::none, __NV_NOSAT}}) {
    for (float x : xs) {
      uint8_t ours = encode(x, sat);
      uint8_t ref = __nv_cvt_float_to_fp8(x, cuda_sat, kind);
      if (ours != ref && ++mismatches < 10)
        ADD_FAILURE() << "x=" << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x) << ") sat=" << int(sat)
                      << " ours=0x" << int(ours) << " cuda=0x" << int(ref) << std::dec;
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << 2 * xs.size() << " conversions";
}

}  // namespace

TEST(Codecs, E4M3DecodeAll256CodesMatchCuda) {
  for (int c = 0; c < 256; ++c) {
    float ref = half_raw_to_float(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(c), __NV_E4M3));
    EXPECT_TRUE(same_float(e4m3_decode(uint8_t(c)), ref)) << "code " << c;
  }
  EXPECT_EQ(e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(e4m3_decode(0x01), 0x1p-9f);
  EXPECT_TRUE(std::isnan(e4m3_decode(0x7F)) && std::isnan(e4m3_decode(0xFF)));
}

TEST(Codecs, E5M2DecodeAll256CodesMatchCuda) {
  for (int c = 0; c < 256; ++c) {
    float ref = half_raw_to_float(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(c), __NV_E5M2));
    EXPECT_TRUE(same_float(e5m2_decode(uint8_t(c)), ref)) << "code " << c;
  }
  EXPECT_EQ(e5m2_decode(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_decode(0x7C), INFINITY);
}

TEST(Codecs, E4M3EncodeSweepMatchesCuda) { check_fp8_encoder(__NV_E4M3, e4m3_encode, e4m3_decode); }
TEST(Codecs, E5M2EncodeSweepMatchesCuda) { check_fp8_encoder(__NV_E5M2, e5m2_encode, e5m2_decode); }

TEST(Codecs, Bf16AllPatternsAndSweepMatchCuda) {
  for (uint32_t b = 0; b < 65536; ++b) {
    __nv_bfloat16_raw raw;
    raw.x = uint16_t(b);
    EXPECT_TRUE(same_float(bf16_decode(uint16_t(b)), __bfloat162float(__nv_bfloat16(raw)))) << b;
  }
  std::vector<float> xs = sweep_inputs();
  add_midpoints(xs, 65536, [](int c) { return double(bf16_decode(uint16_t(c))); });
  int64_t mismatches = 0;
  for (float x : xs) {
    uint16_t ref = __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
    uint16_t ours = bf16_encode(x, Saturate::none);
    bool ok = std::isnan(x) ? (std::isnan(bf16_decode(ours)) && std::isnan(bf16_decode(ref))) : ours == ref;
    if (!ok && ++mismatches < 10) ADD_FAILURE() << "x=" << x << " ours=" << ours << " cuda=" << ref;
    // Saturating mode: the same, except that overflow stops at the largest finite value.
    uint16_t sat = bf16_encode(x, Saturate::finite);
    if (!std::isnan(x)) {
      float want = std::isinf(bf16_decode(ref)) ? std::copysign(0x1.FEp127f, x) : bf16_decode(ref);
      EXPECT_EQ(bf16_decode(sat), want) << x;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Codecs, Ue8m0MatchesCuda) {
  for (int c = 0; c < 256; ++c) {
    __nv_bfloat16_raw ref = __nv_cvt_e8m0_to_bf16raw(__nv_fp8_storage_t(c));
    float rf = __bfloat162float(__nv_bfloat16(ref));
    EXPECT_TRUE(same_float(ue8m0_decode(uint8_t(c)), rf)) << "code " << c;
  }
  std::vector<float> xs = sweep_inputs();
  int64_t mismatches = 0;
  for (float x : xs)
    for (bool up : {true, false})
      for (auto [sat, cuda_sat] : {std::pair{Saturate::finite, __NV_SATFINITE}, std::pair{Saturate::none, __NV_NOSAT}}) {
        uint8_t ours = ue8m0_encode(x, up, sat);
        uint8_t ref = __nv_cvt_float_to_e8m0(x, cuda_sat, up ? cudaRoundPosInf : cudaRoundZero);
        if (ours != ref && ++mismatches < 10)
          ADD_FAILURE() << "x=" << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x) << std::dec
                        << ") up=" << up << " sat=" << int(sat) << " ours=" << int(ours) << " cuda=" << int(ref);
      }
  EXPECT_EQ(mismatches, 0);
}

// E5M6: brute-force oracle. The nearest finite code (ties to the even code) over all 4096 codes.
TEST(Codecs, E5M6MatchesNearestValueOracle) {
  struct Entry { double v; uint16_t code; };
  std::vector<Entry> table;
  for (uint16_t c = 0; c < 4096; ++c) {
    double v = e5m6_decode(c);
    if (std::isfinite(v) && !(v == 0 && (c & 0x800))) table.push_back({v, c});
  }
  ASSERT_EQ(table.size(), 2u * 31 * 64 - 1);  // 31 finite binades of 64 codes per sign, one zero
  std::sort(table.begin(), table.end(), [](auto& a, auto& b) { return a.v < b.v; });
  EXPECT_EQ(table.back().v, 65024.0);
  EXPECT_EQ(table[table.size() / 2 + 1].v, 0x1p-20);  // smallest subnormal
  std::vector<float> xs = sweep_inputs();
  add_midpoints(xs, 4096, [](int c) { return double(e5m6_decode(uint16_t(c))); });
  const double max = 65024.0, half_ulp_top = 256.0;  // ulp at the top binade is 2^15/64 = 512
  int64_t mismatches = 0;
  for (float x : xs) {
    for (Saturate sat : {Saturate::finite, Saturate::none}) {
      uint16_t ours = e5m6_encode(x, sat);
      uint16_t want;
      if (std::isnan(x)) {
        want = 0x7FF;
      } else if (std::fabs(double(x)) >= max + half_ulp_top) {  // ties at the top round to odd->up: overflow
        want = sat == Saturate::finite ? uint16_t(0x7BF | (x < 0 ? 0x800 : 0)) : uint16_t(0x7C0 | (x < 0 ? 0x800 : 0));
      } else {
        auto it = std::lower_bound(table.begin(), table.end(), double(x), [](const Entry& e, double v) { return e.v < v; });
        const Entry* best = it == table.end() ? &table.back() : &*it;
        if (it != table.begin()) {
          const Entry& lo = *(it - 1);
          double dlo = double(x) - lo.v, dhi = it == table.end() ? INFINITY : it->v - double(x);
          if (dlo < dhi || (dlo == dhi && (lo.code & 1) == 0)) best = &lo;
        }
        want = best->code;
        if (want == 0 && std::signbit(x)) want = 0x800;  // -0 and negative underflow keep the sign
      }
      if (ours != want && ++mismatches < 10)
        ADD_FAILURE() << "x=" << x << " sat=" << int(sat) << " ours=0x" << std::hex << ours << " want=0x" << want << std::dec;
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(e5m6_decode(0x7C0), INFINITY);
  EXPECT_TRUE(std::isnan(e5m6_decode(0x7FF)));
}

TEST(Codecs, E5M6RoundTripsEveryFiniteCode) {
  for (uint16_t c = 0; c < 4096; ++c) {
    float v = e5m6_decode(c);
    if (std::isfinite(v)) {
      EXPECT_EQ(e5m6_encode(v), c) << "code " << c;
    }
  }
}

// Packed E5M6 (two 12-bit codes in three bytes): every code, finite or not, in both halves of a
// pair, against every code in the other half (4096 x 4096 pairs), survives pack -> unpack and
// element writes (e5m6_store) -> reads, without touching its neighbour; an odd count's last value
// takes two bytes with the upper nibble zero.
TEST(Codecs, E5M6PackedRoundTripsEveryCodePair) {
  std::vector<uint16_t> codes(2 * 4096), back(codes.size());
  std::vector<uint8_t> packed(dtype_bytes(DType::e5m6, int64_t(codes.size())));
  ASSERT_EQ(packed.size(), codes.size() * 3 / 2);
  int64_t bad = 0;
  for (int other = 0; other < 4096; ++other) {
    for (int c = 0; c < 4096; ++c) {
      codes[size_t(2 * c)] = uint16_t(c), codes[size_t(2 * c + 1)] = uint16_t((c + other) & 0xFFF);
    }
    e5m6_pack(codes.data(), int64_t(codes.size()), packed.data());
    e5m6_unpack(packed.data(), int64_t(codes.size()), back.data());
    bad += codes != back;
  }
  EXPECT_EQ(bad, 0);
  // Element writes leave the pair's other half alone.
  std::vector<uint8_t> p(dtype_bytes(DType::e5m6, 5), 0xAB);
  const uint16_t want[5] = {0x123, 0xFFF, 0x000, 0x7C0, 0x801};
  for (int64_t i : {3, 0, 4, 1, 2}) e5m6_store(p.data(), i, want[i]);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(e5m6_load(p.data(), i), want[i]) << i;
  ASSERT_EQ(p.size(), 8u);
  std::vector<uint8_t> q(8, 0xFF);
  e5m6_pack(want, 5, q.data());
  EXPECT_EQ(q[7] & 0xF0, 0) << "the odd last value's upper nibble";
  EXPECT_EQ(std::vector<uint8_t>(q.begin(), q.begin() + 7), std::vector<uint8_t>(p.begin(), p.begin() + 7));
}

// The packed E5M6 quantizer writes, for every finite E5M6 value (as a tile's input, power-of-two
// scale 1 since each tile holds the maximum 65024), the code e5m6_encode gives it, and the tensor
// takes 1.5 bytes per value: 0.75 of BF16's.
TEST(Codecs, E5M6PackedQuantizerBitExactOnEveryFiniteValue) {
  std::vector<float> finite;
  for (uint16_t c = 0; c < 4096; ++c)
    if (std::isfinite(e5m6_decode(c))) finite.push_back(e5m6_decode(c));
  const int64_t per_row = 127, R = int64_t(finite.size() + per_row - 1) / per_row, C = 128;
  Tensor x = Tensor::host(DType::f32, {R, C});
  for (int64_t r = 0; r < R; ++r) {
    x.ptr<float>()[r * C] = 65024.0f;  // amax = max finite: scale 1 in pow2 mode
    for (int64_t j = 0; j < per_row; ++j) {
      const size_t k = size_t(r * per_row + j);
      x.ptr<float>()[r * C + 1 + j] = k < finite.size() ? finite[k] : 0.0f;
    }
  }
  QuantizedTensor q = make_quantized_host(R, C, DType::e5m6, ScaleKind::tile_1x128);
  quantize_1x128(x.view(), q.view(), ScaleMode::pow2);
  EXPECT_EQ(q.values.view().nbytes() * 4, size_t(R * C * 2) * 3) << "0.75 of BF16's bytes";
  int64_t bad = 0;
  for (int64_t i = 0; i < R * C; ++i) {
    EXPECT_EQ(q.scales.ptr<float>()[(i % C) / 128 * scale_ld(R) + i / C], 1.0f);
    bad += e5m6_load(q.values.ptr<uint8_t>(), i) != e5m6_encode(x.ptr<float>()[i]);
  }
  EXPECT_EQ(bad, 0);
}
