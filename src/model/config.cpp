// ModelConfig: JSON parsing (Hugging Face DeepSeek-V3 keys), validation with messages naming the
// key, the parameter list by name (shared by the model, the counts and the memory account) and the
// parameter counts.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/model_recipe.hpp"
#include "fp8moe/paths.hpp"
#include "model_internal.hpp"

namespace fp8moe {

using nlohmann::json;

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return n_routed_experts > 0 && layer >= first_k_dense_replace;
}

int64_t ModelConfig::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers_total(); ++l) n += is_moe_layer(l);
  return n;
}

// Every field with its JSON key, for parsing and printing.
#define FP8MOE_CONFIG_FIELDS(X)                                                                              \
  X(name) X(vocab_size) X(hidden_size) X(num_hidden_layers) X(first_k_dense_replace) X(num_attention_heads) \
  X(q_lora_rank) X(kv_lora_rank) X(qk_nope_head_dim) X(qk_rope_head_dim) X(v_head_dim) X(intermediate_size) \
  X(moe_intermediate_size) X(n_routed_experts) X(n_shared_experts) X(num_experts_per_tok) X(n_group)          \
  X(topk_group) X(routed_scaling_factor) X(norm_topk_prob) X(rms_norm_eps) X(rope_theta)                     \
  X(max_position_embeddings) X(num_nextn_predict_layers) X(mtp_loss_weight) X(aux_loss_alpha)               \
  X(bias_update_speed) X(initializer_range) X(seq_len) X(batch_size)

namespace {

namespace fs = std::filesystem;

// Typed readers: a key of the wrong JSON type (128.5 for a dimension, "8" for a count, 1 for a
// flag) is refused rather than converted, so a config means exactly what it says.
void read_value(const json& v, const char* key, int64_t& out) {
  FP8MOE_CHECK(v.is_number_integer(), "model config: key '" << key << "' has the wrong type: expected an integer, got "
                                                            << v.dump());
  out = v.get<int64_t>();
}
void read_value(const json& v, const char* key, double& out) {
  FP8MOE_CHECK(v.is_number(), "model config: key '" << key << "' has the wrong type: expected a number, got " << v.dump());
  out = v.get<double>();
  FP8MOE_CHECK(std::isfinite(out), "model config: key '" << key << "' = " << v.dump() << " must be finite");
}
void read_value(const json& v, const char* key, bool& out) {
  FP8MOE_CHECK(v.is_boolean(), "model config: key '" << key << "' has the wrong type: expected true or false, got "
                                                     << v.dump());
  out = v.get<bool>();
}
void read_value(const json& v, const char* key, std::string& out) {
  FP8MOE_CHECK(v.is_string(), "model config: key '" << key << "' has the wrong type: expected a string, got " << v.dump());
  out = v.get<std::string>();
}

// The keys that fix the model's shape: a config without one of them does not describe a model
// (DeepSeek-V3's own config.json has them all); the rest have the defaults of ModelConfig.
const std::vector<std::string>& required_keys() {
  static const std::vector<std::string> keys{
      "vocab_size", "hidden_size", "num_hidden_layers", "first_k_dense_replace", "num_attention_heads",
      "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
      "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok"};
  return keys;
}

// Keys of DeepSeek-V3's Hugging Face config.json that fp8moe does not read (its exports write
// them), with the one value the mini model implements where the key changes the model; null:
// any value. A config asking for another behaviour is refused instead of trained as something else.
const std::vector<std::pair<std::string, json>>& hugging_face_keys() {
  static const std::vector<std::pair<std::string, json>> keys{
      {"architectures", nullptr},     {"model_type", nullptr},         {"auto_map", nullptr},
      {"attention_bias", false},      {"attention_dropout", 0.0},      {"hidden_act", "silu"},
      {"scoring_func", "sigmoid"},    {"topk_method", "noaux_tc"},     {"tie_word_embeddings", false},
      {"moe_layer_freq", 1},          {"num_key_value_heads", nullptr}, {"bos_token_id", nullptr},
      {"eos_token_id", nullptr},      {"pad_token_id", nullptr},       {"ep_size", nullptr},
      {"pretraining_tp", nullptr},    {"quantization_config", nullptr}, {"rope_scaling", nullptr},
      {"seq_aux", nullptr},           {"torch_dtype", nullptr},        {"transformers_version", nullptr},
      {"use_cache", nullptr},         {"head_dim", nullptr},           {"rope_interleave", nullptr},
      {"_name_or_path", nullptr}};
  return keys;
}

#define FP8MOE_NAME(f) #f,
const std::vector<std::string>& own_keys() {
  static const std::vector<std::string> keys{FP8MOE_CONFIG_FIELDS(FP8MOE_NAME)};
  return keys;
}
#undef FP8MOE_NAME

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

}  // namespace

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  // A suggestion only where it is plausibly the same word mistyped.
  return best_d <= std::max<size_t>(2, word.size() / 3) ? best : std::string();
}

