// Internals shared by the model's layers: the execution context, the cached activation of a
// Linear (what its Fprop consumed, kept for its Wgrad in the recipe's format), the Linear's three
// GEMMs per recipe, and the layer classes. Not a public header: users see include/fp8moe/model.hpp.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fp8moe/model.hpp"

namespace fp8moe::model {

// The weights as the GEMMs read them (BF16, or E4M3 in 128x128 blocks), converted once per
// forward/backward pass: the Fprop, the backward's recomputation (the MLA up-projections) and the
// Dgrad share one conversion. Entries exist only while a pass is open (Model runs each
// forward/backward inside one; the weights do not change within it); outside a pass every lookup
// converts afresh. The Dgrad, a weight's last use in a pass, takes its entry out, so the memory
// is returned as the backward proceeds.
class WeightCache {
 public:
  struct Entry {
    Tensor bf16;
    QuantizedTensor fp8;
  };
  // Open for the lifetime of a Pass; the entries go when it ends.
  class Pass {
   public:
    explicit Pass(WeightCache& c) : c_(c) { c_.open_ = true; }
    ~Pass() {
      c_.open_ = false;
      c_.entries_.clear();
    }
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;

   private:
    WeightCache& c_;
  };
  // w's converted form (Entry::bf16 or Entry::fp8): the pass's, or make()'s on a miss, which the
  // pass keeps; `last_use` takes the entry out. Outside a pass, make() every time.
  template <class T, class Make>
  T get(const Parameter& w, T Entry::*field, bool last_use, Make make) {
    if (!open_) return make();
    const auto it = entries_.try_emplace(&w).first;
    const T v = defined(it->second.*field) ? it->second.*field : make();
    if (last_use) entries_.erase(it);
    else it->second.*field = v;
    return v;
  }

