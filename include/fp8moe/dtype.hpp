// Element types of fp8moe tensors and where a tensor lives.
// Storage: e4m3/e5m2/ue8m0 one byte; bf16 two bytes (raw bits); e5m6 packed, 12 bits per value,
// two values in three bytes (codecs.hpp: e5m6_store/e5m6_load); f32, f64, i32 native.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fp8moe {

enum class DType : uint8_t { f32, f64, bf16, e4m3, e5m2, e5m6, ue8m0, i32, i64, u8 };
enum class Device : uint8_t { cpu, cuda };

// Bytes of one element as ops address it. E5M6 has no byte address of its own (packed two in three
// bytes): 2 here is its unpacked code (a uint16, low 12 bits), the size of a register copy; its
// tensors' storage is dtype_bytes and its elements are read and written through the codecs.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::e5m6: return 2;
    case DType::e4m3: case DType::e5m2: case DType::ue8m0: case DType::u8: return 1;
  }
  return 0;
}

// Storage of n contiguous elements: n * dtype_size, but (3n + 1) / 2 for packed E5M6 (the last
// value of an odd count takes two bytes, the upper four bits zero).
constexpr size_t dtype_bytes(DType t, int64_t n) {
  return t == DType::e5m6 ? size_t(3 * n + 1) / 2 : size_t(n) * dtype_size(t);
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
