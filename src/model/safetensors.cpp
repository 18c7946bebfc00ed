// The model's parameters in a safetensors file by their Hugging Face names (the format:
// include/fp8moe/safetensors.hpp), for the PyTorch reference (tests/reference/) and back.
#include "fp8moe/safetensors.hpp"

#include "model_internal.hpp"

namespace fp8moe {

void save_safetensors(const std::string& path, Model& model) {
  std::vector<Tensor> host;
  std::map<std::string, TensorView> tensors;
  for (auto& p : model.parameters()) {
    host.push_back(model.backend().to_host(p.weight));
    tensors[p.name] = host.back().view();
  }
  save_safetensors(path, tensors);
}

void load_safetensors(const std::string& path, Model& model) {
  const SafetensorsFile f = load_safetensors(path);
  for (auto& p : model.parameters()) {
    auto it = f.tensors.find(p.name);
    FP8MOE_CHECK(it != f.tensors.end(), "safetensors: '" << path << "' has no tensor " << p.name);
    const TensorView& w = p.weight.view();
    FP8MOE_CHECK(it->second.numel() == w.numel() && it->second.view().ndim == w.ndim,
                 "safetensors: " << p.name << " is " << it->second.view().str() << ", the model needs " << w.str());
    if (it->second.dtype() == w.dtype) {
      model.backend().copy(w, it->second.view());
    } else {
      Tensor c = Tensor::host_like(w);
      for (int64_t j = 0; j < c.numel(); ++j) store_float(c.view(), j, load_float(it->second.view(), j));
      model.backend().copy(w, c.view());
    }
  }
}

}  // namespace fp8moe
