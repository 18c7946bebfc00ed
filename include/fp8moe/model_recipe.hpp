// The mixed-precision recipe of a model run (docs/MODEL.md): which GEMM precision every Linear uses,
// how activations are cached for backward, and the ablations of the FP8 recipe.
//   fp64              FD-check mode: master weights, activations and GEMMs in FP64 (CPU only).
//   fp32              everything in FP32: the oracle the PyTorch reference is compared with.
//   bf16              every Linear GEMM with BF16 inputs and FP32 accumulation; Linear inputs
//                     cached BF16.
//   fp8               the report: Fprop/Dgrad/Wgrad of every Linear (experts included) in E4M3 with
//                     1x128 activation tiles and 128x128 weight blocks, FP32 promotion every 128 K;
//                     embedding, output head (BF16 GEMM), MoE gate (FP32), norms and attention
//                     (FP32) in higher precision; Linear inputs cached in FP8, the attention-out Linear input in E5M6 with
//                     power-of-two scales, SwiGLU input cached in FP8, each sublayer's input
//                     kept in BF16 for its RMSNorm (whose output the backward recomputes).
//   fp8-no-promotion  fp8 with the Tensor Core accumulation emulated at 14 bits and never promoted.
//   fp8-per-tensor    fp8 with one scale per tensor instead of tiles/blocks.
//   fp8-f32-cache     fp8 GEMMs with every activation the backward reads cached exactly (FP32,
//                     beside the FP8 tiles the Fprop reads): the Wgrad quantizes x^T from it, the
//                     SwiGLU and attention backward read it. Separates the cost of FP8 storage
//                     (the report's memory savings) from that of the FP8 GEMMs.
// Master weights and weight gradients are FP32 in every recipe but fp64. Attention runs in the
// activation precision in every recipe unless set_attention("bf16") gives its GEMMs BF16 operands
// with FP32 accumulation (the report keeps attention in "BF16 or FP32"; `fp8moe train --attention
// bf16`): 5-6% faster steps on an H200, and FP8 drifted 0.5-1.3% above BF16 in 3000-step runs
// with it (docs/ACCURACY.md), so it is not the default.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/gemm_ref.hpp"
#include "fp8moe/quantize.hpp"

namespace fp8moe {

enum class LinearPrecision : uint8_t { full, bf16, fp8 };  // full = the activation dtype (f32|f64)

struct Recipe {
  std::string name = "fp32";
  DType act_dtype = DType::f32;          // activations, master weights and gradients
  LinearPrecision linear = LinearPrecision::full;
  bool head_bf16 = false;                // output head (and MTP head) as a BF16 GEMM
  bool per_tensor = false;               // fp8-per-tensor ablation
  bool f32_cache = false;                // fp8-f32-cache ablation: activations also cached exactly
  AccumConfig accum{};                   // FP8 GEMM accumulation (promotion)
  ScaleMode scale_mode = ScaleMode::fp32;  // scales of ordinary FP8 tensors
  // Where the report asks for power-of-two scales: the attention-out Linear input (E5M6), the
  // activations before MoE dispatch and the activation gradients before the MoE down projection.
  ScaleMode pow2_mode = ScaleMode::pow2;
  DType attn_out_cache = DType::f32;     // dtype of the cached attention-out Linear input
  // Each sublayer's input x as kept for its RMSNorm (the norm's backward and the recomputation of
  // its output): the activation dtype, or bf16 (the FP8 recipes: the norm then reads bf16(x) in
  // forward too, so that forward and backward see one input; the residual stream stays FP32).
  DType residual_cache = DType::f32;
  // Attention's GEMM operands (Backend::attention_forward's compute): the activation dtype
  // ("exact", every recipe's default) or bf16 (BF16 operands, FP32 accumulation).
  DType attn_compute = DType::f32;
  // "exact" | "bf16"; throws on others.
  void set_attention(std::string_view mode);
  std::string attention() const;

  bool is_fp8() const { return linear == LinearPrecision::fp8; }
  // The routed experts run over all segments of the expert-sorted layout at once (grouped FP8
  // GEMMs, or one BF16 GEMM per segment) rather than one MLP per expert.
  bool groups_experts() const { return (is_fp8() && !per_tensor) || linear == LinearPrecision::bf16; }
  // Bytes per element a cached Linear input takes (scales included for FP8: 4 bytes per 128).
  double cache_bytes_per_element(bool attn_out = false) const;

  // "fp64", "fp32", "bf16", "fp8", "fp8-no-promotion", "fp8-per-tensor", "fp8-f32-cache"; throws on
  // others.
  static Recipe from_name(std::string_view name);
  static std::vector<std::string> names();
};

}  // namespace fp8moe
