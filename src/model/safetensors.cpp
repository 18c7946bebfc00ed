// Safetensors files (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw little-endian data.
// Used to hand the model's weights (Hugging Face names) to the PyTorch reference and back.
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model_internal.hpp"

namespace fp8moe {

namespace {

const char* st_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    case DType::bf16: return "BF16";
    default: break;
  }
  FP8MOE_CHECK(false, "safetensors: dtype " << dtype_name(t) << " is not supported");
}

DType from_st_dtype(const std::string& s) {
  if (s == "F32") return DType::f32;
  if (s == "F64") return DType::f64;
  if (s == "I32") return DType::i32;
  if (s == "BF16") return DType::bf16;
  FP8MOE_CHECK(false, "safetensors: dtype " << s << " is not supported");
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  size_t off = 0;
  for (const auto& [name, t] : tensors) {
    FP8MOE_CHECK(t.device == Device::cpu && t.is_contiguous(), "safetensors: " << name << " must be a contiguous host tensor");
    std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
    h[name] = {{"dtype", st_dtype(t.dtype)}, {"shape", shape}, {"data_offsets", {off, off + t.nbytes()}}};
    off += t.nbytes();
  }
  h["__metadata__"] = {{"format", "pt"}};
  std::string hs = h.dump();
  hs.append((8 - hs.size() % 8) % 8, ' ');
  std::ofstream f(path, std::ios::binary);
  FP8MOE_CHECK(f.good(), "safetensors: cannot write '" << path << "'");
  const uint64_t n = hs.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(hs.data(), std::streamsize(hs.size()));
  for (const auto& [name, t] : tensors) f.write(static_cast<const char*>(t.data), std::streamsize(t.nbytes()));
  FP8MOE_CHECK(f.good(), "safetensors: write to '" << path << "' failed");
}

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  FP8MOE_CHECK(f.good(), "safetensors: cannot open '" << path << "'");
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  FP8MOE_CHECK(f.good() && n < (1ull << 30), "safetensors: '" << path << "' has a bad header length");
  std::string hs(n, '\0');
  f.read(hs.data(), std::streamsize(n));
  const auto h = nlohmann::json::parse(hs);
  std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::map<std::string, Tensor> out;
  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__") continue;
    const auto shape = v["shape"].get<std::vector<int64_t>>();
    const auto offs = v["data_offsets"].get<std::vector<size_t>>();
    TensorView like(nullptr, from_st_dtype(v["dtype"].get<std::string>()), {1});
    like.ndim = int(shape.size());
    int64_t s = 1;
    for (int d = like.ndim - 1; d >= 0; --d) {
      like.shape[d] = shape[size_t(d)];
      like.strides[d] = s;
      s *= shape[size_t(d)];
    }
    Tensor t = Tensor::host_like(like);
    FP8MOE_CHECK(offs.size() == 2 && offs[1] - offs[0] == t.view().nbytes() && offs[1] <= data.size(),
                 "safetensors: '" << path << "': tensor " << name << " has bad data_offsets");
    std::memcpy(t.ptr<char>(), data.data() + offs[0], t.view().nbytes());
    out.emplace(name, std::move(t));
  }
  return out;
}

void save_safetensors(const std::string& path, Model& model) {
  std::vector<Tensor> host;
  std::vector<std::pair<std::string, TensorView>> list;
  for (auto& p : model.parameters()) host.push_back(model.backend().to_host(p.weight));
  size_t i = 0;
  for (auto& p : model.parameters()) list.emplace_back(p.name, host[i++].view());
  write_safetensors(path, list);
}

void load_safetensors(const std::string& path, Model& model) {
  auto tensors = read_safetensors(path);
  for (auto& p : model.parameters()) {
    auto it = tensors.find(p.name);
    FP8MOE_CHECK(it != tensors.end(), "safetensors: '" << path << "' has no tensor " << p.name);
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