ModelConfig config_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    FP8MOE_CHECK(false, "model config: not valid JSON: " << e.what());
  }
  FP8MOE_CHECK(j.is_object(), "model config: expected a JSON object at the top level, got " << j.type_name());
  ModelConfig c;
#define FP8MOE_READ(f) \
  if (j.contains(#f) && !(j[#f].is_null() && std::string_view(#f) == "q_lora_rank")) read_value(j[#f], #f, c.f);
  FP8MOE_CONFIG_FIELDS(FP8MOE_READ)
#undef FP8MOE_READ
  // Hugging Face configs write a model without query compression as q_lora_rank null.
  if (j.contains("q_lora_rank") && j["q_lora_rank"].is_null()) c.q_lora_rank = 0;

  std::vector<std::string> known = own_keys();
  for (const auto& [key, value] : hugging_face_keys()) known.push_back(key);
  for (const auto& [key, value] : j.items()) {
    if (std::find(own_keys().begin(), own_keys().end(), key) != own_keys().end()) continue;
    const auto hf = std::find_if(hugging_face_keys().begin(), hugging_face_keys().end(),
                                 [&](const auto& k) { return k.first == key; });
    if (hf == hugging_face_keys().end()) {
      const std::string near = closest_match(key, known);
      FP8MOE_CHECK(false, "model config: unknown key '" << key << "'"
                                                       << (near.empty() ? " (known keys: " + join(own_keys()) + ")"
                                                                        : " (did you mean '" + near + "'?)"));
    }
    FP8MOE_CHECK(hf->second.is_null() || value == hf->second,
                 "model config: key '" << key << "' = " << value.dump() << " is not supported: the model implements "
                                       << key << " = " << hf->second.dump() << " only");
  }
  std::vector<std::string> missing;
  for (const std::string& key : required_keys())
    if (!j.contains(key)) missing.push_back(key);
  FP8MOE_CHECK(missing.empty(), "model config: missing required key" << (missing.size() > 1 ? "s " : " ") << join(missing)
                                                                      << " (every key that fixes the model's shape is required)");
  if (j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null())
    FP8MOE_CHECK(j["num_key_value_heads"] == c.num_attention_heads,
                 "model config: num_key_value_heads = " << j["num_key_value_heads"].dump() << " must equal num_attention_heads = "
                                                        << c.num_attention_heads << " (MLA gives every head its own key and value)");
  return c;
}

std::string find_config(const std::string& name_or_path) {
  std::error_code ec;
  if (fs::is_regular_file(name_or_path, ec)) return name_or_path;
  FP8MOE_CHECK(!fs::exists(name_or_path, ec), "model config: '" << name_or_path << "' is not a file");
  const fs::path share = share_dir();
  const fs::path dir = share.empty() ? fs::path() : share / "configs";
  std::vector<std::string> names;
  if (!dir.empty() && name_or_path.find('/') == std::string::npos) {
    for (const std::string& file : {name_or_path, name_or_path + ".json"})
      if (fs::is_regular_file(dir / file, ec)) return (dir / file).string();
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
    std::sort(names.begin(), names.end());
  }
  const std::string near = closest_match(name_or_path, names);
  FP8MOE_CHECK(false, "model config: '" << name_or_path << "' is neither a file nor the name of a shipped config"
                                        << (names.empty() ? std::string()
                                                          : " (" + dir.string() + " holds: " + join(names) + ")")
                                        << (near.empty() ? std::string() : "; did you mean '" + near + "'?"));
}

ModelConfig load_config(const std::string& name_or_path) {
  const std::string path = find_config(name_or_path);
  std::ifstream f(path);
  FP8MOE_CHECK(f.good(), "model config: cannot open '" << path << "'");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return config_from_json(ss.str());
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

std::string config_to_json(const ModelConfig& c) {
  json j;
#define FP8MOE_WRITE(f) j[#f] = c.f;
  FP8MOE_CONFIG_FIELDS(FP8MOE_WRITE)
#undef FP8MOE_WRITE
  return j.dump(2);
}

void validate_config(const ModelConfig& c) {
  // Sizes past 2^24 are no mini model (DeepSeek-V3's largest, max_position_embeddings, is 163840)
  // and would overflow the products of sizes that the model allocates.
  constexpr int64_t kMaxSize = int64_t(1) << 24;
  auto positive = [](int64_t v, const char* key) {
    FP8MOE_CHECK(v > 0 && v <= kMaxSize, "model config: " << key << " = " << v << " must be in [1, " << kMaxSize << "]");
  };
  auto non_negative = [](double v, const char* key) {
    FP8MOE_CHECK(std::isfinite(v) && v >= 0, "model config: " << key << " = " << v << " must be finite and >= 0");
  };
  FP8MOE_CHECK(!c.name.empty(), "model config: name must not be empty");
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.num_hidden_layers, "num_hidden_layers");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.kv_lora_rank, "kv_lora_rank");
  positive(c.qk_rope_head_dim, "qk_rope_head_dim");
  positive(c.v_head_dim, "v_head_dim");
  positive(c.seq_len, "seq_len");
  positive(c.batch_size, "batch_size");
  positive(c.max_position_embeddings, "max_position_embeddings");
  FP8MOE_CHECK(c.qk_nope_head_dim <= kMaxSize && c.q_lora_rank <= kMaxSize && c.intermediate_size <= kMaxSize &&
                   c.moe_intermediate_size <= kMaxSize && c.n_routed_experts <= kMaxSize && c.n_shared_experts <= kMaxSize,
               "model config: qk_nope_head_dim, q_lora_rank, intermediate_size, moe_intermediate_size, n_routed_experts and "
               "n_shared_experts must be <= " << kMaxSize);
  FP8MOE_CHECK(std::isfinite(c.rope_theta) && c.rope_theta > 0, "model config: rope_theta = " << c.rope_theta << " must be positive");
  FP8MOE_CHECK(std::isfinite(c.initializer_range) && c.initializer_range > 0,
               "model config: initializer_range = " << c.initializer_range << " must be positive");
  non_negative(c.mtp_loss_weight, "mtp_loss_weight");
  non_negative(c.bias_update_speed, "bias_update_speed");
  FP8MOE_CHECK(c.qk_nope_head_dim >= 0, "model config: qk_nope_head_dim = " << c.qk_nope_head_dim << " must be >= 0");
  FP8MOE_CHECK(c.q_lora_rank >= 0, "model config: q_lora_rank = " << c.q_lora_rank << " must be >= 0 (0: no query compression)");
  FP8MOE_CHECK(c.hidden_size % c.num_attention_heads == 0,
               "model config: num_attention_heads = " << c.num_attention_heads << " does not divide hidden_size = "
                                                      << c.hidden_size);
  FP8MOE_CHECK(c.qk_rope_head_dim % 2 == 0,
               "model config: qk_rope_head_dim = " << c.qk_rope_head_dim << " must be even (RoPE rotates pairs)");
  FP8MOE_CHECK(c.first_k_dense_replace >= 0 && c.first_k_dense_replace <= c.num_hidden_layers,
               "model config: first_k_dense_replace = " << c.first_k_dense_replace << " must be in [0, num_hidden_layers = "
                                                        << c.num_hidden_layers << "]");
  FP8MOE_CHECK(c.num_nextn_predict_layers == 0 || c.num_nextn_predict_layers == 1,
               "model config: num_nextn_predict_layers = " << c.num_nextn_predict_layers << " must be 0 or 1 (MTP depth)");
  FP8MOE_CHECK(c.seq_len <= c.max_position_embeddings,
               "model config: seq_len = " << c.seq_len << " exceeds max_position_embeddings = " << c.max_position_embeddings);
  FP8MOE_CHECK(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0, "model config: rms_norm_eps = " << c.rms_norm_eps << " must be positive");
  if (c.first_k_dense_replace > 0) positive(c.intermediate_size, "intermediate_size");
  if (c.num_moe_layers() > 0 || c.first_k_dense_replace < c.num_hidden_layers) {
    positive(c.n_routed_experts, "n_routed_experts");
    positive(c.moe_intermediate_size, "moe_intermediate_size");
    positive(c.num_experts_per_tok, "num_experts_per_tok");
    positive(c.n_group, "n_group");
    FP8MOE_CHECK(c.n_shared_experts >= 0, "model config: n_shared_experts = " << c.n_shared_experts << " must be >= 0");
    FP8MOE_CHECK(c.num_experts_per_tok <= c.n_routed_experts,
                 "model config: num_experts_per_tok = " << c.num_experts_per_tok << " exceeds n_routed_experts = "
                                                        << c.n_routed_experts);
    FP8MOE_CHECK(c.n_routed_experts % c.n_group == 0,
                 "model config: n_group = " << c.n_group << " does not divide n_routed_experts = " << c.n_routed_experts);
    FP8MOE_CHECK(c.topk_group >= 1 && c.topk_group <= c.n_group,
                 "model config: topk_group = " << c.topk_group << " must be in [1, n_group = " << c.n_group << "]");
    const int64_t reachable = c.topk_group * (c.n_routed_experts / c.n_group);
    FP8MOE_CHECK(c.num_experts_per_tok <= reachable,
                 "model config: num_experts_per_tok = " << c.num_experts_per_tok << " exceeds the " << reachable
                                                        << " experts of topk_group = " << c.topk_group << " groups");
    FP8MOE_CHECK(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor > 0,
                 "model config: routed_scaling_factor = " << c.routed_scaling_factor << " must be positive");
    non_negative(c.aux_loss_alpha, "aux_loss_alpha");
  }
}

