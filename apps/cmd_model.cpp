// `fp8moe model`: the DeepSeek-V3-mini model from a config file.
//   fp8moe model --config configs/tiny.json [--tokens N] [--recipes fp8,bf16] [--json]
//       parameter counts (total, activated) and the bytes each layer keeps for backward for a
//       micro-batch of N tokens (default batch_size * seq_len), per recipe, with FP8's saving.
//   fp8moe model --config configs/tiny.json --dump DIR [--recipe fp32] [--seed S]
//       one forward_backward on a random batch; writes DIR/weights.safetensors (parameters by
//       Hugging Face name), DIR/batch.safetensors (tokens, targets) and DIR/outputs.safetensors
//       (logits, losses, every gradient as grad.<name>): the input of tests/reference/compare.py.
//       With --dump-sublayers also DIR/sublayers.safetensors: every sublayer's input x, output y,
//       output gradient dy and input gradient dx as sub.<i>.<sublayer>.<x|y|dy|dx> (see
//       Model::record_sublayers), the input of compare.py --teacher-forced.
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "commands.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/safetensors.hpp"

namespace fp8moe {
namespace {

struct Args {
  std::string config, dump, recipe = "fp32", recipes = "fp32,bf16,fp8";
  int64_t tokens = 0;
  uint64_t seed = 1;
  bool json = false;
  bool sublayers = false;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

void print_summary(const Args& a) {
  const ModelConfig cfg = load_config(a.config);
  validate_config(cfg);
  const ParameterCount pc = count_parameters(cfg);
  const int64_t T = a.tokens > 0 ? a.tokens : cfg.batch_size * cfg.seq_len;
  const auto recipes = split(a.recipes);
  std::vector<MemoryAccount> acc;
  for (auto& r : recipes) acc.push_back(predict_memory(cfg, Recipe::from_name(r), T));
  if (a.json) {
    nlohmann::json j;
    j["config"] = cfg.name;
    j["parameters"] = {{"total", pc.total}, {"activated", pc.activated}, {"total_main", pc.total_main},
                       {"activated_main", pc.activated_main}, {"embedding", pc.embedding}, {"head", pc.head},
                       {"mtp", pc.mtp}};
    j["tokens"] = T;
    for (size_t i = 0; i < recipes.size(); ++i) j["saved_bytes"][recipes[i]] = acc[i].bytes_per_layer();
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("config %s: %lld layers (+%lld MTP), hidden %lld, %lld heads, %lld routed experts (top-%lld) + %lld shared\n",
              cfg.name.c_str(), (long long)cfg.num_hidden_layers, (long long)cfg.num_nextn_predict_layers,
              (long long)cfg.hidden_size, (long long)cfg.num_attention_heads, (long long)cfg.n_routed_experts,
              (long long)cfg.num_experts_per_tok, (long long)cfg.n_shared_experts);
  std::printf("parameters: total %.4gB (main %.4gB + MTP %.4gB), activated per token %.4gB (main %.4gB); "
              "embedding %.4gM, head %.4gM\n",
              pc.total / 1e9, pc.total_main / 1e9, pc.mtp / 1e9, pc.activated / 1e9, pc.activated_main / 1e9,
              pc.embedding / 1e6, pc.head / 1e6);
  std::printf("\nbytes kept for backward per layer, micro-batch of %lld tokens (routing assumed balanced):\n",
              (long long)T);
  std::printf("%-18s", "layer");
  for (auto& r : recipes) std::printf(" %14s", r.c_str());
  std::printf("\n");
  auto per = [&](size_t i) { return acc[i].bytes_per_layer(); };
  std::vector<std::map<std::string, int64_t>> maps;
  for (size_t i = 0; i < recipes.size(); ++i) maps.push_back(per(i));
  // Execution order: parse "layers.<n>.<part>".
  std::vector<std::string> order;
  for (auto& it : acc[0].items)
    if (order.empty() || order.back() != it.layer) order.push_back(it.layer);
  for (auto& layer : order) {
    std::printf("%-18s", layer.c_str());
    for (auto& m : maps) std::printf(" %14.3f", m[layer] / 1048576.0);
    std::printf("  MiB\n");
  }
  std::printf("%-18s", "total");
  for (auto& m : acc) std::printf(" %14.3f", m.total_bytes() / 1048576.0);
  std::printf("  MiB\n");
  for (size_t i = 1; i < recipes.size(); ++i)
    std::printf("%s / %s = %.3f\n", recipes[i].c_str(), recipes[0].c_str(),
                double(acc[i].total_bytes()) / double(acc[0].total_bytes()));
}

void dump(const Args& a) {
  const ModelConfig cfg = load_config(a.config);
  auto be = make_backend("cpu");
  Model model(cfg, Recipe::from_name(a.recipe), *be, a.seed);
  std::mt19937_64 rng(a.seed + 1);
  const int64_t B = cfg.batch_size, S = cfg.seq_len;
  Tensor tokens = Tensor::host(DType::i32, {B, S}), targets = Tensor::host(DType::i32, {B, S});
  for (int64_t i = 0; i < B * S; ++i) tokens.ptr<int32_t>()[i] = int32_t(rng() % uint64_t(cfg.vocab_size));
  for (int64_t i = 0; i < B * S; ++i)  // the next token, a fresh one at each sequence end
    targets.ptr<int32_t>()[i] = (i % S < S - 1) ? tokens.ptr<int32_t>()[i + 1] : int32_t(rng() % uint64_t(cfg.vocab_size));
  model.zero_grad();
  model.record_sublayers(a.sublayers);
  const StepStats st = model.forward_backward(tokens.view(), targets.view(), 1.0);
  std::filesystem::create_directories(a.dump);
  save_safetensors(a.dump + "/weights.safetensors", model);
  save_safetensors(a.dump + "/batch.safetensors", {{"tokens", tokens.view()}, {"targets", targets.view()}});
  Tensor losses = Tensor::host(DType::f64, {4});
  losses.ptr<double>()[0] = st.loss;
  losses.ptr<double>()[1] = st.main_loss;
  losses.ptr<double>()[2] = st.mtp_loss;
  losses.ptr<double>()[3] = st.balance_loss;
  std::map<std::string, TensorView> out{{"losses", losses.view()}, {"logits", model.last_logits().view()}};
  for (auto& p : model.parameters())
    if (p.trainable) out["grad." + p.name] = p.grad.view();
  save_safetensors(a.dump + "/outputs.safetensors", out);
  if (a.sublayers) {
    std::map<std::string, TensorView> subs;
    for (const auto& [name, t] : model.sublayer_records()) subs[name] = t.view();
    save_safetensors(a.dump + "/sublayers.safetensors", subs);
  }
  std::printf("recipe %s: loss %.6f (main %.6f, mtp %.6f, balance %.3g); wrote %s/{weights,batch,outputs%s}.safetensors\n",
              a.recipe.c_str(), st.loss, st.main_loss, st.mtp_loss, st.balance_loss, a.dump.c_str(),
              a.sublayers ? ",sublayers" : "");
}

void add_model(CLI::App& app) {
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("model", "DeepSeek-V3-mini: parameter counts, activation memory per recipe, dumps");
  cmd->add_option("-c,--config", args->config, "model config: a JSON file, or the name of a shipped one (tiny, ..., deepseek-v3)")
      ->required();
  cmd->add_option("--tokens", args->tokens, "tokens per micro-batch (default batch_size * seq_len)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--recipes", args->recipes, "comma-separated recipes for the memory table");
  cmd->add_option("--dump", args->dump, "run one forward_backward and write safetensors files to this folder");
  cmd->add_option("--recipe", args->recipe, "recipe of --dump (fp64, fp32, bf16, fp8, ...)");
  cmd->add_option("--seed", args->seed, "weights and batch seed of --dump");
  cmd->add_flag("--dump-sublayers", args->sublayers,
                "with --dump: also write every sublayer's x, y, dy, dx (sublayers.safetensors)");
  cmd->add_flag("--json", args->json, "JSON output");
  cmd->callback([args] {
    if (args->dump.empty()) {
      print_summary(*args);
    } else {
      dump(*args);
    }
  });
}

static const bool registered = fp8moe::cli::register_command(&add_model);

}  // namespace
}  // namespace fp8moe
