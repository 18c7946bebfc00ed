// safetensors reader and atomic writer (see include/fp8moe/safetensors.hpp).
#include "fp8moe/safetensors.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace fp8moe {

namespace {

const std::map<DType, std::string>& dtype_names() {
  static const std::map<DType, std::string> names{
      {DType::f32, "F32"},     {DType::f64, "F64"},     {DType::bf16, "BF16"}, {DType::e4m3, "F8_E4M3"},
      {DType::e5m2, "F8_E5M2"}, {DType::i32, "I32"},    {DType::i64, "I64"},   {DType::u8, "U8"}};
  return names;
}

DType dtype_from_name(const std::string& name, const std::string& path, const std::string& tensor) {
  for (auto& [d, n] : dtype_names())
    if (n == name) return d;
  FP8MOE_CHECK(false, path << ": tensor '" << tensor << "' has unsupported dtype '" << name << "'");
}

void check_errno(bool ok, const std::string& what, const std::string& path) {
  if (!ok) throw IoError(what + " '" + path + "' failed: " + std::strerror(errno));
}

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp = (dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  check_errno(fd >= 0, "creating", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      errno = e;
      check_errno(false, "writing", tmp);
    }
    done += size_t(w);
  }
  bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) {
    ::unlink(tmp.c_str());
    check_errno(false, "fsync of", tmp);
  }
  check_errno(::rename(tmp.c_str(), path.c_str()) == 0, "renaming to", path);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void save_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (auto& [name, t] : tensors) {
    FP8MOE_CHECK(name != "__metadata__", "safetensors: tensor name '__metadata__' is reserved");
    FP8MOE_CHECK(t.device == Device::cpu && t.is_contiguous() && t.data != nullptr,
                 "safetensors: tensor '" << name << "' must be a contiguous host tensor, got " << t.str());
    auto it = dtype_names().find(t.dtype);
    FP8MOE_CHECK(it != dtype_names().end(), "safetensors: tensor '" << name << "' has unsupported dtype " << dtype_name(t.dtype));
    std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
    header[name] = {{"dtype", it->second}, {"shape", shape}, {"data_offsets", {data.size(), data.size() + t.nbytes()}}};
    data.append(static_cast<const char*>(t.data), t.nbytes());
  }
  nlohmann::json meta = nlohmann::json::object();
  for (auto& [k, v] : metadata) meta[k] = v;
  meta["crc32"] = std::to_string(crc32(data.data(), data.size()));
  header["__metadata__"] = meta;
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // data section 8-byte aligned, as the format recommends
  std::string file(8, '\0');
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char((n >> (8 * i)) & 0xFF);
  file += h;
  file += data;
  write_file_atomic(path, file);
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FP8MOE_CHECK(in.good(), path << ": cannot open");
  std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  FP8MOE_CHECK(file.size() >= 8, path << ": corrupt safetensors file (" << file.size() << " bytes, no header length)");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(file[size_t(i)])) << (8 * i);
  FP8MOE_CHECK(n <= file.size() - 8, path << ": corrupt safetensors file (header length " << n << " exceeds file size "
                                          << file.size() << "; truncated?)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(file.substr(8, n));
  } catch (const std::exception& e) {
    FP8MOE_CHECK(false, path << ": corrupt safetensors header: " << e.what());
  }
  FP8MOE_CHECK(header.is_object(), path << ": corrupt safetensors header (not a JSON object)");
  const size_t base = 8 + n, data_size = file.size() - base;
  SafetensorsFile out;
  if (header.contains("__metadata__"))
    for (auto& [k, v] : header["__metadata__"].items()) out.metadata[k] = v.get<std::string>();
  size_t covered = 0;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      DType dtype = dtype_from_name(info.at("dtype").get<std::string>(), path, name);
      std::vector<int64_t> shape = info.at("shape").get<std::vector<int64_t>>();
      auto offs = info.at("data_offsets").get<std::vector<uint64_t>>();
      FP8MOE_CHECK(shape.size() <= size_t(kMaxDims), path << ": tensor '" << name << "' has " << shape.size() << " dims");
      FP8MOE_CHECK(offs.size() == 2 && offs[0] <= offs[1] && offs[1] <= data_size,
                   path << ": tensor '" << name << "' data offsets out of range (data section " << data_size
                        << " bytes; truncated file?)");
      TensorView v(nullptr, dtype, {});
      v.ndim = int(shape.size());
      for (size_t d = 0; d < shape.size(); ++d) v.shape[d] = shape[d];
      FP8MOE_CHECK(offs[1] - offs[0] == v.nbytes(), path << ": tensor '" << name << "' has " << offs[1] - offs[0]
                                                         << " bytes, its shape needs " << v.nbytes());
      Tensor t = Tensor::host_like(v);
      std::memcpy(t.view().data, file.data() + base + offs[0], v.nbytes());
      out.tensors.emplace(name, std::move(t));
      covered += v.nbytes();
    } catch (const nlohmann::json::exception& e) {
      FP8MOE_CHECK(false, path << ": corrupt entry for tensor '" << name << "': " << e.what());
    }
  }
  FP8MOE_CHECK(covered == data_size, path << ": data section has " << data_size << " bytes, tensors cover " << covered
                                          << " (truncated or overlapping)");
  if (auto it = out.metadata.find("crc32"); it != out.metadata.end()) {
    uint32_t got = crc32(file.data() + base, data_size);
    FP8MOE_CHECK(std::to_string(got) == it->second, path << ": checksum mismatch (stored " << it->second << ", data "
                                                         << got << "): the file is corrupt");
  }
  return out;
}

}  // namespace fp8moe