void validate_config(const ModelConfig& c, const Recipe& r) {
  validate_config(c);
  if (!r.is_fp8()) return;
  // K of every FP8 Fprop (a Linear's in features) must be a multiple of 128; the Dgrad's K (out
  // features) and the Wgrad's K (tokens) are zero-padded by the Linear.
  auto k128 = [&](int64_t v, const char* key, const char* who) {
    FP8MOE_CHECK(v % 128 == 0, "model config: " << key << " = " << v << " must be a multiple of 128 for recipe "
                                                << r.name << " (it is the K dim of the FP8 GEMM of " << who << ")");
  };
  k128(c.hidden_size, "hidden_size", "q_a_proj, kv_a_proj_with_mqa and the MLP/expert gate and up projections");
  if (c.q_lora_rank > 0) k128(c.q_lora_rank, "q_lora_rank", "q_b_proj");
  k128(c.kv_lora_rank, "kv_lora_rank", "kv_b_proj");
  k128(c.num_attention_heads * c.v_head_dim, "num_attention_heads * v_head_dim", "o_proj");
  if (c.first_k_dense_replace > 0) k128(c.intermediate_size, "intermediate_size", "the dense down_proj");
  if (c.num_moe_layers() > 0) k128(c.moe_intermediate_size, "moe_intermediate_size", "the expert down_proj");
}

