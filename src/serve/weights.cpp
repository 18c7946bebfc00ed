// Weight loading for inference (weights.hpp).
#include "serve/weights.hpp"

#include <algorithm>
#include <cmath>
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

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A uniform in (0, 1] from 53 bits of a hash.
double unit(uint64_t h) { return (double(h >> 11) + 1.0) * 0x1.0p-53; }

}  // namespace

WeightSet random_weights(const ModelConfig& cfg, uint64_t seed) {
  WeightSet w;
  w.cfg = cfg;
  w.recipe = "fp32";
  w.format = "f32";
  const double sd = cfg.initializer_range;
  uint64_t stream = splitmix64(seed);
  for (const model::ParamSpec& s : model::parameter_specs(cfg)) {
    Tensor t = s.shape.size() == 1 ? Tensor::host(DType::f32, {s.shape[0]}) : Tensor::host(DType::f32, {s.shape[0], s.shape[1]});
    float* v = t.ptr<float>();
    const int64_t n = t.numel();
    stream = splitmix64(stream);
    if (s.init == model::ParamSpec::normal) {
      const uint64_t base = stream;
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < n; ++j) {  // Box-Muller on two hashes of the element's index
        const double r = std::sqrt(-2.0 * std::log(unit(splitmix64(base ^ (2 * uint64_t(j))))));
        v[j] = float(sd * r * std::cos(6.283185307179586 * unit(splitmix64(base ^ (2 * uint64_t(j) + 1)))));
      }
    } else {
      std::fill(v, v + n, s.init == model::ParamSpec::ones ? 1.0f : 0.0f);
    }
    w.tensors.emplace(s.name, std::move(t));
  }
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
