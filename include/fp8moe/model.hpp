// DeepSeek-V3-mini (docs/MODEL.md): MLA attention, dense SwiGLU MLP for the first layers, DeepSeekMoE
// (shared + routed experts, sigmoid affinity, group-limited top-k, auxiliary-loss-free bias, a
// sequence-wise balance loss), output head and a depth-1 multi-token-prediction (MTP) module that
// shares the embedding and the head. Written once against the Backend interface; every layer has
// an explicit forward and a backward split into backward-for-input (B) and backward-for-weights
// (W), callable separately as ZeroBubble and DualPipe schedules need.
//
// Trainer use:
//   auto be = fp8moe::make_backend("cpu");
//   fp8moe::Model model(fp8moe::load_config("configs/tiny.json"), fp8moe::Recipe::from_name("fp8"), *be, seed);
//   model.zero_grad();
//   auto st = model.forward_backward(tokens, targets, 1.0 / micro_batches);  // [B, S] i32 each
//   ... optimizer on model.parameters() (weight/grad, FP32) ...
//   model.update_routing_bias(st.expert_loads, cfg.bias_update_speed);
// Parameters carry DeepSeek-V3's Hugging Face names (model.layers.{i}.self_attn.q_a_proj.weight,
// model.layers.{i}.mlp.experts.{e}.gate_proj.weight, model.layers.{i}.mlp.gate.weight,
// model.layers.{i}.mlp.gate.e_score_correction_bias, model.embed_tokens.weight, model.norm.weight,
// lm_head.weight; the MTP layer is model.layers.{L} with enorm, hnorm, eh_proj, shared_head.norm).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/model_recipe.hpp"

namespace fp8moe {

struct Parameter {
  std::string name;       // Hugging Face DeepSeek-V3 tensor name
  Tensor weight;          // master weight, [out, in] for matrices; f32 (f64 in the fp64 recipe)
  Tensor grad;            // same shape and dtype; forward_backward accumulates into it
  bool trainable = true;  // false for e_score_correction_bias (moved by update_routing_bias)
  bool decay = true;      // weight decay applies: matrices yes; norms, bias no
};

// Geometry of one micro-batch: B sequences of S tokens, flattened to T = B * S rows.
struct Batch {
  int64_t batch = 0, seq = 0;
  Tensor tokens;     // [T] i32 on the backend
  Tensor targets;    // [T] i32: next token of each position, -1 = ignored
  Tensor positions;  // [T] i32: position inside its sequence (RoPE)
  double grad_scale = 1.0;  // gradients are of grad_scale * loss (layers with their own loss use it)
  // The MTP module's inputs (token t+1, 0 where ignored) and targets (token t+2 inside the
  // sequence, else -1), [T] i32 on the backend; and the targets each head's mean divides by
  // (non-ignored ones, at least 1), counted where the targets came from the host.
  Tensor mtp_ids, mtp_targets;
  int64_t main_count = 1, mtp_count = 1;
  // [Model::stats_width()] f64 on the backend, zero-filled: the layers and heads write what the
  // step reports into it (Model::step_stats), so that it is read back once, at the end.
  Tensor stats;
  int64_t tokens_count() const { return batch * seq; }
};

struct StepStats {
  double loss = 0;          // main + mtp_loss_weight * mtp + balance: what the gradients are of
  double main_loss = 0;     // mean next-token cross-entropy over non-ignored targets
  double mtp_loss = 0;      // mean cross-entropy of the MTP module (predicts token t+2); 0 without
  double balance_loss = 0;  // sum over MoE layers of aux_loss_alpha * sequence-wise balance loss
  int64_t tokens = 0;
  // Tokens routed to each expert, per MoE layer in execution order (main layers, then MTP):
  // [num_moe_layers][n_routed_experts]. Input of update_routing_bias.
  std::vector<std::vector<int64_t>> expert_loads;
};

// One tensor kept from forward to backward.
struct MemoryItem {
  std::string layer;   // "layers.3.attn", "layers.3.moe", "embed", "head", "mtp.eh", ...
  std::string tensor;  // "x", "rstd", "h_fp8", ...
  DType dtype = DType::f32;
  int64_t elements = 0;
  int64_t bytes = 0;   // storage bytes (FP8 scales included)
};
struct MemoryAccount {
  std::vector<MemoryItem> items;
  int64_t total_bytes() const;
  std::map<std::string, int64_t> bytes_per_layer() const;  // keyed by MemoryItem::layer
};
// Bytes each layer keeps for backward for a micro-batch of `tokens` tokens, from the config and the
// recipe alone (routed experts assumed perfectly balanced unless `loads` gives the tokens per
// expert per MoE layer). Matches Model::saved_memory() after a forward of that many tokens.
MemoryAccount predict_memory(const ModelConfig& cfg, const Recipe& recipe, int64_t tokens,
                             const std::vector<std::vector<int64_t>>* loads = nullptr);

// State one layer keeps from its forward until its backward, for one micro-batch (several can be
// in flight, as in pipeline schedules). B may drop what only B needed; W frees the rest.
struct Saved {
  virtual ~Saved() = default;
  std::vector<MemoryItem> kept;  // what forward stored (the memory account)
};

// One schedulable piece of the trunk: y [T, D] = x + f(x), with forward, backward-for-input and
// backward-for-weights. The model's trunk is [layer 0 attention, layer 0 mlp|moe, layer 1 ...].
class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::string name() const = 0;  // "layers.0.attn", "layers.1.moe"
  // x [T, D] -> y [T, D] (both act dtype). Returns the state backward needs.
  virtual std::unique_ptr<Saved> forward(const Batch& b, const Tensor& x, Tensor& y) = 0;
  // dy [T, D] -> dx [T, D]; keeps in `s` the output gradients that backward_weight needs.
  virtual void backward_input(const Batch& b, Saved& s, const Tensor& dy, Tensor& dx) = 0;
  // Accumulates this layer's weight gradients (scaled like dy) and releases `s`'s tensors.
  virtual void backward_weight(const Batch& b, Saved& s) = 0;
  // Extra scalar losses this layer added (the balance loss of a MoE layer), and its expert loads:
  // read back from the device (what it wrote into Batch::stats), for tests and records.
  virtual double aux_loss(const Saved&) const { return 0; }
  virtual std::vector<int64_t> expert_loads(const Saved&) const { return {}; }
};

