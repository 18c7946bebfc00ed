// Weights for inference, by their DeepSeek-V3 Hugging Face names, from the three places a model
// lives: a training checkpoint (fp8moe train), an exported Hugging Face folder (fp8moe export:
// E4M3 weights with "<name>_scale_inv" 128x128 block scales, or BF16), or a Model in memory (tests).
// No optimizer state, no gradients, no EMA copies are read.
//   auto w = fp8moe::serve::load_checkpoint_weights("runs/tiny/checkpoint.safetensors");
//   auto w = fp8moe::serve::load_hf_weights("out/hf");   // config.json + model.safetensors
#pragma once
#include <map>
#include <string>

#include "fp8moe/config.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::serve {

struct WeightSet {
  ModelConfig cfg;
  // Host or backend tensors: f32 | bf16, or e4m3 with the block scales under "<name>_scale_inv"
  // ([ceil(N/128), ceil(K/128)] f32, w ~= q * scale_inv: quantize.hpp's block_128x128 layout).
  std::map<std::string, Tensor> tensors;
  std::string recipe;  // the training recipe where known ("fp8", "bf16", "fp32"), else ""
  std::string format;  // "f32" (checkpoint, Model), "bf16" or "fp8" (exported folder)
};

// A checkpoint written by the trainer (metadata format fp8moe-checkpoint-1, model_config, recipe).
WeightSet load_checkpoint_weights(const std::string& path);
// An exported folder: config.json and model.safetensors.
WeightSet load_hf_weights(const std::string& folder);
// The model's master weights, shared (no copy).
WeightSet weights_of(Model& model);
// Random weights of cfg's shapes as host f32 tensors (format "f32"), for benchmarks: the
// parameter list's initialization (normal: N(0, initializer_range), norms ones, biases zeros)
// drawn from a counter-based generator in parallel, so a DeepSeek-V3-sized layer takes seconds
// where Model's sequential draws take minutes. Not Model's values for the same seed.
WeightSet random_weights(const ModelConfig& cfg, uint64_t seed);

}  // namespace fp8moe::serve
