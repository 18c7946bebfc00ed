// safetensors files: the checkpoint and export format (Hugging Face's layout, so DeepSeek-V3
// tooling reads our weights). An 8-byte little-endian header length, a JSON header
// {"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the raw tensor bytes. Writes are atomic: a temporary file in the same folder, fsync, rename,
// fsync of the folder, so a crash never leaves a half-written file under the final name.
// Reads validate everything (header length, JSON, dtypes, offsets inside the file, no overlaps,
// total size, and the CRC-32 of the data when the writer stored one) and raise fp8moe::Error naming
// the file and the problem.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fp8moe/tensor.hpp"

namespace fp8moe {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // host tensors, by name
  std::map<std::string, std::string> metadata;
};

// Writes host tensors (any of f32, f64, bf16, e4m3, e5m2, i32, i64, u8) atomically to `path`.
// A "crc32" metadata entry over the data section is added.
void save_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
SafetensorsFile load_safetensors(const std::string& path);

// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync folder).
void write_file_atomic(const std::string& path, const std::string& bytes);

uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

}  // namespace fp8moe
