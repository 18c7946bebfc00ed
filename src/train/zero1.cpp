// ZeRO-1 AdamW over a data-parallel communicator (include/fp8moe/zero1.hpp). Tested by
// tests/parallel/test_parallel_mpi.cpp under mpirun (bit-identical to AdamW on one rank).
#include "fp8moe/zero1.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

namespace fp8moe {

Zero1AdamW::Zero1AdamW(Backend& backend, Comm& dp, std::vector<ParamRef> params, AdamWConfig cfg)
    : be_(backend), dp_(dp), params_(std::move(params)), cfg_(cfg) {
  for (auto& p : params_) {
    check_tensor(p.value, (p.name + ".value").c_str(), DType::f32, p.value.ndim);
    check_tensor(p.grad, (p.name + ".grad").c_str(), DType::f32, p.grad.ndim);
    FP8MOE_CHECK(p.value.numel() == p.grad.numel() && p.value.is_contiguous() && p.grad.is_contiguous(),
                 p.name << ": gradient " << p.grad.str() << " and value " << p.value.str() << " must match, contiguous");
  }
  for (int pass = 0; pass < 2; ++pass)  // decayed first: a shard has at most two runs
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].weight_decay == (pass == 0)) order_.push_back(i);
  offset_.assign(params_.size(), 0);
  for (size_t i : order_) {
    offset_[i] = numel_;
    numel_ += params_[i].value.numel();
    if (params_[i].weight_decay) decayed_ = numel_;
  }
  const int64_t D = dp.size();
  shard_ = std::max<int64_t>((numel_ + D - 1) / D, 1);
  lo_ = int64_t(dp.rank()) * shard_;
  const DType md = cfg.moments == MomentPrecision::bf16 ? DType::bf16 : DType::f32;
  bucket_ = be_.zeros(DType::f32, {D * shard_});  // the padding past numel_ stays zero
  grad_ = be_.zeros(DType::f32, {shard_});
  master_ = be_.zeros(DType::f32, {shard_});
  m_ = be_.zeros(md, {shard_});
  v_ = be_.zeros(md, {shard_});
  reload_master();
}

TensorView Zero1AdamW::flat(const Tensor& t, int64_t off, int64_t n) const {
  const TensorView v = t.view();
  return TensorView(static_cast<char*>(v.data) + off * int64_t(dtype_size(v.dtype)), v.dtype, {n}, v.device);
}

void Zero1AdamW::to_bucket(bool grads) {
  for (size_t i : order_) {
    const TensorView& src = grads ? params_[i].grad : params_[i].value;
    be_.copy(flat(bucket_, offset_[i], src.numel()), TensorView(src.data, src.dtype, {src.numel()}, src.device));
  }
}

void Zero1AdamW::reload_master() {
  to_bucket(false);
  be_.copy(master_.view(), flat(bucket_, lo_, shard_));
}

void Zero1AdamW::reduce_gradients() {
  to_bucket(true);
  dp_.reduce_scatter(bucket_.view(), grad_.view(), be_.stream());
}

double Zero1AdamW::grad_norm() {
  Tensor ss = Tensor::host(DType::f64, {1});
  ss.ptr<double>()[0] = be_.sum_squares(grad_.view());
  Tensor dev = be_.empty(DType::f64, {1});
  be_.copy(dev.view(), ss.view());
  dp_.all_reduce(dev.view(), be_.stream());
  be_.copy(ss.view(), dev.view());
  be_.synchronize();
  return std::sqrt(ss.ptr<double>()[0]);
}

void Zero1AdamW::step(float lr, float grad_scale) {
  ++t_;
  // This shard's part of [0, decayed_) and of [decayed_, numel_): one adamw_step each.
  const int64_t hi = std::min(lo_ + shard_, numel_);
  for (const auto& [a, b, decay] : {std::tuple{lo_, std::min(hi, decayed_), true}, std::tuple{std::max(lo_, decayed_), hi, false}}) {
    if (b <= a) continue;
    Backend::AdamWStep s{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, decay ? cfg_.weight_decay : 0.0f, grad_scale, t_};
    be_.adamw_step(flat(master_, a - lo_, b - a), flat(grad_, a - lo_, b - a), flat(m_, a - lo_, b - a),
                   flat(v_, a - lo_, b - a), s);
  }
  dp_.all_gather(master_.view(), bucket_.view(), be_.stream());
  for (size_t i : order_) {
    const TensorView& dst = params_[i].value;
    be_.copy(TensorView(dst.data, dst.dtype, {dst.numel()}, dst.device), flat(bucket_, offset_[i], dst.numel()));
  }
}

void Zero1AdamW::gather_moments(std::vector<Tensor>& m, std::vector<Tensor>& v) {
  const int64_t D = dp_.size();
  m.clear();
  v.clear();
  for (const Tensor* part : {&m_, &v_}) {
    Tensor all = be_.empty(part->dtype(), {D * shard_});
    dp_.all_gather(part->view(), all.view(), be_.stream());
    Tensor host = be_.to_host(all);
    auto& out = part == &m_ ? m : v;
    out.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t n = params_[i].value.numel();
      out[i] = Tensor::host(part->dtype(), {n});
      std::memcpy(out[i].view().data, static_cast<char*>(host.view().data) + offset_[i] * int64_t(dtype_size(part->dtype())),
                  size_t(n) * dtype_size(part->dtype()));
    }
  }
}

void Zero1AdamW::load_moments(const std::vector<TensorView>& m, const std::vector<TensorView>& v) {
  FP8MOE_CHECK(m.size() == params_.size() && v.size() == params_.size(),
               "Zero1AdamW::load_moments: " << m.size() << " and " << v.size() << " moments for " << params_.size()
                                            << " parameters");
  for (const Tensor* part : {&m_, &v_}) {
    const auto& in = part == &m_ ? m : v;
    const size_t es = dtype_size(part->dtype());
    Tensor host = Tensor::host(part->dtype(), {shard_});
    std::memset(host.view().data, 0, size_t(shard_) * es);
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t n = params_[i].value.numel();
      FP8MOE_CHECK(in[i].numel() == n && in[i].dtype == part->dtype(),
                   params_[i].name << ": moment " << in[i].str() << ", expected [" << n << "] " << dtype_name(part->dtype()));
      const int64_t a = std::max(offset_[i], lo_), b = std::min(offset_[i] + n, lo_ + shard_);
      if (b <= a) continue;
      Tensor src = Tensor::host_like(in[i]);
      be_.copy(src.view(), in[i]);
      std::memcpy(static_cast<char*>(host.view().data) + size_t(a - lo_) * es,
                  static_cast<const char*>(src.view().data) + size_t(a - offset_[i]) * es, size_t(b - a) * es);
    }
    be_.copy(part->view(), host.view());
  }
}

Zero1AdamW::Memory Zero1AdamW::memory() const {
  return {int64_t(master_.view().nbytes()), int64_t(m_.view().nbytes() + v_.view().nbytes()),
          int64_t(grad_.view().nbytes()), int64_t(bucket_.view().nbytes())};
}

}  // namespace fp8moe
