// `fp8moe model`: the DeepSeek-V3-mini model from a config file.
//   fp8moe model --config configs/tiny.json [--tokens N] [--recipes fp8,bf16] [--itemize bf16,fp8] [--json]
//       parameter counts (total, activated) and the bytes each layer keeps for backward for a
//       micro-batch of N tokens (default batch_size * seq_len), per recipe, with FP8's saving; then,
//       for the --itemize recipes (the report's against BF16 by default), one layer of each kind
//       (dense, MoE, MTP; the embedding and the head keep nothing) tensor by tensor, bytes per token.
//   fp8moe model --config configs/tiny.json --dump DIR [--recipe fp32] [--seed S] [--backend cpu|cuda]
//       one forward_backward on a random batch (on the CPU unless --backend cuda); writes
//       DIR/weights.safetensors (parameters by Hugging Face name), DIR/batch.safetensors (tokens, targets) and DIR/outputs.safetensors
//       (logits, losses, every gradient as grad.<name>): the input of tests/reference/compare.py.
//       With --dump-sublayers also DIR/sublayers.safetensors: every sublayer's input x, output y,
//       output gradient dy and input gradient dx as sub.<i>.<sublayer>.<x|y|dy|dx> (see
//       Model::record_sublayers), the input of compare.py --teacher-forced.
#include <algorithm>
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
  std::string config, dump, recipe = "fp32", recipes = "fp32,bf16,fp8", itemize = "bf16,fp8", backend = "cpu";
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

// The account itemized per layer kind: what one layer of each kind keeps per token, tensor by
// tensor (the sublayer's name and the account's), for each recipe compared, summed over the
// kind's layers and divided by their count and the tokens, so that rows times layers times tokens
// add up to the account's total.
struct ItemRow {
  std::string tensor;  // "attn.x", "moe.experts.in.scales", "eh.h"
  std::vector<int64_t> bytes;  // per recipe, over all layers of the kind
  std::vector<std::string> dtype;
};
struct LayerKind {
  std::string name;
  std::vector<int64_t> layers;
  std::vector<ItemRow> rows;
  std::vector<int64_t> bytes;  // per recipe, over all its layers
};

std::vector<LayerKind> itemize(const ModelConfig& cfg, const std::vector<MemoryAccount>& acc) {
  std::vector<LayerKind> kinds{{"dense layer", {}, {}, {}}, {"MoE layer", {}, {}, {}}, {"MTP module", {}, {}, {}}};
  const auto kind_of = [&cfg](int64_t l) -> size_t {
    return l >= cfg.num_hidden_layers ? 2 : cfg.is_moe_layer(l) ? 1 : 0;
  };
  for (int64_t l = 0; l < cfg.num_layers_total(); ++l) kinds[kind_of(l)].layers.push_back(l);
  for (auto& k : kinds) k.bytes.assign(acc.size(), 0);
  // Rows in execution order: a tensor one recipe lacks (FP8's scales) goes after the row the
  // recipe listed before it.
  std::vector<size_t> last(kinds.size());
  for (size_t r = 0; r < acc.size(); ++r)
    for (const MemoryItem& it : acc[r].items) {
      // "layers.<l>.<sublayer>"
      const size_t dot = it.layer.find('.', 7);
      FP8MOE_CHECK(it.layer.rfind("layers.", 0) == 0 && dot != std::string::npos,
                   "model: memory item of an unknown layer '" << it.layer << "'");
      const size_t ki = kind_of(std::stoll(it.layer.substr(7, dot - 7)));
      LayerKind& k = kinds[ki];
      const std::string name = it.layer.substr(dot + 1) + "." + it.tensor;
      auto row = std::find_if(k.rows.begin(), k.rows.end(), [&](const ItemRow& x) { return x.tensor == name; });
      if (row == k.rows.end()) {
        const size_t at = k.rows.empty() ? 0 : last[ki] + 1;
        row = k.rows.insert(k.rows.begin() + ptrdiff_t(at),
                            {name, std::vector<int64_t>(acc.size(), 0), std::vector<std::string>(acc.size(), "-")});
      }
      last[ki] = size_t(row - k.rows.begin());
      row->bytes[r] += it.bytes;
      row->dtype[r] = std::string(dtype_name(it.dtype));
      k.bytes[r] += it.bytes;
    }
  std::erase_if(kinds, [](const LayerKind& k) { return k.layers.empty(); });
  return kinds;
}

std::string layer_range(const std::vector<int64_t>& l) {
  const std::string n = std::to_string(l.size()) + (l.size() == 1 ? " layer" : " layers");
  if (l.size() == 1) return "layer " + std::to_string(l[0]) + ", " + n;
  return "layers " + std::to_string(l.front()) + "-" + std::to_string(l.back()) + ", " + n;
}

