// AdamW with BF16 moments, learning-rate schedule, global-norm clipping (include/fp8moe/optimizer.hpp).
#include "fp8moe/optimizer.hpp"

#include <cmath>

#include "fp8moe/codecs.hpp"

namespace fp8moe {

float LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return peak * float(step + 1) / float(warmup_steps);
  const int64_t decay = std::max<int64_t>(total_steps - warmup_steps, 1);
  const double p = std::min(1.0, double(step - warmup_steps) / double(decay));
  return float(min + (peak - min) * 0.5 * (1.0 + std::cos(M_PI * p)));
}

AdamW::AdamW(std::vector<ParamRef> params, AdamWConfig cfg) : params_(std::move(params)), cfg_(cfg) {
  const DType md = cfg.moments == MomentPrecision::bf16 ? DType::bf16 : DType::f32;
  for (auto& p : params_) {
    check_tensor(p.value, (p.name + ".value").c_str(), DType::f32, p.value.ndim);
    check_tensor(p.grad, (p.name + ".grad").c_str(), DType::f32, p.grad.ndim);
    FP8MOE_CHECK(p.value.numel() == p.grad.numel(), p.name << ": gradient " << p.grad.str() << " does not match " << p.value.str());
    FP8MOE_CHECK(p.value.device == Device::cpu, p.name << ": AdamW here needs host tensors");
    TensorView like = p.value;
    like.dtype = md;
    m_.push_back(Tensor::host_like(like));
    v_.push_back(Tensor::host_like(like));
  }
}

void AdamW::step(float lr, float grad_scale) {
  ++t_;
  const double bc1 = 1.0 - std::pow(double(cfg_.beta1), double(t_));
  const double bc2 = 1.0 - std::pow(double(cfg_.beta2), double(t_));
  const float b1 = cfg_.beta1, b2 = cfg_.beta2;
  const bool bf16 = cfg_.moments == MomentPrecision::bf16;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamRef& p = params_[i];
    float* w = p.value.ptr<float>();
    const float* g = p.grad.ptr<const float>();
    const float wd = p.weight_decay ? cfg_.weight_decay : 0.0f;
    const int64_t n = p.value.numel();
    auto* m16 = m_[i].ptr<uint16_t>();
    auto* v16 = v_[i].ptr<uint16_t>();
    auto* m32 = m_[i].ptr<float>();
    auto* v32 = v_[i].ptr<float>();
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
      const float gj = g[j] * grad_scale;
      float m = bf16 ? bf16_decode(m16[j]) : m32[j];
      float v = bf16 ? bf16_decode(v16[j]) : v32[j];
      m = b1 * m + (1 - b1) * gj;
      v = b2 * v + (1 - b2) * gj * gj;
      if (bf16) {
        m16[j] = bf16_encode(m);
        v16[j] = bf16_encode(v);
      } else {
        m32[j] = m;
        v32[j] = v;
      }
      const double update = (double(m) / bc1) / (std::sqrt(double(v) / bc2) + cfg_.eps);
      w[j] = float(double(w[j]) - double(lr) * (update + double(wd) * w[j]));
    }
  }
}

double global_grad_norm(const std::vector<ParamRef>& params) {
  double ss = 0;
  for (auto& p : params) {
    const float* g = p.grad.ptr<const float>();
    const int64_t n = p.grad.numel();
#pragma omp parallel for reduction(+ : ss) schedule(static)
    for (int64_t j = 0; j < n; ++j) ss += double(g[j]) * g[j];
  }
  return std::sqrt(ss);
}

float clip_scale(double norm, float max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0f;
  return float(max_norm / norm);
}

}  // namespace fp8moe
