// AdamW with BF16 moments, learning-rate schedule, global-norm clipping (include/fp8moe/optimizer.hpp).
#include "fp8moe/optimizer.hpp"

#include <cmath>

namespace fp8moe {

float LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return peak * float(step + 1) / float(warmup_steps);
  const int64_t decay = std::max<int64_t>(total_steps - warmup_steps, 1);
  const double p = std::min(1.0, double(step - warmup_steps) / double(decay));
  return float(min + (peak - min) * 0.5 * (1.0 + std::cos(M_PI * p)));
}

AdamW::AdamW(Backend& backend, std::vector<ParamRef> params, AdamWConfig cfg)
    : backend_(backend), params_(std::move(params)), cfg_(cfg) {
  const DType md = cfg.moments == MomentPrecision::bf16 ? DType::bf16 : DType::f32;
  for (auto& p : params_) {
    check_tensor(p.value, (p.name + ".value").c_str(), DType::f32, p.value.ndim);
    check_tensor(p.grad, (p.name + ".grad").c_str(), DType::f32, p.grad.ndim);
    FP8MOE_CHECK(p.value.numel() == p.grad.numel(), p.name << ": gradient " << p.grad.str() << " does not match " << p.value.str());
    FP8MOE_CHECK(p.value.device == backend.device(), p.name << ": on " << device_name(p.value.device) << ", the optimizer's backend '"
                                                          << backend.name() << "' works on " << device_name(backend.device()));
    m_.push_back(backend.empty(md, {p.value.numel()}));
    v_.push_back(backend.empty(md, {p.value.numel()}));
  }
}

void AdamW::step(float lr, float grad_scale) {
  ++t_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamRef& p = params_[i];
    Backend::AdamWStep s{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, p.weight_decay ? cfg_.weight_decay : 0.0f, grad_scale, t_};
    backend_.adamw_step(p.value, p.grad, m_[i].view(), v_[i].view(), s);
  }
}

double global_grad_norm(Backend& backend, const std::vector<ParamRef>& params) {
  std::vector<TensorView> grads;
  for (auto& p : params) grads.push_back(p.grad);
  const double ss = backend.sum_squares_all(grads);
  return std::sqrt(ss);
}

float clip_scale(double norm, float max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0f;
  return float(max_norm / norm);
}

}  // namespace fp8moe
