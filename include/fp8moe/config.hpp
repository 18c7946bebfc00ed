// DeepSeek-V3-mini model configuration (docs/MODEL.md): the shape of the model, read from a JSON file
// whose keys are those of DeepSeek-V3's Hugging Face config.json (configs/*.json), validated with
// messages that name the offending key, and counted (total and activated parameters).
//   auto cfg = fp8moe::load_config("configs/tiny.json");
//   fp8moe::validate_config(cfg, fp8moe::Recipe::from_name("fp8"));  // throws fp8moe::Error
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace fp8moe {

struct Recipe;

struct ModelConfig {
  std::string name = "unnamed";
  int64_t vocab_size = 512;              // V
  int64_t hidden_size = 128;             // D
  int64_t num_hidden_layers = 2;         // L main layers (the MTP layer comes after them)
  int64_t first_k_dense_replace = 1;     // the first layers use a dense SwiGLU MLP, the rest MoE
  int64_t num_attention_heads = 2;       // H
  int64_t q_lora_rank = 128;             // query compression rank; 0 = plain q_proj
  int64_t kv_lora_rank = 128;            // joint KV latent rank
  int64_t qk_nope_head_dim = 64;         // per-head query/key dims without RoPE
  int64_t qk_rope_head_dim = 32;         // decoupled RoPE dims (key shared across heads)
  int64_t v_head_dim = 64;
  int64_t intermediate_size = 256;       // dense MLP hidden
  int64_t moe_intermediate_size = 128;   // hidden of one expert
  int64_t n_routed_experts = 8;          // E
  int64_t n_shared_experts = 1;          // shared expert = one MLP of n_shared * moe_intermediate
  int64_t num_experts_per_tok = 2;       // top-k
  int64_t n_group = 2;                   // expert groups (the analogue of nodes)
  int64_t topk_group = 1;                // groups a token may use (node-limited routing, M)
  double routed_scaling_factor = 1.0;    // applied to the normalized top-k weights
  bool norm_topk_prob = true;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 4096;
  int64_t num_nextn_predict_layers = 1;  // multi-token prediction depth (0 or 1)
  double mtp_loss_weight = 0.3;          // lambda of the MTP loss
  double aux_loss_alpha = 1e-4;          // sequence-wise balance loss weight (alpha)
  double bias_update_speed = 1e-3;       // gamma of auxiliary-loss-free balancing
  double initializer_range = 0.02;
  // Training shape, kept with the model so tests and tools agree (not a Hugging Face key).
  int64_t seq_len = 64;
  int64_t batch_size = 2;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t num_moe_layers() const;   // MoE layers among the main layers and the MTP layer
  bool is_moe_layer(int64_t layer) const;  // layer in [0, L + num_nextn_predict_layers)
  int64_t num_layers_total() const { return num_hidden_layers + num_nextn_predict_layers; }
};

// Parses a config (JSON) and refuses, naming the key: a key of the wrong type (a dimension of
// 128.5, a count given as a string), an unknown key (with the closest known one suggested), a
// missing key that fixes the model's shape (so `{}` is refused), and a DeepSeek-V3 Hugging Face
// key asking for what the model does not implement (scoring_func other than sigmoid, ...); the
// Hugging Face keys the model has no use for are accepted, so exported config.json files load.
// Keys that are absent and not required keep the defaults above.
// `name_or_path`: a file, or the name of a config shipped with the command ("tiny" or
// "tiny.json": share_dir()/configs/, fp8moe/paths.hpp), so it runs from any folder.
ModelConfig load_config(const std::string& name_or_path);
ModelConfig config_from_json(const std::string& json_text);
// The file load_config reads for `name_or_path`; raises fp8moe::Error listing the shipped names.
std::string find_config(const std::string& name_or_path);
std::string config_to_json(const ModelConfig& cfg);

// Throws fp8moe::Error naming the key and its range on: sizes outside [1, 2^24], non-finite or
// negative weights and rates, heads or groups not dividing,
// top-k > experts, topk_group > n_group, top-k not reachable within topk_group groups, odd RoPE
// dims, MTP depth other than 0/1; with an FP8 recipe, every GEMM K dim not a multiple of 128 (and
// batch_size * seq_len a multiple of 128 is NOT required: token dims are padded).
void validate_config(const ModelConfig& cfg);
void validate_config(const ModelConfig& cfg, const Recipe& recipe);

struct ParameterCount {
  int64_t total = 0;        // every parameter, the MTP layer included, embedding and head once
  int64_t activated = 0;    // per token: shared experts + top-k routed experts
  int64_t embedding = 0;    // embed_tokens
  int64_t head = 0;         // lm_head
  int64_t mtp = 0;          // the MTP layer without the shared embedding/head
  int64_t total_main = 0;   // total without the MTP layer (the report's 671B counts this)
  int64_t activated_main = 0;
};
ParameterCount count_parameters(const ModelConfig& cfg);

// Levenshtein distance, and the candidate closest to `word` when it is plausibly a typo of it
// (empty otherwise): the "did you mean" of config keys, config names and options.
size_t edit_distance(const std::string& a, const std::string& b);
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

namespace model {
// Parameter shapes by name (DeepSeek-V3's Hugging Face names), in model order, with their
// initialization (normal: N(0, initializer_range)); the model allocates them, predict_memory,
// count_parameters and serve::random_weights use the same list.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  enum Init { normal, ones, zeros } init = normal;
  bool trainable = true;
  bool decay = true;
};
std::vector<ParamSpec> parameter_specs(const ModelConfig& cfg);
}  // namespace model

}  // namespace fp8moe
