// Helpers of the model tests: small configs (one for FP64 finite differences, dims free; the tiny
// FP8-capable config from configs/), random batches and host access to parameters.
#pragma once
#include <cstdlib>
#include <random>
#include <string>

#include "fp8moe/model.hpp"
#include "testing.hpp"

namespace fp8moe::testing {

// A config small enough for finite differences in FP64: dims are not multiples of 128 (non-FP8).
inline ModelConfig fd_config() {
  ModelConfig c;
  c.name = "fd";
  c.vocab_size = 48;
  c.hidden_size = 24;
  c.num_hidden_layers = 2;
  c.first_k_dense_replace = 1;
  c.num_attention_heads = 2;
  c.q_lora_rank = 20;
  c.kv_lora_rank = 12;
  c.qk_nope_head_dim = 6;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 6;
  c.intermediate_size = 40;
  c.moe_intermediate_size = 12;
  c.n_routed_experts = 6;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 2;
  c.n_group = 3;
  c.topk_group = 2;
  c.routed_scaling_factor = 1.5;
  c.num_nextn_predict_layers = 1;
  c.mtp_loss_weight = 0.3;
  c.aux_loss_alpha = 0.05;  // large, so that its gradient is checked too
  c.initializer_range = 0.2;  // large weights: a non-trivial function
  c.seq_len = 6;
  c.batch_size = 2;
  return c;
}

// configs/ of the source tree; FP8MOE_SOURCE_DIR in the environment overrides the build's path
// (binaries built on one machine and run from a checkout on another).
inline std::string source_dir() {
  const char* env = std::getenv("FP8MOE_SOURCE_DIR");
  return env ? env : FP8MOE_SOURCE_DIR;
}
inline ModelConfig tiny_config() { return load_config(source_dir() + "/configs/tiny.json"); }

// "<recipe>" or "<recipe>+<attention>" (Recipe::set_attention, e.g. "fp8+bf16").
inline Recipe recipe_of(const std::string& spec) {
  const size_t plus = spec.find('+');
  Recipe r = Recipe::from_name(spec.substr(0, plus));
  if (plus != std::string::npos) r.set_attention(spec.substr(plus + 1));
  return r;
}

// tokens and targets [B, S] i32: targets[t] = tokens[t + 1] inside a sequence.
inline std::pair<Tensor, Tensor> random_batch(std::mt19937_64& rng, const ModelConfig& c) {
  const int64_t B = c.batch_size, S = c.seq_len;
  Tensor tok = Tensor::host(DType::i32, {B, S}), tgt = Tensor::host(DType::i32, {B, S});
  for (int64_t i = 0; i < B * S; ++i) tok.ptr<int32_t>()[i] = int32_t(rng() % uint64_t(c.vocab_size));
  for (int64_t i = 0; i < B * S; ++i)
    tgt.ptr<int32_t>()[i] = (i % S < S - 1) ? tok.ptr<int32_t>()[i + 1] : int32_t(rng() % uint64_t(c.vocab_size));
  return {tok, tgt};
}

// Gradients that move when a token's top-k choice flips between two runs (the router, the norm
// feeding it, the experts): a discontinuity, not precision error, so they are bounded only in bulk.
inline bool routing_sensitive(const std::string& name) {
  return name.find(".experts.") != std::string::npos || name.find("mlp.gate.") != std::string::npos ||
         name.find("post_attention_layernorm") != std::string::npos;
}

}  // namespace fp8moe::testing