namespace model {
struct Ctx;
}

// Where the routed experts of the MoE layers run. Without one (the default) they run in this
// process over the expert-sorted layout (src/model/moe.cpp); an implementation may move the tokens
// to other ranks (src/parallel/runtime/expert_parallel.cpp). The gate, the routing, the shared
// expert and the balance loss stay in the layer either way.
class RoutedExperts {
 public:
  struct State {
    virtual ~State() = default;
    std::vector<MemoryItem> kept;  // what forward kept for backward (the memory account)
  };
  virtual ~RoutedExperts() = default;
  // Adds sum_j w[t, j] expert_{idx[t, j]}(h[t]) into y [T, D]; h [T, D] act (the norm output),
  // idx [T, k] i32, w [T, k] act, of MoE layer `layer` (the model's layer number).
  virtual std::unique_ptr<State> forward(model::Ctx& c, int64_t layer, const Tensor& h, const Tensor& idx,
                                         const Tensor& w, const Tensor& y) = 0;
  // From dy [T, D], the output gradient: adds the gradient of h into dh [T, D] and writes the
  // combine weights' gradient dw [T, k] (dy[t] . expert_{idx[t, j]}(h[t])).
  virtual void backward_input(model::Ctx& c, State& s, const Tensor& dy, const Tensor& w, const Tensor& dh,
                              const Tensor& dw) = 0;
  // Accumulates the experts' weight gradients and releases what `s` kept.
  virtual void backward_weight(model::Ctx& c, State& s) = 0;
};

// The routed experts a model holds of every MoE layer: [first, first + count); count 0: all.
// An expert-parallel rank holds its own (the stacked expert tensors are [count * rows, cols],
// local expert i at rows i * rows); the others run on other ranks, behind set_routed_experts.
struct ExpertShard {
  int64_t first = 0, count = 0;
};

// The parts of the model a pipeline rank holds (pipeline::stage_shard makes one from a schedule):
// the trunk sublayers of its stages (sublayer 2 l: layer l's attention with input_layernorm,
// 2 l + 1: its post_attention_layernorm with the MLP or MoE), the embedding, and the head side
// (the final norm, lm_head and the MTP module, which also reads the embedding). Default: all.
struct StageShard {
  std::vector<bool> sublayers;  // [trunk size]; empty: every sublayer
  bool embedding = true, head = true;
  bool whole() const;
  // Whether the parameter `name` of a model of `cfg` is held (throws on a name not of cfg's model).
  bool holds(const ModelConfig& cfg, std::string_view name) const;
};

