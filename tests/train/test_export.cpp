// export_checkpoint (fp8moe/export.hpp): the FP8 format's E4M3 Linear weights and their
// weight_scale_inv blocks bit for bit the CPU quantizer's, BF16 and F32 for the rest, the EMA on
// request, no optimizer state, config.json, and clear errors.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fp8moe/codecs.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/export.hpp"
#include "fp8moe/quantize.hpp"
#include "fp8moe/safetensors.hpp"
#include "testing.hpp"

using namespace fp8moe;
using fp8moe::testing::expect_error;
using fp8moe::testing::make_rng;
using fp8moe::testing::random_normal;
using fp8moe::testing::test_dir;
namespace fs = std::filesystem;

namespace {

const std::string kQa = "model.layers.0.self_attn.q_a_proj.weight";  // [200, 256]: a partial 128-row block
const std::string kNorm = "model.norm.weight";
const std::string kBias = "model.layers.1.mlp.gate.e_score_correction_bias";

struct Checkpoint {
  fs::path dir, path;
  std::map<std::string, Tensor> t;  // the checkpoint's tensors
};

Checkpoint make_checkpoint() {
  Checkpoint c;
  c.dir = test_dir("fp8moe_export");
  c.path = c.dir / "checkpoint.safetensors";
  auto rng = make_rng();
  for (const std::string& p : {std::string(""), std::string("ema.")}) {
    c.t[p + kQa] = random_normal(rng, DType::f32, {200, 256}, 0.05f);
    c.t[p + kNorm] = random_normal(rng, DType::f32, {64});
    c.t[p + kBias] = random_normal(rng, DType::f32, {8}, 1e-3f);
  }
  c.t["optimizer.exp_avg." + kQa] = random_normal(rng, DType::bf16, {200, 256});
  std::map<std::string, TensorView> views;
  for (auto& [n, t] : c.t) views[n] = t.view();
  const ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  save_safetensors(c.path.string(), views, {{"format", "fp8moe-checkpoint-1"}, {"model_config", config_to_json(cfg)}});
  return c;
}

void expect_bytes(const Tensor& got, const void* want, size_t n, const std::string& what) {
  ASSERT_EQ(got.view().nbytes(), n) << what;
  EXPECT_EQ(std::memcmp(got.view().data, want, n), 0) << what;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

}  // namespace

TEST(Export, Fp8LinearWeightsWithTheirScalesTheRestBf16) {
  const Checkpoint c = make_checkpoint();
  const ExportSummary s = export_checkpoint(c.path.string(), (c.dir / "hf").string(), "fp8", false);
  EXPECT_EQ(s.tensors, 3);
  EXPECT_EQ(s.fp8_tensors, 1);
  const SafetensorsFile f = load_safetensors((c.dir / "hf" / "model.safetensors").string());
  EXPECT_EQ(f.tensors.size(), 4u);  // q_a, its scale_inv, the norm, the bias: no ema., no optimizer.

  QuantizedTensor want = make_quantized_host(200, 256, DType::e4m3, ScaleKind::block_128x128);
  quantize_128x128(c.t.at(kQa).view(), want, ScaleMode::fp32);
  const Tensor& q = f.tensors.at(kQa);
  const Tensor& si = f.tensors.at(kQa + "_scale_inv");
  EXPECT_EQ(q.dtype(), DType::e4m3);
  EXPECT_EQ(si.dtype(), DType::f32);
  EXPECT_EQ(si.size(0), 2);
  EXPECT_EQ(si.size(1), 2);
  expect_bytes(q, want.values.view().data, want.values.view().nbytes(), "q_a values");
  expect_bytes(si, want.scales.view().data, want.scales.view().nbytes(), "q_a weight_scale_inv");

  const Tensor& norm = f.tensors.at(kNorm);
  ASSERT_EQ(norm.dtype(), DType::bf16);
  for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(norm.ptr<uint16_t>()[i], bf16_encode(c.t.at(kNorm).ptr<float>()[i]));
  expect_bytes(f.tensors.at(kBias), c.t.at(kBias).view().data, 8 * 4, "routing bias, F32");

  const nlohmann::json cfg = read_json(c.dir / "hf" / "config.json");
  EXPECT_EQ(cfg.at("model_type"), "deepseek_v3");
  EXPECT_EQ(cfg.at("quantization_config").at("weight_block_size"), nlohmann::json({128, 128}));
  EXPECT_EQ(cfg.at("quantization_config").at("fmt"), "e4m3");
  EXPECT_EQ(cfg.at("hidden_size"), load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json").hidden_size);
  fs::remove_all(c.dir);
}

TEST(Export, Bf16OfTheEma) {
  const Checkpoint c = make_checkpoint();
  export_checkpoint(c.path.string(), (c.dir / "hf").string(), "bf16", true);
  const SafetensorsFile f = load_safetensors((c.dir / "hf" / "model.safetensors").string());
  EXPECT_EQ(f.tensors.size(), 3u);
  const Tensor& qa = f.tensors.at(kQa);
  ASSERT_EQ(qa.dtype(), DType::bf16);
  const float* ema = c.t.at("ema." + kQa).ptr<float>();
  for (int64_t i = 0; i < 200 * 256; i += 97) EXPECT_EQ(qa.ptr<uint16_t>()[i], bf16_encode(ema[i]));
  expect_bytes(f.tensors.at(kBias), c.t.at("ema." + kBias).view().data, 8 * 4, "EMA routing bias");
  EXPECT_FALSE(read_json(c.dir / "hf" / "config.json").contains("quantization_config"));
  fs::remove_all(c.dir);
}

TEST(Export, BadInputIsRefusedWithAClearError) {
  const Checkpoint c = make_checkpoint();
  expect_error([&] { export_checkpoint(c.path.string(), (c.dir / "x").string(), "int4", false); },
               "unknown format 'int4' (expected bf16 or fp8)");
  const fs::path other = c.dir / "other.safetensors";
  const Tensor t = Tensor::host(DType::f32, {4});
  save_safetensors(other.string(), {{"w", t.view()}});
  expect_error([&] { export_checkpoint(other.string(), (c.dir / "x").string(), "fp8", false); },
               "not an fp8moe checkpoint");
  EXPECT_FALSE(fs::exists(c.dir / "x"));
  fs::remove_all(c.dir);
}
