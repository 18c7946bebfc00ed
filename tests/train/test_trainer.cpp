// The trainer end to end on a tiny model: the loss falls, a resumed run reproduces the losses of
// an uninterrupted one bit for bit, a truncated checkpoint is refused with the previous one
// intact, and a non-finite loss stops the run naming the step and saving nothing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fp8moe/safetensors.hpp"
#include "fp8moe/trainer.hpp"
#include "testing.hpp"

using namespace fp8moe;
namespace fs = std::filesystem;

namespace {

fs::path scratch() { return fp8moe::testing::test_dir("fp8moe_trainer"); }
using fp8moe::testing::read_file;

// A small English-like corpus made on the spot (the tests do not rely on the default corpus).
std::string make_corpus(const fs::path& dir) {
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "cat", "sleeps", "in", "sun"};
  std::ofstream out(dir / "corpus.txt");
  uint64_t x = 12345;
  for (int i = 0; i < 60000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    out << words[(x >> 33) % 14] << ((x >> 20) % 9 == 0 ? ".\n" : " ");
  }
  return (dir / "corpus.txt").string();
}

TrainOptions tiny_options(const fs::path& dir) {
  TrainOptions o;
  o.model_config = std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json";
  o.recipe = "fp8";
  o.backend = "cpu";
  o.data = make_corpus(dir);
  o.out_dir = (dir / "run").string();
  o.steps = 8;
  o.batch_size = 2;
  o.seq_len = 64;
  o.eval_every = 4;
  o.eval_batches = 2;
  o.ckpt_every = 100;
  o.quiet = true;
  o.lr = 3e-3f;
  return o;
}

std::vector<nlohmann::json> read_metrics(const std::string& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(fs::path(dir) / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST(Trainer, LossFallsAndResumeIsBitIdentical) {
  fs::path dir = scratch();
  TrainOptions a = tiny_options(dir);
  TrainSummary sa = Trainer(a).run();
  auto ma = read_metrics(a.out_dir);
  ASSERT_EQ(ma.size(), 8u);
  EXPECT_LT(ma.back()["loss"].get<double>(), ma.front()["loss"].get<double>() - 0.5) << "loss did not fall";
  EXPECT_EQ(sa.steps, 8);

  TrainOptions b = a;
  b.out_dir = (dir / "resumed").string();
  b.stop_at = 3;
  EXPECT_EQ(Trainer(b).run().steps, 3);
  b.stop_at = 0;
  b.resume = true;
  Trainer(b).run();
  auto mb = read_metrics(b.out_dir);
  ASSERT_EQ(mb.size(), ma.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i]["loss"].get<double>(), mb[i]["loss"].get<double>()) << "step " << i;
    EXPECT_EQ(ma[i].contains("val_loss"), mb[i].contains("val_loss"));
    if (ma[i].contains("val_loss")) {
      EXPECT_EQ(ma[i]["val_loss"].get<double>(), mb[i]["val_loss"].get<double>());
    }
  }
  // The checkpoints of the two runs hold the same weights.
  auto ca = load_safetensors((fs::path(a.out_dir) / "checkpoint.safetensors").string());
  auto cb = load_safetensors((fs::path(b.out_dir) / "checkpoint.safetensors").string());
  ASSERT_EQ(ca.tensors.size(), cb.tensors.size());
  for (auto& [name, t] : ca.tensors)
    EXPECT_EQ(std::memcmp(t.view().data, cb.tensors.at(name).view().data, t.view().nbytes()), 0) << name;
  // The attention precision belongs to the run: resuming with another is refused, and it moves the
  // first loss (same weights and batch) by BF16 rounding only.
  TrainOptions c = b;
  c.attention = "bf16";
  try {
    Trainer(c).run();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("trained with --attention exact, this run asks for bf16"), std::string::npos)
        << e.what();
  }
  TrainOptions d = a;
  d.out_dir = (dir / "attention_bf16").string();
  d.attention = "bf16";
  d.steps = 1;
  Trainer(d).run();
  const double l0 = ma[0]["loss"].get<double>(), l0_bf16 = read_metrics(d.out_dir)[0]["loss"].get<double>();
  EXPECT_NE(l0_bf16, l0);
  EXPECT_NEAR(l0_bf16, l0, 1e-3 * l0);
  fs::remove_all(dir);
}

