// Checkpoint export to a Hugging Face DeepSeek-V3 folder (include/fp8moe/export.hpp).
#include "fp8moe/export.hpp"

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "fp8moe/codecs.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/quantize.hpp"
#include "fp8moe/safetensors.hpp"

namespace fp8moe {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The checkpoint's own tensors: parameters (not "ema." or "optimizer." entries).
bool is_parameter(const std::string& name) {
  return name.rfind("ema.", 0) != 0 && name.rfind("optimizer.", 0) != 0;
}

Tensor to_bf16_host(const TensorView& x) {
  Tensor o = x.ndim == 1 ? Tensor::host(DType::bf16, {x.shape[0]}) : Tensor::host(DType::bf16, {x.shape[0], x.shape[1]});
  uint16_t* p = o.ptr<uint16_t>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = bf16_encode(float(load_float(x, i)));
  return o;
}

}  // namespace

ExportSummary export_checkpoint(const std::string& checkpoint_path, const std::string& out_dir,
                                const std::string& format, bool ema) {
  FP8MOE_CHECK(format == "bf16" || format == "fp8", "export: unknown format '" << format << "' (expected bf16 or fp8)");
  const SafetensorsFile ckpt = load_safetensors(checkpoint_path);
  const auto fmt = ckpt.metadata.find("format");
  FP8MOE_CHECK(fmt != ckpt.metadata.end() && fmt->second == "fp8moe-checkpoint-1",
               checkpoint_path << ": not an fp8moe checkpoint (no format fp8moe-checkpoint-1 in its metadata)");
  const auto cfg_it = ckpt.metadata.find("model_config");
  FP8MOE_CHECK(cfg_it != ckpt.metadata.end(), checkpoint_path << ": checkpoint metadata lacks 'model_config'");

  std::vector<Tensor> keep;  // the converted tensors, alive until written
  std::map<std::string, TensorView> out;
  ExportSummary sum;
  for (const auto& entry : ckpt.tensors) {
    const std::string& name = entry.first;
    if (!is_parameter(name)) continue;
    const std::string src = ema ? "ema." + name : name;
    const auto it = ckpt.tensors.find(src);
    FP8MOE_CHECK(it != ckpt.tensors.end(), checkpoint_path << ": checkpoint lacks '" << src << "'");
    const TensorView& w = it->second.view();
    FP8MOE_CHECK(w.ndim == 1 || w.ndim == 2, checkpoint_path << ": tensor '" << src << "' is " << w.str()
                                                             << " (the model's are 1-D or 2-D)");
    if (format == "fp8" && w.ndim == 2 && ends_with(name, "_proj.weight")) {
      FP8MOE_CHECK(w.dtype == DType::f32 || w.dtype == DType::bf16,
                   checkpoint_path << ": FP8 export quantizes f32 or bf16 weights, '" << src << "' is " << w.str());
      QuantizedTensor q = make_quantized_host(w.shape[0], w.shape[1], DType::e4m3, ScaleKind::block_128x128);
      quantize_128x128(w, q, ScaleMode::fp32);
      keep.push_back(q.values);
      keep.push_back(q.scales);
      out[name] = q.values.view();
      out[name + "_scale_inv"] = q.scales.view();
      sum.fp8_tensors += 1;
      sum.bytes += double(q.values.view().nbytes() + q.scales.view().nbytes());
    } else if (ends_with(name, "e_score_correction_bias")) {
      // The routing bias stays F32, as in DeepSeek-V3's released weights: it only moves by
      // bias_update_speed steps, which BF16 would round away.
      FP8MOE_CHECK(w.dtype == DType::f32, checkpoint_path << ": '" << src << "' is " << w.str() << ", expected f32");
      out[name] = w;
      sum.bytes += double(w.nbytes());
    } else {
      keep.push_back(to_bf16_host(w));
      out[name] = keep.back().view();
      sum.bytes += double(keep.back().view().nbytes());
    }
    sum.tensors += 1;
  }
  FP8MOE_CHECK(sum.tensors > 0, checkpoint_path << ": checkpoint holds no parameters");

  nlohmann::json cfg = nlohmann::json::parse(config_to_json(config_from_json(cfg_it->second)));
  cfg["architectures"] = {"DeepseekV3ForCausalLM"};
  cfg["model_type"] = "deepseek_v3";
  cfg["torch_dtype"] = "bfloat16";
  if (format == "fp8")
    cfg["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                  {"weight_block_size", {128, 128}}};
  fs::create_directories(out_dir);
  save_safetensors((fs::path(out_dir) / "model.safetensors").string(), out, {{"format", "pt"}});
  write_file_atomic((fs::path(out_dir) / "config.json").string(), cfg.dump(2) + "\n");
  return sum;
}

}  // namespace fp8moe
