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

// The Linear weights DeepSeek-V3 ships in E4M3 with 128x128 weight_scale_inv blocks: those of
// attention (q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj) and of the MLPs
// and experts (gate_proj, up_proj, down_proj). Its router (mlp.gate) and the MTP layer's eh_proj
// are BF16 there, and so are they here.
bool is_fp8_linear(const std::string& name) {
  return (ends_with(name, "_proj.weight") || ends_with(name, ".kv_a_proj_with_mqa.weight")) &&
         !ends_with(name, ".eh_proj.weight");
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

nlohmann::json hugging_face_config(const ModelConfig& c, const std::string& format) {
  nlohmann::json cfg = nlohmann::json::parse(config_to_json(c));
  // The keys of DeepSeek-V3's own config.json beyond the shape, with the values the mini model
  // implements: loaders (transformers' DeepseekV3Config, vLLM, SGLang) read them.
  cfg["architectures"] = {"DeepseekV3ForCausalLM"};
  cfg["model_type"] = "deepseek_v3";
  cfg["torch_dtype"] = "bfloat16";
  cfg["hidden_act"] = "silu";
  cfg["num_key_value_heads"] = c.num_attention_heads;
  cfg["topk_method"] = "noaux_tc";
  cfg["scoring_func"] = "sigmoid";
  cfg["seq_aux"] = true;
  cfg["moe_layer_freq"] = 1;
  cfg["ep_size"] = 1;
  cfg["attention_bias"] = false;
  cfg["attention_dropout"] = 0.0;
  cfg["pretraining_tp"] = 1;
  cfg["tie_word_embeddings"] = false;
  cfg["use_cache"] = true;
  cfg["rope_scaling"] = nullptr;  // RoPE without YaRN: the mini model trains at its full length
  // The byte vocabulary has no special tokens.
  cfg["bos_token_id"] = nullptr;
  cfg["eos_token_id"] = nullptr;
  if (c.q_lora_rank == 0) cfg["q_lora_rank"] = nullptr;  // Hugging Face's spelling of "no query compression"
  if (format == "fp8")
    cfg["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                  {"weight_block_size", {128, 128}}};
  return cfg;
}

nlohmann::json byte_tokenizer_json() {
  // GPT-2's byte-to-character map, which the ByteLevel pre-tokenizer and decoder apply: printable
  // bytes stand for themselves, the others for the characters from U+0100 on, in byte order.
  nlohmann::json vocab = nlohmann::json::object();
  int shifted = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    const uint32_t cp = printable ? uint32_t(b) : uint32_t(256 + shifted++);
    std::string utf8;
    if (cp < 0x80) {
      utf8 = char(cp);
    } else {
      utf8 += char(0xC0 | (cp >> 6));
      utf8 += char(0x80 | (cp & 0x3F));
    }
    vocab[utf8] = b;  // token id = byte value, as the trainer's
  }
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                                     {"use_regex", false}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", nlohmann::json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"vocab", vocab},
            {"merges", nlohmann::json::array()}}}};
}

nlohmann::json byte_tokenizer_config(const ModelConfig& c) {
  return {{"tokenizer_class", "PreTrainedTokenizerFast"}, {"model_max_length", c.max_position_embeddings},
          {"add_bos_token", false}, {"add_eos_token", false}, {"clean_up_tokenization_spaces", false},
          {"bos_token", nullptr}, {"eos_token", nullptr}, {"pad_token", nullptr}, {"unk_token", nullptr}};
}

void check_export_folder(const std::string& out_dir, bool overwrite) {
  std::error_code ec;
  const fs::path out(out_dir);
  FP8MOE_CHECK(!fs::exists(out, ec) || fs::is_directory(out, ec), "export: --out '" << out_dir << "' is a file, not a folder");
  for (const char* f : {"model.safetensors", "config.json"})
    FP8MOE_CHECK(overwrite || !fs::exists(out / f, ec),
                 "export: --out '" << out_dir << "' already holds an export (" << f
                                   << "): --overwrite replaces it, or choose another --out");
}

ExportSummary export_checkpoint(const std::string& checkpoint_path, const std::string& out_dir,
                                const std::string& format, bool ema, bool overwrite) {
  FP8MOE_CHECK(format == "bf16" || format == "fp8", "export: unknown format '" << format << "' (expected bf16 or fp8)");
  check_export_folder(out_dir, overwrite);
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
    if (format == "fp8" && w.ndim == 2 && is_fp8_linear(name)) {
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

  const ModelConfig model_cfg = config_from_json(cfg_it->second);
  const std::map<std::string, std::string> files{
      {"config.json", hugging_face_config(model_cfg, format).dump(2) + "\n"},
      {"tokenizer.json", byte_tokenizer_json().dump(2) + "\n"},
      {"tokenizer_config.json", byte_tokenizer_config(model_cfg).dump(2) + "\n"}};
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw IoError("export: cannot create the output folder '" + out_dir + "': " + ec.message());
  save_safetensors((fs::path(out_dir) / "model.safetensors").string(), out, {{"format", "pt"}});
  for (const auto& [name, text] : files) write_file_atomic((fs::path(out_dir) / name).string(), text);
  return sum;
}

}  // namespace fp8moe
