// Element types of fp8moe tensors and where a tensor lives.
// Storage: e4m3/e5m2/ue8m0 one byte; bf16 two bytes (raw bits); e5m6 two bytes (low 12 bits used,
// see codecs.hpp); f32, f64, i32 native.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fp8moe {

enum class DType : uint8_t { f32, f64, bf16, e4m3, e5m2, e5m6, ue8m0, i32, i64, u8 };
enum class Device : uint8_t { cpu, cuda };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::e5m6: return 2;
    case DType::e4m3: case DType::e5m2: case DType::ue8m0: case DType::u8: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::e4m3: return "e4m3";
    case DType::e5m2: return "e5m2";
    case DType::e5m6: return "e5m6";
    case DType::ue8m0: return "ue8m0";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

constexpr std::string_view device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

}  // namespace fp8moe
