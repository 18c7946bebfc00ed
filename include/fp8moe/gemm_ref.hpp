// Reference FP8 GEMM with fine-grained scales and promotion (report §3.3.2; docs/ACCURACY.md), CPU.
//
//   D [M, N] = A [M, K] * B [N, K]^T   (+ C if accumulate: D += ...)
//   A: 1x128-scaled (activations / output gradients, per row per 128 K).
//   B: 128x128-scaled (weights: Fprop, Dgrad) or 1x128-scaled (Wgrad: both along tokens).
//   D: f32 or bf16 (accumulate requires f32, for gradient accumulation across micro-batches).
//   K must be a multiple of 128 (pad with zeros, which quantize to exact zeros); M, N any.
//
// Accumulation (AccumConfig):
//   AccumMode::fp32         each 128-wide K group is summed in FP32, multiplied by s_a * s_b and
//                           added to an FP32 accumulator: a kernel with ideal promotion.
//   AccumMode::tensor_core  emulation of Hopper FP8 WGMMA accumulation: per 32-element K step
//                           (one WGMMA), the running Tensor Core sum and the 32 exact products are
//                           aligned to the largest exponent among them and truncated toward zero to
//                           `mantissa_bits` significant bits (14 by default, the report's figure),
//                           then added exactly. Every `promote_every` K elements (N_c: a multiple
//                           of 32; 0 = never) the partial sum is promoted: acc_f32 += acc_tc * s,
//                           acc_tc = 0. When N_c spans several 128-groups (or never promotes) each
//                           product enters the Tensor Core sum already multiplied by its group's
//                           s_a * s_b, as a group-scaled MMA (report §3.5.2) would do.
#pragma once
#include <vector>

#include "fp8moe/quantize.hpp"

namespace fp8moe {

enum class AccumMode : uint8_t { fp32, tensor_core };

struct AccumConfig {
  AccumMode mode = AccumMode::fp32;
  int mantissa_bits = 14;   // tensor_core: significant bits kept after alignment (1..52)
  int promote_every = 128;  // tensor_core: N_c, a multiple of 32; 0 = never promote
};

struct GemmOptions {
  bool accumulate = false;  // D += A * B^T (D must be f32)
  AccumConfig accum;
};

// Throws fp8moe::Error naming the argument on: shape mismatch, wrong dtype or scale layout,
// K not a multiple of 128, null pointers, accumulate into non-f32, bad AccumConfig.
void gemm_fp8_ref(const QuantizedView& a, const QuantizedView& b, const TensorView& d,
                  const GemmOptions& opt = {});

// Plain reference D [M, N] = A [M, K] * B [N, K]^T (+ D), inputs f32 | bf16, FP32 accumulation.
void gemm_ref(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate = false);

// FP64 product deq(A) * deq(B)^T of the dequantized operands (A [M, K], B [N, K], host), row-major
// [M, N]: against it a GEMM's error on the same quantized inputs is its accumulation error alone.
std::vector<double> dequantized_product(const QuantizedView& a, const QuantizedView& b);

// The Tensor Core accumulation step of the emulation, exposed for tests: adds `n` products to
// `acc`, aligning all of them and acc to the largest exponent and truncating to `bits`.
double tensor_core_accumulate(double acc, const double* products, int n, int bits);

}  // namespace fp8moe