void print_itemized(const ModelConfig& cfg, const std::vector<std::string>& recipes, const std::vector<MemoryAccount>& acc,
                    int64_t T) {
  const std::vector<LayerKind> kinds = itemize(cfg, acc);
  std::printf("\nactivation memory kept for backward, bytes per token of one layer of each kind (micro-batch of %lld "
              "tokens, routing assumed balanced):\n",
              (long long)T);
  for (const LayerKind& k : kinds) {
    const double per = double(k.layers.size()) * double(T);
    std::printf("%-34s", (k.name + " (" + layer_range(k.layers) + ")").c_str());
    for (auto& r : recipes) std::printf(" %18s", r.c_str());
    std::printf("\n");
    for (const ItemRow& row : k.rows) {
      std::printf("  %-32s", row.tensor.c_str());
      for (size_t r = 0; r < recipes.size(); ++r)
        std::printf(r + 1 < recipes.size() ? " %12.2f %-5s" : " %12.2f %s", double(row.bytes[r]) / per,
                    row.dtype[r].c_str());
      std::printf("\n");
    }
    std::printf("  %-32s", "total");
    for (size_t r = 0; r < recipes.size(); ++r) std::printf(" %12.2f%s", double(k.bytes[r]) / per, r + 1 < recipes.size() ? "      " : "");
    if (recipes.size() > 1)
      std::printf("   %s / %s = %.3f", recipes.back().c_str(), recipes.front().c_str(),
                  double(k.bytes.back()) / double(k.bytes.front()));
    std::printf("\n");
  }
  std::printf("%-34s%s\n", "embedding, head",
              " nothing kept: the embedding's backward reads the token ids, the head's forward and backward run "
              "together");
  std::printf("%-34s", "all layers, bytes per token");
  for (auto& m : acc) std::printf(" %18.1f", double(m.total_bytes()) / double(T));
  std::printf("\n%-34s", "all layers, bytes");
  for (auto& m : acc) std::printf(" %18lld", (long long)m.total_bytes());
  std::printf("\n");
}

void print_summary(const Args& a) {
  const ModelConfig cfg = load_config(a.config);
  validate_config(cfg);
  const ParameterCount pc = count_parameters(cfg);
  const int64_t T = a.tokens > 0 ? a.tokens : cfg.batch_size * cfg.seq_len;
  const auto recipes = split(a.recipes);
  std::vector<MemoryAccount> acc;
  for (auto& r : recipes) acc.push_back(predict_memory(cfg, Recipe::from_name(r), T));
  const auto compared = split(a.itemize);
  std::vector<MemoryAccount> acc_compared;
  for (auto& r : compared) acc_compared.push_back(predict_memory(cfg, Recipe::from_name(r), T));
  if (a.json) {
    nlohmann::json j;
    j["config"] = cfg.name;
    j["parameters"] = {{"total", pc.total}, {"activated", pc.activated}, {"total_main", pc.total_main},
                       {"activated_main", pc.activated_main}, {"embedding", pc.embedding}, {"head", pc.head},
                       {"mtp", pc.mtp}};
    j["tokens"] = T;
    for (size_t i = 0; i < recipes.size(); ++i) j["saved_bytes"][recipes[i]] = acc[i].bytes_per_layer();
    nlohmann::json& it = j["itemized"];
    it["recipes"] = compared;
    it["kinds"] = nlohmann::json::array();
    for (const LayerKind& k : itemize(cfg, acc_compared)) {
      const double per = double(k.layers.size()) * double(T);
      nlohmann::json jk{{"kind", k.name}, {"layers", k.layers}, {"tensors", nlohmann::json::array()}};
      for (const ItemRow& row : k.rows) {
        nlohmann::json jr{{"tensor", row.tensor}};
        for (size_t r = 0; r < compared.size(); ++r) {
          jr["bytes_per_token"][compared[r]] = double(row.bytes[r]) / per;
          jr["dtype"][compared[r]] = row.dtype[r];
        }
        jk["tensors"].push_back(jr);
      }
      for (size_t r = 0; r < compared.size(); ++r) jk["bytes_per_token"][compared[r]] = double(k.bytes[r]) / per;
      it["kinds"].push_back(jk);
    }
    for (size_t r = 0; r < compared.size(); ++r) {
      it["total_bytes"][compared[r]] = acc_compared[r].total_bytes();
      it["total_bytes_per_token"][compared[r]] = double(acc_compared[r].total_bytes()) / double(T);
    }
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
  if (!compared.empty()) print_itemized(cfg, compared, acc_compared, T);
}

void dump(const Args& a) {
  const ModelConfig cfg = load_config(a.config);
  auto be = make_backend(a.backend);
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
  // Host copies: the backend's tensors may live on the device.
  std::vector<Tensor> host{be->to_host(model.last_logits())};
  std::map<std::string, TensorView> out{{"losses", losses.view()}, {"logits", host.back().view()}};
  for (auto& p : model.parameters())
    if (p.trainable) {
      host.push_back(be->to_host(p.grad));
      out["grad." + p.name] = host.back().view();
    }
  save_safetensors(a.dump + "/outputs.safetensors", out);
  if (a.sublayers) {
    std::map<std::string, TensorView> subs;
    for (const auto& [name, t] : model.sublayer_records()) subs[name] = t.view();
    save_safetensors(a.dump + "/sublayers.safetensors", subs);
  }
  std::printf("recipe %s (%s backend): loss %.6f (main %.6f, mtp %.6f, balance %.3g); wrote %s/{weights,batch,outputs%s}.safetensors\n",
              a.recipe.c_str(), be->name().c_str(), st.loss, st.main_loss, st.mtp_loss, st.balance_loss, a.dump.c_str(),
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
  cmd->add_option("--itemize", args->itemize,
                  "comma-separated recipes whose memory is itemized per layer kind and tensor, bytes per token (empty: none)");
  cmd->add_option("--dump", args->dump, "run one forward_backward and write safetensors files to this folder");
  cmd->add_option("--recipe", args->recipe, "recipe of --dump (fp64, fp32, bf16, fp8, ...)");
  cmd->add_option("--seed", args->seed, "weights and batch seed of --dump");
  cmd->add_option("--backend", args->backend, "backend of --dump: cpu | cuda");
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