 private:
  static bool defined(const Tensor& t) { return t.defined(); }
  static bool defined(const QuantizedTensor& q) { return q.values.defined(); }
  bool open_ = false;
  std::map<const Parameter*, Entry> entries_;
};

struct Ctx {
  Backend& be;
  const Recipe& recipe;
  const ModelConfig& cfg;
  WeightCache weights{};
  RoutedExperts* routed = nullptr;  // Model::set_routed_experts; null: the experts run here
  ExpertShard experts{};            // the routed experts whose parameters exist (count set)
  DType act() const { return recipe.act_dtype; }
  // A zero-filled activation: for outputs that an op accumulates into (or that are read before
  // every element is written).
  Tensor zeros(std::initializer_list<int64_t> shape) const { return be.zeros(recipe.act_dtype, shape); }
  // An activation without the zero fill (Backend::empty): for outputs that the next op
  // writes completely, without accumulating. The CPU backend fills it with NaN, so a read before
  // the write shows in the tests.
  Tensor empty(std::initializer_list<int64_t> shape) const { return be.empty(recipe.act_dtype, shape); }
};

// A non-owning view of rows [r0, r0 + n) of a contiguous 2-D tensor.
TensorView rows_view(const TensorView& t, int64_t r0, int64_t n);
// A zero tensor of the backend with t's dtype and shape, the same without the zero fill (for an op
// to overwrite whole), and a copy of t.
Tensor zeros_like(Backend& be, const TensorView& t);
Tensor empty_like(Backend& be, const TensorView& t);
Tensor clone(Ctx& c, const TensorView& t);
// x [R, C] converted to a new bf16 tensor on the backend.
Tensor to_bf16(Ctx& c, const TensorView& x);
// Rows [r0, r0 + n) and [0, n) of t, and t with another shape, as Tensors sharing t's storage.
Tensor rows_of(const Tensor& t, int64_t r0, int64_t n);
Tensor prefix_rows(const Tensor& t, int64_t n);
Tensor reshaped(const Tensor& t, std::initializer_list<int64_t> shape);

// An activation cached for backward in the recipe's format:
//   full  [T, K] act dtype (fp32/fp64 recipes)    bf16 [T, K] bf16 (bf16 recipe)
//   fp8   q [Tp, K] 1x128 tiles (E4M3, or E5M6 for the attention-out Linear input); Tp = T rounded
//         up to 128 when the tensor feeds a Wgrad (tokens are the Wgrad's K), zero rows past T.
struct Cached {
  int64_t rows = 0;
  Tensor full;
  QuantizedTensor q;
  bool defined() const { return full.defined() || q.values.defined(); }
  // The value as the GEMMs saw it, [T, K] act dtype (dequantized/converted).
  Tensor restore(Ctx& c) const;
  // Appends what is kept to an account (name = tensor name inside the layer).
  void account(std::vector<MemoryItem>& items, const std::string& layer, const std::string& name) const;
  void reset() { *this = Cached{}; }
};
// Caches x [T, K] (act dtype). qdtype/mode apply to FP8 recipes; pad_rows for Linear inputs.
Cached cache_activation(Ctx& c, const TensorView& x, DType qdtype, ScaleMode mode, bool pad_rows,
                        LinearPrecision prec);
inline Cached linear_input(Ctx& c, const TensorView& x, ScaleMode mode = ScaleMode::fp32,
                           DType qdtype = DType::e4m3) {
  return cache_activation(c, x, qdtype, mode, true, c.recipe.linear);
}
MemoryItem account_item(const std::string& layer, const std::string& name, const TensorView& t);

// A Linear's output gradient dy [T, N] as its Wgrad reads it, returned by its Dgrad and kept until
// backward-for-weights, which a pipeline schedule may defer:
//   full  full: dy itself
//   bf16  full: dy in BF16, converted once for the Dgrad and the Wgrad
//   fp8   t: dy^T [N, Tp] E4M3, 1x128 tiles along tokens, zero tokens past T (Tp = T rounded up
//         to 128, the rows of the cached Linear input); quantized in the same pass as the Dgrad's
//         dy tiles where the two shapes agree (Backend::quantize_1x128_and_128x1).
struct WgradDy {
  Tensor full;
  QuantizedTensor t;
};

// The three GEMMs of a Linear y [T, N] = x [T, K] w^T (w [N, K] master), in precision `prec`
// (the recipe's Linear precision, or bf16/full for the head and the gate).
void linear_forward(Ctx& c, const Cached& x, Parameter& w, const Tensor& y, LinearPrecision prec);
// dx [T, K] (+)= dy [T, N] w; returns dy for the Wgrad. dy_mode: scale mode of dy's FP8 tiles.
WgradDy linear_backward_input(Ctx& c, const Tensor& dy, Parameter& w, const Tensor& dx, bool accumulate,
                              LinearPrecision prec, ScaleMode dy_mode = ScaleMode::fp32);
// w.grad [N, K] += dy^T x, dy as the Dgrad returned it.
void linear_backward_weight(Ctx& c, const Cached& x, const WgradDy& dy, Parameter& w, LinearPrecision prec);

// The G matrices stacked from w (G = 1: w itself) as the GEMMs read them, from the pass's cache
// when one is open (WeightCache); `last_use` (the Dgrad) takes the entry out of the cache.
TensorView stacked(const Tensor& first, int64_t groups);
Tensor weight_bf16(Ctx& c, const Parameter& w, int64_t groups, bool last_use);
QuantizedTensor weight_fp8(Ctx& c, const Parameter& w, int64_t groups, bool last_use);

// A host tensor (small index/weight vectors) on the backend.
Tensor to_backend(Ctx& c, const Tensor& host);

// A sublayer's input x [T, D] as it keeps it for its RMSNorm (Recipe::residual_cache): x itself, or
// x in BF16; and the norm's input from it, in the activation dtype (x itself, or bf16(x) widened).
Tensor keep_residual(Ctx& c, const Tensor& x);
Tensor norm_input(Ctx& c, const Tensor& kept);

// RMSNorm helpers: y = norm(x), rstd out.
void rmsnorm(Ctx& c, const Tensor& x, Parameter& w, const Tensor& y, const Tensor& rstd);
// linear_input(rmsnorm(x)) for a norm whose output only feeds Linears: one pass in the FP8
// recipes (Backend::rmsnorm_forward_fp8, bit-identical), the two steps otherwise.
Cached rmsnorm_linear_input(Ctx& c, const Tensor& x, Parameter& w, const Tensor& rstd, ScaleMode mode);

// The routed experts of a MoE layer run together over the expert-sorted layout (moe_layout):
// the group tables on the device, and the Linears as grouped FP8 GEMMs (grouped_linear.cpp) on
// the stacked expert matrices whose first expert's Parameter is passed.
struct ExpertGroups {
  int64_t groups = 0;
  Tensor row_group;  // [R] i32
  Tensor offsets;    // [G + 1] i32
  std::vector<int64_t> start, count;  // host: each group's first row and rows (padded to 128)
};
// Raises unless the Parameters (one matrix kind, expert by expert) are rows of one stacked tensor.
void check_stacked(const std::vector<Parameter*>& per_expert);
void grouped_linear_forward(Ctx& c, const ExpertGroups& eg, const Cached& x, Parameter& w0, const Tensor& y);
WgradDy grouped_linear_backward_input(Ctx& c, const ExpertGroups& eg, const Tensor& dy, Parameter& w0,
                                      const Tensor& dx, bool accumulate, ScaleMode dy_mode);
void grouped_linear_backward_weight(Ctx& c, const ExpertGroups& eg, const Cached& x, const WgradDy& dy, Parameter& w0);

// SwiGLU MLP (dense MLP, shared expert, one routed expert, or all routed experts grouped) on a
// cached normalized input.
struct MlpParams {
  Parameter* gate = nullptr;  // [F, D] (the first expert's when grouped)
  Parameter* up = nullptr;    // [F, D]
  Parameter* down = nullptr;  // [D, F]
  const ExpertGroups* grouped = nullptr;  // set: the Linears run grouped over all experts
};
struct MlpState {
  Cached in;        // the input as its gate/up Linears consumed it
  Cached g, u;      // the SwiGLU input (gate and up outputs), cached for the recomputation
  WgradDy dy, dg, du;  // output gradients kept from B for W
  Cached a;         // the recomputed SwiGLU output, kept from B for the down_proj Wgrad
  void account(std::vector<MemoryItem>& items, const std::string& layer, const std::string& prefix) const;
};
// out [T, D] = down(swiglu(gate(x), up(x))); the input must be in st.in.
void mlp_forward(Ctx& c, const MlpParams& p, MlpState& st, const Tensor& out, ScaleMode in_mode);
// dx [T, D] (+)= d/dx of dy [T, D]; dy_mode: scale mode of the down_proj output gradient tiles.
// With combine_grad [T] defined, also writes rows_dot(d(swiglu out), swiglu out), which for a
// routed expert fed w * dy is w times the gradient of its combine weight.
void mlp_backward_input(Ctx& c, const MlpParams& p, MlpState& st, const Tensor& dy, const Tensor& dx,
                        bool accumulate, ScaleMode dy_mode, const Tensor* combine_grad = nullptr);
void mlp_backward_weight(Ctx& c, const MlpParams& p, MlpState& st);

// Looks up parameters by name (the model's list, filled before layers are built).
using ParamLookup = std::function<Parameter*(const std::string&)>;

std::unique_ptr<Layer> make_attention_layer(Ctx& c, int64_t layer, const ParamLookup& get);
std::unique_ptr<Layer> make_mlp_layer(Ctx& c, int64_t layer, const ParamLookup& get);
std::unique_ptr<Layer> make_moe_layer(Ctx& c, int64_t layer, const ParamLookup& get);

}  // namespace fp8moe::model
