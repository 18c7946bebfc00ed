// AdamW with the report's precision policy (§3.3.3): FP32 master weights and FP32 gradients, first
// and second moments stored in BF16 (MomentPrecision::f32 for comparison); a warm-up + cosine
// learning-rate schedule and clipping by the global gradient norm.
// The update runs through the Backend (adamw_step, sum_squares) where the parameters live; the CPU
// and CUDA updates are bit-identical, so checkpoints move between the two.
#pragma once
#include <string>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {

struct ParamRef {
  std::string name;
  TensorView value;  // f32 master weight
  TensorView grad;   // f32 gradient, same shape
  bool weight_decay = true;
};

// Parameters stored one after another (the routed experts' stacked matrices), found by address:
// each run lists its parameters in memory order with their element offsets, and its total size.
// with_grads: the gradients must follow each other too, and weight_decay agree.
struct ParamRun {
  std::vector<size_t> index;   // into the parameter list
  std::vector<int64_t> offset; // elements from the run's first value
  int64_t numel = 0;
  TensorView value(const std::vector<ParamRef>& ps) const;  // [numel] f32, the run's values
  TensorView grad(const std::vector<ParamRef>& ps) const;   // [numel] f32, the run's gradients
};
std::vector<ParamRun> contiguous_runs(const std::vector<ParamRef>& params, bool with_grads);

enum class MomentPrecision : uint8_t { bf16, f32 };

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  MomentPrecision moments = MomentPrecision::bf16;
};

struct LrSchedule {
  float peak = 3e-4f, min = 3e-5f;
  int64_t warmup_steps = 100, total_steps = 1000;
  float at(int64_t step) const;  // step counts from 0
};

class AdamW {
 public:
  // Moments are allocated (zero) on `backend`, next to the parameters.
  AdamW(Backend& backend, std::vector<ParamRef> params, AdamWConfig cfg);
  // One update with learning rate `lr`; gradients are multiplied by `grad_scale` first (clipping).
  void step(float lr, float grad_scale = 1.0f);
  int64_t steps() const { return t_; }
  void set_steps(int64_t t) { t_ = t; }
  const std::vector<ParamRef>& params() const { return params_; }
  // Moment tensors, parallel to params(): [numel] bf16 or f32 (slices of one tensor for parameters
  // stored one after another, which are updated together).
  const std::vector<Tensor>& first_moments() const { return m_; }
  const std::vector<Tensor>& second_moments() const { return v_; }
  const AdamWConfig& config() const { return cfg_; }

 private:
  Backend& backend_;
  std::vector<ParamRef> params_;
  AdamWConfig cfg_;
  std::vector<Tensor> m_, v_;
  struct Run {  // parameters contiguous in memory, updated by one adamw_step
    TensorView value, grad;
    Tensor m, v;
    bool decay;
  };
  std::vector<Run> runs_;
  int64_t t_ = 0;
};

// sqrt(sum of squares) over all gradients (FP64 accumulation).
double global_grad_norm(Backend& backend, const std::vector<ParamRef>& params);
// The factor that brings the norm to at most max_norm (1 when already below, or max_norm <= 0).
float clip_scale(double norm, float max_norm);

}  // namespace fp8moe