class Model {
 public:
  // Allocates the parameters on `backend` and initializes them from `seed` (normal(0, std) for
  // matrices, ones for norms, zeros for the routing bias). Validates cfg against the recipe.
  // With a shard, the parameters of the other routed experts are absent and every value is the
  // one the whole model would get from `seed`. With a stage shard, so are the parameters of the
  // parts it does not hold: their trunk() entries are nullptr, and only the pipeline executor,
  // running the parts held, can run the model (forward_backward and forward need it whole).
  Model(const ModelConfig& cfg, const Recipe& recipe, Backend& backend, uint64_t seed = 0, ExpertShard shard = {},
        StageShard stages = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const;
  const Recipe& recipe() const;
  Backend& backend() const;
  // The routed experts held: count is n_routed_experts without a shard.
  ExpertShard expert_shard() const;
  const StageShard& stage_shard() const;

  std::vector<Parameter>& parameters();
  Parameter& parameter(std::string_view name);          // throws naming the unknown parameter
  Parameter* find_parameter(std::string_view name);     // nullptr when absent
  int64_t num_parameters() const;
  void init_weights(uint64_t seed);
  void zero_grad();
  // The weight of the MTP loss from now on (the trainer's schedule); >= 0.
  void set_mtp_loss_weight(double w);

  // Builds the Batch of tokens/targets [B, S] i32 (host or backend tensors); `stats` is its
  // Batch::stats (zero-filled [stats_width()] f64 on the backend: a pipeline puts all of a step's
  // micro-batches in one tensor) or undefined (allocated here).
  Batch make_batch(const TensorView& tokens, const TensorView& targets, const Tensor& stats = Tensor()) const;
  // Batch::stats: [main loss sum, MTP loss sum, then per MoE layer in execution order (the trunk's,
  // then the MTP module's) its balance loss and n_routed_experts loads]; step_stats makes the
  // StepStats of a micro-batch from a host copy of it.
  int64_t stats_width() const;
  StepStats step_stats(const Batch& b, const double* stats) const;
  // Forward and backward of one micro-batch: gradients of grad_scale * loss are ADDED to every
  // parameter's grad (accumulation across micro-batches; call zero_grad before a step).
  StepStats forward_backward(const TensorView& tokens, const TensorView& targets, double grad_scale = 1.0);
  // Forward only (evaluation): losses and loads, nothing kept.
  StepStats forward(const TensorView& tokens, const TensorView& targets);
  // Main logits [T, V] f32|f64 of the last forward or forward_backward.
  const Tensor& last_logits() const;
  // Bytes kept for backward by the last forward_backward, per layer (measured); after a
  // head_forward_backward called on its own (a pipeline's last stage), those its MTP module kept.
  const MemoryAccount& saved_memory() const;

  // Auxiliary-loss-free balancing: b_i += gamma * sign(mean load - load_i) per MoE layer, with
  // loads as returned in StepStats::expert_loads (summed over micro-batches by the caller): every
  // MoE layer of the config, those whose bias a stage shard leaves out skipped.
  void update_routing_bias(const std::vector<std::vector<int64_t>>& loads, double gamma);

  // The routed experts of every MoE layer run through `r` from now on (nullptr: in this process).
  void set_routed_experts(std::shared_ptr<RoutedExperts> r);

  // The trunk for pipeline schedules: layers in execution order (attention and MLP halves);
  // nullptr for a sublayer a stage shard leaves out.
  std::vector<Layer*> trunk();
  // Embedding: tokens -> x0 [T, D]; its backward accumulates into embed_tokens.grad.
  Tensor embed_forward(const Batch& b);
  void embed_backward(const Batch& b, const Tensor& dx0);
  // Final norm + head + cross-entropy (+ the MTP module when enabled). Takes the trunk output,
  // returns dh [T, D] for the trunk's backward, adds head/norm/MTP gradients, writes the losses
  // (and the MTP module's balance losses and loads) into b.stats. The
  // MTP module keeps its own copy of h (Recipe::residual_cache); forward_backward hands the trunk
  // output over instead, so that its storage goes once the main head is done.
  Tensor head_forward_backward(const Batch& b, const Tensor& h, double grad_scale, bool backward);
  // While the returned handle lives, the BF16/FP8 form of a weight made by a forward is reused
  // by the backward that uses it last, as forward_backward does within one micro-batch: the
  // pipeline executor holds one over a step. The weights must not change meanwhile.
  std::shared_ptr<void> share_weight_conversions();

  // Sublayer records (the teacher-forced reference check, tests/reference/compare.py): while on,
  // forward_backward and forward keep host copies of what every sublayer saw and returned, named
  // sub.<i>.<sublayer>.<what> in execution order: the trunk's sublayers (layers.<l>.attn|mlp|moe:
  // x, y, dy, dx; a MoE layer also aux, its balance loss), the final norm + head + cross-entropy (head: x, y = logits, loss, dx), then with
  // MTP its embedding/hnorm/eh_proj part (layers.<L>.eh: x = trunk output, y, dy, dx = its own
  // contribution to the trunk output's gradient), its block's sublayers, and its shared head
  // (layers.<L>.shared_head: x, y = logits, loss = unweighted MTP loss, dx). Each run replaces the
  // previous records; off (the default) nothing is copied.
  void record_sublayers(bool on);
  const std::vector<std::pair<std::string, Tensor>>& sublayer_records() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Safetensors I/O of the parameters (F32 tensors, Hugging Face names; F64 in the fp64 recipe;
// any other tensors: fp8moe/safetensors.hpp). The PyTorch reference (tests/reference/) reads what
// save writes.
void save_safetensors(const std::string& path, Model& model);
void load_safetensors(const std::string& path, Model& model);  // throws on missing/mis-shaped tensors

}  // namespace fp8moe
