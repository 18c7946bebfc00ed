// Exporting a training checkpoint as a Hugging Face DeepSeek-V3 model folder, in DeepSeek-V3's own
// layout: model.safetensors (the checkpoint's parameters, or their EMA, by their Hugging Face
// names), config.json (DeepSeek-V3's keys), tokenizer.json and tokenizer_config.json (the
// byte-level vocabulary: token id = byte value, as the trainer reads text).
//   bf16  every tensor in BF16 (but the routing bias, below);
//   fp8   the Linear weights DeepSeek-V3 ships in E4M3 (q_a_proj, q_b_proj or q_proj,
//         kv_a_proj_with_mqa, kv_b_proj, o_proj and every gate/up/down_proj; not the router
//         mlp.gate nor the MTP layer's eh_proj) as E4M3 with 128x128 block scales in
//         "<name>_scale_inv" (F32 [ceil(N/128), ceil(K/128)], w ~= q * scale_inv per block: the
//         layout of DeepSeek-V3's released weights, read by its inference code; kv_a_proj_with_mqa
//         of DeepSeek-V3 is [576, 7168] with a [5, 56] scale), every other tensor in BF16 but the
//         routing bias
//         (e_score_correction_bias, F32 in both formats); config.json carries DeepSeek-V3's
//         quantization_config (fp8, e4m3, dynamic activations, weight_block_size [128, 128]).
// Optimizer state and the EMA's copies are not exported. The FP8 values and scales are the CPU
// quantizer's (quantize_128x128), bit for bit what the training GEMMs read.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "fp8moe/config.hpp"

namespace fp8moe {

struct ExportSummary {
  int tensors = 0, fp8_tensors = 0;  // written (scales not counted), of which E4M3
  double bytes = 0;                  // of model.safetensors' tensors
};

// `format`: "bf16" or "fp8"; `ema`: export the parameters' EMA instead of the weights. A folder
// that already holds an export is refused unless `overwrite`; nothing is written before the
// checkpoint has been read and converted whole.
ExportSummary export_checkpoint(const std::string& checkpoint_path, const std::string& out_dir,
                                const std::string& format, bool ema, bool overwrite = false);

// The pieces of the folder: config.json for `format`, and the byte-level tokenizer's files.
nlohmann::json hugging_face_config(const ModelConfig& cfg, const std::string& format);
nlohmann::json byte_tokenizer_json();
nlohmann::json byte_tokenizer_config(const ModelConfig& cfg);
// Refuses an `out_dir` that is a file or already holds an export (unless `overwrite`).
void check_export_folder(const std::string& out_dir, bool overwrite);

}  // namespace fp8moe
