// Weight loading for inference (weights.hpp).
#include "serve/weights.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "fp8moe/error.hpp"
#include "fp8moe/safetensors.hpp"

namespace fp8moe::serve {

namespace fs = std::filesystem;

WeightSet load_checkpoint_weights(const std::string& path) {
  SafetensorsFile f = load_safetensors(path);
  const auto meta = [&](const char* key) {
    const auto it = f.metadata.find(key);
    FP8MOE_CHECK(it != f.metadata.end(), path << ": checkpoint metadata lacks '" << key
                                              << "' (expected a checkpoint written by fp8moe train)");
    return it->second;
  };
  FP8MOE_CHECK(meta("format") == "fp8moe-checkpoint-1",
               path << ": format '" << meta("format") << "', expected fp8moe-checkpoint-1");
  WeightSet w;
  w.cfg = config_from_json(meta("model_config"));
  w.recipe = meta("recipe");
  w.format = "f32";
  for (auto& [name, t] : f.tensors)
    if (name.rfind("ema.", 0) != 0 && name.rfind("optimizer.", 0) != 0) w.tensors.emplace(name, std::move(t));
  return w;
}

WeightSet load_hf_weights(const std::string& folder) {
  const fs::path cfg_path = fs::path(folder) / "config.json", st_path = fs::path(folder) / "model.safetensors";
  FP8MOE_CHECK(fs::is_regular_file(cfg_path), "--hf " << folder << ": no config.json (expected a folder written by fp8moe export)");
  FP8MOE_CHECK(fs::is_regular_file(st_path), "--hf " << folder << ": no model.safetensors");
  std::ifstream in(cfg_path);
  std::stringstream ss;
  ss << in.rdbuf();
  WeightSet w;
  w.cfg = config_from_json(ss.str());
  w.recipe = ss.str().find("quantization_config") != std::string::npos ? "fp8" : "bf16";
  w.format = w.recipe;
  w.tensors = load_safetensors(st_path.string()).tensors;
  return w;
}

WeightSet weights_of(Model& model) {
  WeightSet w;
  w.cfg = model.config();
  w.recipe = model.recipe().name;
  w.format = "f32";
  for (Parameter& p : model.parameters()) w.tensors.emplace(p.name, p.weight);
  return w;
}

}  // namespace fp8moe::serve
