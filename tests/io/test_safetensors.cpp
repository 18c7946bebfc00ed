// safetensors: round trip of every dtype, metadata, atomic replacement, and clear errors for
// truncated or corrupt files that leave the previous file intact.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>

#include "fp8moe/safetensors.hpp"
#include "testing.hpp"

using namespace fp8moe;
using fp8moe::testing::expect_error;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir() { return fp8moe::testing::test_dir("fp8moe_st"); }
using fp8moe::testing::read_file;

}  // namespace

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
  auto rng = fp8moe::testing::make_rng();
  fs::path dir = temp_dir();
  Tensor a = fp8moe::testing::random_normal(rng, DType::f32, {3, 5});
  Tensor b = fp8moe::testing::random_normal(rng, DType::bf16, {7});
  Tensor c = Tensor::host(DType::e4m3, {2, 2, 2});
  for (int i = 0; i < 8; ++i) c.ptr<uint8_t>()[i] = uint8_t(i * 17);
  Tensor d = Tensor::host(DType::i64, {2});
  d.ptr<int64_t>()[0] = -5;
  d.ptr<int64_t>()[1] = int64_t(1) << 40;
  const std::string path = (dir / "x.safetensors").string();
  save_safetensors(path, {{"a", a}, {"b.weight", b}, {"c", c}, {"d", d}}, {{"step", "12"}});
  SafetensorsFile f = load_safetensors(path);
  ASSERT_EQ(f.tensors.size(), 4u);
  EXPECT_EQ(f.metadata.at("step"), "12");
  for (auto& [name, t] : std::map<std::string, Tensor>{{"a", a}, {"b.weight", b}, {"c", c}, {"d", d}}) {
    const Tensor& g = f.tensors.at(name);
    EXPECT_EQ(g.view().str(), t.view().str()) << name;
    EXPECT_EQ(std::memcmp(g.view().data, t.view().data, t.view().nbytes()), 0) << name;
  }
  // The header is valid JSON with 8-byte aligned data, as other readers expect.
  std::string raw = read_file(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(raw[size_t(i)])) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(raw[8], '{');
  fs::remove_all(dir);
}

TEST(Safetensors, TruncatedOrCorruptFilesAreRefusedAndThePreviousFileStays) {
  auto rng = fp8moe::testing::make_rng();
  fs::path dir = temp_dir();
  Tensor a = fp8moe::testing::random_normal(rng, DType::f32, {64, 64});
  const std::string path = (dir / "ckpt.safetensors").string();
  save_safetensors(path, {{"a", a}});
  const std::string good = read_file(path);

  const std::string bad = (dir / "bad.safetensors").string();
  auto write_raw = [&](const std::string& bytes) {
    std::ofstream out(bad, std::ios::binary | std::ios::trunc);
    out << bytes;
  };
  write_raw(good.substr(0, good.size() - 100));
  expect_error([&] { load_safetensors(bad); }, "truncated");
  write_raw(good.substr(0, 5));
  expect_error([&] { load_safetensors(bad); }, "no header length");
  std::string flipped = good;
  flipped[flipped.size() - 7] ^= 0x10;
  write_raw(flipped);
  expect_error([&] { load_safetensors(bad); }, "checksum mismatch");
  std::string broken_json = good;
  broken_json[9] = '#';
  write_raw(broken_json);
  expect_error([&] { load_safetensors(bad); }, "corrupt safetensors header");
  expect_error([&] { load_safetensors((dir / "missing").string()); }, "cannot open");

  // A failed write (the folder is gone) raises and leaves nothing under the final name; a
  // successful one replaces the file whole.
  expect_error([&] { save_safetensors((dir / "nope" / "x.safetensors").string(), {{"a", a}}); }, "creating");
  EXPECT_EQ(read_file(path), good);
  Tensor b = fp8moe::testing::random_normal(rng, DType::f32, {4});
  save_safetensors(path, {{"b", b}});
  EXPECT_EQ(load_safetensors(path).tensors.count("b"), 1u);
  for (auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << "temporary file left behind";
  fs::remove_all(dir);
}