// The report's MTP loss weight schedule: the config's weight (0.3) until the switch, then the
// later one; the total loss the gradients are of uses the weight of its step.
TEST(Trainer, MtpWeightFollowsItsSchedule) {
  fs::path dir = scratch();
  TrainOptions o = tiny_options(dir);
  o.steps = 6;
  o.mtp_weight_after = 0.1;
  o.mtp_switch = 0.5;
  o.ckpt_every = 0;     // and no checkpoint is written
  o.peak_tflops = 0.5;  // and the MFU is reported against this peak
  Trainer(o).run();
  EXPECT_FALSE(fs::exists(fs::path(o.out_dir) / "checkpoint.safetensors"));
  const auto m = read_metrics(o.out_dir);
  for (const auto& j : m) EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), j["tflops"].get<double>() / 0.5) << j["step"];
  ASSERT_EQ(m.size(), 6u);
  for (const auto& j : m) {
    const double w = j["mtp_weight"].get<double>();
    EXPECT_EQ(w, j["step"].get<int64_t>() < 3 ? 0.3 : 0.1) << j["step"];
    const double total = j["loss"].get<double>() + w * j["mtp_loss"].get<double>() + j["balance_loss"].get<double>();
    EXPECT_NEAR(j["total_loss"].get<double>(), total, 1e-9 * std::abs(total)) << j["step"];
  }
  o.mtp_switch = 1.5;
  fp8moe::testing::expect_error([&] { Trainer t(o); }, "mtp_switch");
  o.mtp_switch = 0.5;
  o.ckpt_every = -1;
  fp8moe::testing::expect_error([&] { Trainer t(o); }, "ckpt_every");
  fs::remove_all(dir);
}

TEST(Trainer, TruncatedCheckpointIsRefusedAndKeptIntact) {
  fs::path dir = scratch();
  TrainOptions o = tiny_options(dir);
  o.steps = 4;
  Trainer(o).run();
  const fs::path ckpt = fs::path(o.out_dir) / "checkpoint.safetensors";
  const std::string good = read_file(ckpt);
  // A truncated copy is refused with an error naming the problem.
  fs::path broken_dir = dir / "broken";
  fs::create_directories(broken_dir);
  {
    std::ofstream out(broken_dir / "checkpoint.safetensors", std::ios::binary);
    out << good.substr(0, good.size() / 2);
  }
  TrainOptions r = o;
  r.out_dir = broken_dir.string();
  r.resume = true;
  try {
    Trainer t(r);
    FAIL() << "a truncated checkpoint was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file(ckpt), good);
  fs::remove_all(dir);
}

TEST(Trainer, NonFiniteLossStopsNamingTheStepAndSavesNothing) {
  fs::path dir = scratch();
  TrainOptions o = tiny_options(dir);
  o.steps = 3;
  Trainer(o).run();
  const fs::path ckpt = fs::path(o.out_dir) / "checkpoint.safetensors";
  // Plant a NaN in one weight of the checkpoint, then resume: the next step must stop.
  SafetensorsFile f = load_safetensors(ckpt.string());
  f.tensors.at("model.norm.weight").ptr<float>()[3] = NAN;
  std::map<std::string, TensorView> views;
  for (auto& [n, t] : f.tensors) views[n] = t.view();
  save_safetensors(ckpt.string(), views, f.metadata);
  const std::string before = read_file(ckpt);
  TrainOptions r = o;
  r.steps = 6;
  r.resume = true;
  try {
    Trainer(r).run();
    FAIL() << "a NaN weight did not stop the run";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("non-finite"), std::string::npos) << msg;
    EXPECT_NE(msg.find("first non-finite tensor"), std::string::npos) << msg;
  }
  EXPECT_EQ(read_file(ckpt), before);
  fs::remove_all(dir);
}
