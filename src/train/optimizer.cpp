// AdamW with BF16 moments, learning-rate schedule, global-norm clipping (include/fp8moe/optimizer.hpp).
#include "fp8moe/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>

namespace fp8moe {

float LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return peak * float(step + 1) / float(warmup_steps);
  const int64_t decay = std::max<int64_t>(total_steps - warmup_steps, 1);
  const double p = std::min(1.0, double(step - warmup_steps) / double(decay));
  return float(min + (peak - min) * 0.5 * (1.0 + std::cos(M_PI * p)));
}

namespace {

const char* end_of(const TensorView& t) { return static_cast<const char*>(t.data) + t.nbytes(); }

TensorView flat_run(const TensorView& first, int64_t n) { return TensorView(first.data, first.dtype, {n}, first.device); }

// Elements [off, off + n) of a flat tensor, sharing its storage.
Tensor slice(const Tensor& t, int64_t off, int64_t n) {
  const TensorView v(static_cast<char*>(t.view().data) + off * int64_t(dtype_size(t.dtype())), t.dtype(), {n},
                     t.device());
  auto keep = std::make_shared<Tensor>(t);
  return Tensor(std::shared_ptr<void>(keep, v.data), v);
}

}  // namespace

TensorView ParamRun::value(const std::vector<ParamRef>& ps) const { return flat_run(ps[index[0]].value, numel); }
TensorView ParamRun::grad(const std::vector<ParamRef>& ps) const { return flat_run(ps[index[0]].grad, numel); }

std::vector<ParamRun> contiguous_runs(const std::vector<ParamRef>& params, bool with_grads) {
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::less<const void*>()(params[a].value.data, params[b].value.data);
  });
  const auto follows = [&](const ParamRef& prev, const ParamRef& next) {
    if (next.value.data != end_of(prev.value) || next.value.dtype != prev.value.dtype) return false;
    return !with_grads || (next.grad.data == end_of(prev.grad) && next.weight_decay == prev.weight_decay);
  };
  std::vector<ParamRun> runs;
  for (size_t k = 0; k < order.size(); ++k) {
    if (k == 0 || !follows(params[order[k - 1]], params[order[k]])) runs.emplace_back();
    ParamRun& r = runs.back();
    r.index.push_back(order[k]);
    r.offset.push_back(r.numel);
    r.numel += params[order[k]].value.numel();
  }
  return runs;
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
  }
  // Parameters whose values and gradients follow each other in memory are updated as one run:
  // one entry of adamw_steps each, the same numbers (the update is elementwise). Their moments are slices of
  // one run tensor.
  m_.resize(params_.size());
  v_.resize(params_.size());
  for (const ParamRun& r : contiguous_runs(params_, true)) {
    Run run{r.value(params_), r.grad(params_), backend.zeros(md, {r.numel}), backend.zeros(md, {r.numel}),
            params_[r.index[0]].weight_decay};
    for (size_t j = 0; j < r.index.size(); ++j) {
      const int64_t c = params_[r.index[j]].value.numel();
      m_[r.index[j]] = slice(run.m, r.offset[j], c);
      v_[r.index[j]] = slice(run.v, r.offset[j], c);
    }
    runs_.push_back(std::move(run));
  }
}

void AdamW::step(float lr, float grad_scale) {
  ++t_;
  std::vector<Backend::AdamWTensors> ts;
  for (const Run& r : runs_) ts.push_back({r.value, r.grad, r.m.view(), r.v.view(), r.decay ? cfg_.weight_decay : 0.0f});
  backend_.adamw_steps(ts, {lr, cfg_.beta1, cfg_.beta2, cfg_.eps, 0.0f, grad_scale, t_});
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