namespace model {

std::vector<ParamSpec> parameter_specs(const ModelConfig& c) {
  std::vector<ParamSpec> s;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, dqk = c.qk_head_dim();
  auto mat = [&](const std::string& n, int64_t out, int64_t in) { s.push_back({n, {out, in}, ParamSpec::normal, true, true}); };
  auto norm = [&](const std::string& n, int64_t d) { s.push_back({n, {d}, ParamSpec::ones, true, false}); };
  auto mlp = [&](const std::string& p, int64_t f) {
    mat(p + "gate_proj.weight", f, D);
    mat(p + "up_proj.weight", f, D);
    mat(p + "down_proj.weight", D, f);
  };
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, D}, ParamSpec::normal, true, true});
  for (int64_t l = 0; l < c.num_layers_total(); ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const bool mtp = l >= c.num_hidden_layers;
    if (mtp) {
      norm(p + "enorm.weight", D);
      norm(p + "hnorm.weight", D);
      mat(p + "eh_proj.weight", D, 2 * D);
    }
    norm(p + "input_layernorm.weight", D);
    if (c.q_lora_rank > 0) {
      mat(p + "self_attn.q_a_proj.weight", c.q_lora_rank, D);
      norm(p + "self_attn.q_a_layernorm.weight", c.q_lora_rank);
      mat(p + "self_attn.q_b_proj.weight", H * dqk, c.q_lora_rank);
    } else {
      mat(p + "self_attn.q_proj.weight", H * dqk, D);
    }
    mat(p + "self_attn.kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, D);
    norm(p + "self_attn.kv_a_layernorm.weight", c.kv_lora_rank);
    mat(p + "self_attn.kv_b_proj.weight", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
    mat(p + "self_attn.o_proj.weight", D, H * c.v_head_dim);
    norm(p + "post_attention_layernorm.weight", D);
    if (c.is_moe_layer(l)) {
      mat(p + "mlp.gate.weight", c.n_routed_experts, D);
      s.push_back({p + "mlp.gate.e_score_correction_bias", {c.n_routed_experts}, ParamSpec::zeros, false, false});
      if (c.n_shared_experts > 0) mlp(p + "mlp.shared_experts.", c.n_shared_experts * c.moe_intermediate_size);
      for (int64_t e = 0; e < c.n_routed_experts; ++e)
        mlp(p + "mlp.experts." + std::to_string(e) + ".", c.moe_intermediate_size);
    } else {
      mlp(p + "mlp.", c.intermediate_size);
    }
    if (mtp) norm(p + "shared_head.norm.weight", D);
  }
  norm("model.norm.weight", D);
  mat("lm_head.weight", c.vocab_size, D);
  return s;
}

}  // namespace model

