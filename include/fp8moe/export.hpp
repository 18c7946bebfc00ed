// Exporting a training checkpoint as a Hugging Face DeepSeek-V3 model folder: model.safetensors
// (the checkpoint's parameters, or their EMA, by their Hugging Face names) and config.json.
//   bf16  every tensor in BF16 (but the routing bias, below);
//   fp8   the Linear weights the FP8 recipe runs as FP8 GEMMs (names ending in "_proj.weight") as
//         E4M3 with 128x128 block scales in "<name>_scale_inv" (F32 [ceil(N/128), ceil(K/128)],
//         w ~= q * scale_inv per block: the layout of DeepSeek-V3's released weights, read by its
//         inference code), every other tensor in BF16 but the routing bias
//         (e_score_correction_bias, F32 in both formats); config.json carries DeepSeek-V3's
//         quantization_config (fp8, e4m3, dynamic activations, weight_block_size [128, 128]).
// Optimizer state and the EMA's copies are not exported. The FP8 values and scales are the CPU
// quantizer's (quantize_128x128), bit for bit what the training GEMMs read.
#pragma once
#include <string>

namespace fp8moe {

struct ExportSummary {
  int tensors = 0, fp8_tensors = 0;  // written (scales not counted), of which E4M3
  double bytes = 0;                  // of model.safetensors' tensors
};

// `format`: "bf16" or "fp8"; `ema`: export the parameters' EMA instead of the weights.
ExportSummary export_checkpoint(const std::string& checkpoint_path, const std::string& out_dir,
                                const std::string& format, bool ema);

}  // namespace fp8moe
