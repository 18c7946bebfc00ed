// The checks every subcommand runs before any work: training options (validate_train_options),
// the output folder (check_run_folder), model configs (config_from_json, find_config) and the
// summary that prints only what a run measured. No training here: tests/cli drives the command.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/trainer.hpp"
#include "testing.hpp"

using namespace fp8moe;
using fp8moe::testing::expect_error;
namespace fs = std::filesystem;

namespace {

nlohmann::json tiny_json() {
  std::ifstream in(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  return nlohmann::json::parse(in);
}

}  // namespace

TEST(TrainOptions, EveryRangeIsCheckedNamingTheOption) {
  EXPECT_NO_THROW(validate_train_options(TrainOptions{}));
  const std::vector<std::pair<std::function<void(TrainOptions&)>, std::string>> cases{
      {[](TrainOptions& o) { o.steps = 0; }, "--steps (steps) = 0 is out of range: must be >= 1"},
      {[](TrainOptions& o) { o.batch_size = -1; }, "--batch-size (batch_size) = -1"},
      {[](TrainOptions& o) { o.seq_len = -1; }, "--seq-len (seq_len) = -1"},
      {[](TrainOptions& o) { o.grad_accum = 0; }, "--grad-accum (grad_accum) = 0"},
      {[](TrainOptions& o) { o.parallel.pp = 0; }, "--pp (parallel.pp) = 0 is out of range: must be >= 1"},
      {[](TrainOptions& o) { o.parallel.pp_split = "2,2"; }, "--pp-split '2,2' splits pipeline stages: it needs --pp >= 2"},
      {[](TrainOptions& o) { o.lr = NAN; }, "--lr (lr) = nan is out of range: must be finite and > 0"},
      {[](TrainOptions& o) { o.lr = 0; }, "--lr (lr) = 0"},
      {[](TrainOptions& o) { o.min_lr_ratio = 1.5f; }, "--min-lr-ratio (min_lr_ratio) = 1.5 is out of range: must be in [0, 1]"},
      {[](TrainOptions& o) { o.warmup_frac = -0.1f; }, "--warmup (warmup_frac) = -0.1"},
      {[](TrainOptions& o) { o.weight_decay = INFINITY; }, "--weight-decay (weight_decay) = inf"},
      {[](TrainOptions& o) { o.clip = -1; }, "--clip (clip) = -1"},
      {[](TrainOptions& o) { o.beta1 = 1; }, "beta1 (beta1) = 1 is out of range: must be in [0, 1)"},
      {[](TrainOptions& o) { o.beta2 = NAN; }, "beta2 (beta2) = nan"},
      {[](TrainOptions& o) { o.ema_decay = NAN; }, "--ema-decay (ema_decay) = nan is out of range: must be in [0, 1]"},
      {[](TrainOptions& o) { o.ema_every = 0; }, "--ema-every (ema_every) = 0"},
      {[](TrainOptions& o) { o.mtp_weight_after = NAN; }, "--mtp-weight-after (mtp_weight_after) = nan"},
      {[](TrainOptions& o) { o.mtp_switch = 1.5; }, "--mtp-switch (mtp_switch) = 1.5"},
      {[](TrainOptions& o) { o.peak_tflops = -1; }, "--peak-tflops (peak_tflops) = -1"},
      {[](TrainOptions& o) { o.eval_every = 0; }, "--eval-every (eval_every) = 0 is out of range: must be >= 1"},
      {[](TrainOptions& o) { o.eval_batches = 0; }, "--eval-batches (eval_batches) = 0"},
      {[](TrainOptions& o) { o.log_every = 0; }, "--log-every (log_every) = 0"},
      {[](TrainOptions& o) { o.ckpt_every = -1; }, "--ckpt-every (ckpt_every) = -1"},
      {[](TrainOptions& o) { o.stop_at = 300; }, "--stop-at (stop_at) = 300 is out of range: must be in [0, --steps]"},
      {[](TrainOptions& o) { o.moments = "f16"; }, "--moments (moments) = 'f16' is not one of bf16, f32"},
      {[](TrainOptions& o) { o.backend = "tpu"; }, "--backend (backend) = 'tpu' is not one of auto, cpu, cuda"},
      {[](TrainOptions& o) { o.graphs = "yes"; }, "--graphs (graphs) = 'yes' is not one of auto, on, off"},
      {[](TrainOptions& o) { o.wgrad_stream = "auto"; }, "--wgrad-stream (wgrad_stream) = 'auto' is not one of on, off"},
      {[](TrainOptions& o) { o.ema_on = "gpu"; }, "--ema-on (ema_on) = 'gpu' is not one of auto, host, device"},
      {[](TrainOptions& o) { o.out_dir = ""; }, "--out (out_dir) must not be empty"},
      {[](TrainOptions& o) { o.resume = o.overwrite = true; }, "--resume continues the run in --out and --overwrite replaces it"},
      {[](TrainOptions& o) { o.recipe = "fp4"; }, "unknown recipe 'fp4'"},
      {[](TrainOptions& o) { o.attention = "fp8"; }, "unknown attention precision 'fp8'"},
  };
  for (const auto& [change, needle] : cases) {
    TrainOptions o;
    change(o);
    expect_error([&] { validate_train_options(o); }, needle);
  }
}

TEST(TrainOptions, RunFolderIsCheckedWithoutCreatingAnything) {
  const fs::path dir = fp8moe::testing::test_dir("fp8moe_validation");
  const fs::path out = dir / "run";
  EXPECT_NO_THROW(check_run_folder(out.string(), false, false));
  expect_error([&] { check_run_folder(out.string(), true, false); }, "--resume: no checkpoint to continue from");
  EXPECT_FALSE(fs::exists(out));
  fs::create_directories(out);
  EXPECT_NO_THROW(check_run_folder(out.string(), false, false));  // an empty folder holds no run
  std::ofstream(out / "metrics.jsonl") << "{}\n";
  expect_error([&] { check_run_folder(out.string(), false, false); }, "already holds a run (metrics.jsonl)");
  EXPECT_NO_THROW(check_run_folder(out.string(), false, true));
  std::ofstream(out / "checkpoint.safetensors") << "x";
  EXPECT_NO_THROW(check_run_folder(out.string(), true, false));
  expect_error([&] { check_run_folder((out / "metrics.jsonl").string(), false, false); }, "is a file, not a folder");
  fs::remove_all(dir);
}

TEST(TrainSummary, PrintsOnlyWhatTheRunMeasured) {
  TrainSummary s;
  s.steps = 8;
  s.total_steps = 8;
  s.steps_run = 8;
  s.final_loss = 2.5;
  s.tokens_per_s = 100;
  EXPECT_EQ(format_summary(s), "done: step 8 of 8, train loss 2.5000, 100 tokens/s");
  s.has_val_loss = true;
  s.final_val_loss = 2.75;
  EXPECT_EQ(format_summary(s), "done: step 8 of 8, train loss 2.5000, validation loss 2.7500, 100 tokens/s");
  TrainSummary none;  // interrupted before its first step, after a resume at step 3
  none.steps = 3;
  none.total_steps = 10;
  none.interrupted = true;
  EXPECT_EQ(format_summary(none), "interrupted: step 3 of 10 (0 in this run)");
  none.checkpoint = "runs/x/checkpoint.safetensors";
  EXPECT_EQ(interrupted_message(none),
            "interrupted at step 3: checkpoint written to runs/x/checkpoint.safetensors; --resume continues the run");
}

TEST(ModelConfigKeys, EveryShippedConfigIsValid) {
  for (const auto& f : fs::directory_iterator(std::string(FP8MOE_SOURCE_DIR) + "/configs")) {
    if (f.path().extension() != ".json") continue;
    EXPECT_NO_THROW(validate_config(load_config(f.path().string()))) << f.path();
  }
}

TEST(ModelConfigKeys, BadKeysAreRefusedNamingTheKey) {
  auto refused = [](const std::function<void(nlohmann::json&)>& change, const std::string& needle) {
    nlohmann::json j = tiny_json();
    change(j);
    expect_error([&] { validate_config(config_from_json(j.dump())); }, needle);
  };
  refused([](nlohmann::json& j) { j["hiden_size"] = j["hidden_size"]; j.erase("hidden_size"); },
          "unknown key 'hiden_size' (did you mean 'hidden_size'?)");
  refused([](nlohmann::json& j) { j["n_expert"] = 4; }, "unknown key 'n_expert'");
  refused([](nlohmann::json& j) { j["zzzzzzzz"] = 4; }, "unknown key 'zzzzzzzz' (known keys: name, vocab_size");
  refused([](nlohmann::json& j) { j = nlohmann::json::object(); },
          "missing required keys vocab_size, hidden_size, num_hidden_layers, first_k_dense_replace");
  refused([](nlohmann::json& j) { j.erase("v_head_dim"); }, "missing required key v_head_dim");
  refused([](nlohmann::json& j) { j["hidden_size"] = 128.5; }, "'hidden_size' has the wrong type: expected an integer, got 128.5");
  refused([](nlohmann::json& j) { j["num_hidden_layers"] = true; }, "'num_hidden_layers' has the wrong type");
  refused([](nlohmann::json& j) { j["norm_topk_prob"] = 1; }, "'norm_topk_prob' has the wrong type: expected true or false");
  refused([](nlohmann::json& j) { j["rope_theta"] = "big"; }, "'rope_theta' has the wrong type: expected a number");
  refused([](nlohmann::json& j) { j["name"] = 3; }, "'name' has the wrong type: expected a string");
  refused([](nlohmann::json& j) { j["name"] = ""; }, "name must not be empty");
  refused([](nlohmann::json& j) { j["vocab_size"] = 0; }, "vocab_size = 0 must be in [1, 16777216]");
  refused([](nlohmann::json& j) { j["hidden_size"] = int64_t(1) << 30; }, "hidden_size = 1073741824 must be in [1, 16777216]");
  refused([](nlohmann::json& j) { j["max_position_embeddings"] = -4; }, "max_position_embeddings = -4 must be in");
  refused([](nlohmann::json& j) { j["rope_theta"] = 0; }, "rope_theta = 0 must be positive");
  refused([](nlohmann::json& j) { j["initializer_range"] = -0.02; }, "initializer_range = -0.02 must be positive");
  refused([](nlohmann::json& j) { j["mtp_loss_weight"] = -0.3; }, "mtp_loss_weight = -0.3 must be finite and >= 0");
  refused([](nlohmann::json& j) { j["bias_update_speed"] = -1; }, "bias_update_speed = -1 must be finite and >= 0");
  refused([](nlohmann::json& j) { j["aux_loss_alpha"] = -1; }, "aux_loss_alpha = -1 must be finite and >= 0");
  refused([](nlohmann::json& j) { j["hidden_act"] = "gelu"; }, "key 'hidden_act' = \"gelu\" is not supported");
  refused([](nlohmann::json& j) { j["topk_method"] = "greedy"; }, "key 'topk_method' = \"greedy\" is not supported");
  refused([](nlohmann::json& j) { j["tie_word_embeddings"] = true; }, "key 'tie_word_embeddings' = true is not supported");
  refused([](nlohmann::json& j) { j["num_key_value_heads"] = 1; }, "num_key_value_heads = 1 must equal num_attention_heads = 2");
  expect_error([] { config_from_json("[]"); }, "expected a JSON object at the top level, got array");
  expect_error([] { config_from_json("{"); }, "not valid JSON");
}

TEST(ModelConfigKeys, HuggingFaceKeysAndNullQueryRankAreAccepted) {
  nlohmann::json j = tiny_json();
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["hidden_act"] = "silu";
  j["scoring_func"] = "sigmoid";
  j["num_key_value_heads"] = j["num_attention_heads"];
  j["quantization_config"] = {{"quant_method", "fp8"}};
  j["rope_scaling"] = nullptr;
  j["q_lora_rank"] = nullptr;
  const ModelConfig c = config_from_json(j.dump());
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_NO_THROW(validate_config(c));
}

TEST(ModelConfigKeys, ConfigsAreFoundByPathOrShippedName) {
  const std::string tiny = std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json";
  EXPECT_EQ(find_config(tiny), tiny);
  // Names resolve beside the executable (share/fp8moe/configs): not beside this test binary.
  expect_error([] { find_config("no-such-config"); }, "'no-such-config' is neither a file nor the name of a shipped config");
  expect_error([] { find_config(FP8MOE_SOURCE_DIR); }, "is not a file");
  EXPECT_EQ(closest_match("tin", {"tiny", "small", "1b"}), "tiny");
  EXPECT_EQ(closest_match("qqqqqqq", {"tiny", "small"}), "");
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
}