ParameterCount count_parameters(const ModelConfig& c) {
  ParameterCount pc;
  const int64_t expert = 3 * c.hidden_size * c.moe_intermediate_size;
  for (const auto& s : model::parameter_specs(c)) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    pc.total += n;
    if (s.name == "model.embed_tokens.weight") pc.embedding = n;
    if (s.name == "lm_head.weight") pc.head = n;
    if (s.name.rfind("model.layers." + std::to_string(c.num_hidden_layers) + ".", 0) == 0 && c.num_nextn_predict_layers > 0)
      pc.mtp += n;
  }
  const int64_t idle = (c.n_routed_experts - c.num_experts_per_tok) * expert;  // routed experts a token skips
  int64_t moe_main = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) moe_main += c.is_moe_layer(l);
  const int64_t moe_all = c.num_moe_layers();
  pc.activated = pc.total - moe_all * idle;
  pc.total_main = pc.total - pc.mtp;
  pc.activated_main = pc.total_main - moe_main * idle;
  return pc;
}

double Recipe::cache_bytes_per_element(bool attn_out) const {
  switch (linear) {
    case LinearPrecision::full: return double(dtype_size(act_dtype));
    case LinearPrecision::bf16: return 2.0;
    case LinearPrecision::fp8:
      return double(dtype_bytes(attn_out ? attn_out_cache : DType::e4m3, 128)) / 128.0 + 4.0 / 128.0 +
             (f32_cache ? double(dtype_size(act_dtype)) : 0.0);
  }
  return 0;
}

Recipe Recipe::from_name(std::string_view name) {
  Recipe r;
  r.name = std::string(name);
  if (name == "fp64") {
    r.act_dtype = DType::f64;
    r.attn_out_cache = DType::f64;
    r.attn_compute = DType::f64;
    r.residual_cache = DType::f64;
  } else if (name == "fp32") {
  } else if (name == "bf16") {
    r.linear = LinearPrecision::bf16;
    r.head_bf16 = true;
    r.attn_out_cache = DType::bf16;
  } else if (name == "fp8" || name == "fp8-no-promotion" || name == "fp8-per-tensor" || name == "fp8-f32-cache") {
    r.linear = LinearPrecision::fp8;
    r.head_bf16 = true;
    r.attn_out_cache = DType::e5m6;
    r.residual_cache = DType::bf16;
    // NOTES: AccumMode::fp32 sums each 128-wide K group exactly in FP32 and promotes with the
    // scales: the report's promotion every N_c = 128, without the 14-bit truncation inside a group.
    if (name == "fp8-no-promotion") r.accum = AccumConfig{AccumMode::tensor_core, 14, 0};
    if (name == "fp8-per-tensor") r.per_tensor = true;
    if (name == "fp8-f32-cache") {
      r.f32_cache = true;
      r.attn_out_cache = DType::e4m3;  // the exact copy serves the backward; the Fprop reads E4M3
      r.residual_cache = DType::f32;
    }
  } else {
    std::string all;
    for (auto& n : names()) all += (all.empty() ? "" : ", ") + n;
    FP8MOE_CHECK(false, "unknown recipe '" << name << "' (expected one of " << all << ")");
  }
  return r;
}

void Recipe::set_attention(std::string_view mode) {
  if (mode == "exact") {
    attn_compute = act_dtype;
  } else if (mode == "bf16") {
    attn_compute = DType::bf16;
  } else {
    FP8MOE_CHECK(false, "unknown attention precision '" << mode << "' (expected exact or bf16)");
  }
}

std::string Recipe::attention() const { return attn_compute == DType::bf16 ? "bf16" : "exact"; }

std::vector<std::string> Recipe::names() {
  return {"fp64", "fp32", "bf16", "fp8", "fp8-no-promotion", "fp8-per-tensor", "fp8-f32-cache"};
}

}  // namespace fp8moe
