// ZeRO-1 AdamW over a data-parallel communicator, the routed experts over their
// expert-data-parallel one (include/fp8moe/zero1.hpp). Tested by tests/parallel/test_parallel_mpi.cpp
// under mpirun (bit-identical to AdamW on one rank).
#include "fp8moe/zero1.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

namespace fp8moe {

Zero1AdamW::Zero1AdamW(Backend& backend, Comm& dp, std::vector<ParamRef> params, AdamWConfig cfg, Comm* edp,
                       std::vector<bool> expert)
    : be_(backend), params_(std::move(params)), cfg_(cfg), dp_(dp) {
  FP8MOE_CHECK(expert.empty() || expert.size() == params_.size(),
               "Zero1AdamW: " << expert.size() << " expert flags for " << params_.size() << " parameters");
  FP8MOE_CHECK(edp || std::find(expert.begin(), expert.end(), true) == expert.end(),
               "Zero1AdamW: routed experts' parameters need their expert-data-parallel communicator");
  for (auto& p : params_) {
    check_tensor(p.value, (p.name + ".value").c_str(), DType::f32, p.value.ndim);
    check_tensor(p.grad, (p.name + ".grad").c_str(), DType::f32, p.grad.ndim);
    FP8MOE_CHECK(p.value.numel() == p.grad.numel() && p.value.is_contiguous() && p.grad.is_contiguous(),
                 p.name << ": gradient " << p.grad.str() << " and value " << p.value.str() << " must match, contiguous");
  }
  bucket_of_.assign(params_.size(), 0);
  for (size_t i = 0; i < expert.size(); ++i) bucket_of_[i] = expert[i] ? 1 : 0;
  buckets_[0].comm = &dp;
  buckets_[1].comm = edp;
  offset_.assign(params_.size(), 0);
  const DType md = cfg.moments == MomentPrecision::bf16 ? DType::bf16 : DType::f32;
  for (int k = 0; k < 2; ++k) {
    Bucket& b = buckets_[k];
    for (int pass = 0; pass < 2; ++pass)  // decayed first: a shard has at most two runs
      for (size_t i = 0; i < params_.size(); ++i)
        if (bucket_of_[i] == k && params_[i].weight_decay == (pass == 0)) b.order.push_back(i);
    for (size_t i : b.order) {
      offset_[i] = b.numel;
      b.numel += params_[i].value.numel();
      if (params_[i].weight_decay) b.decayed = b.numel;
    }
    if (k == 1 && b.numel == 0) {  // no routed experts here: no second bucket
      b.comm = nullptr;
      continue;
    }
    const int64_t R = b.comm->size();
    b.shard = std::max<int64_t>((b.numel + R - 1) / R, 1);
    b.lo = int64_t(b.comm->rank()) * b.shard;
    b.flat = be_.zeros(DType::f32, {R * b.shard});  // the padding past numel stays zero
    b.grad = be_.zeros(DType::f32, {b.shard});
    b.master = be_.zeros(DType::f32, {b.shard});
    b.m = be_.zeros(md, {b.shard});
    b.v = be_.zeros(md, {b.shard});
  }
  reload_master();
}

TensorView Zero1AdamW::flat(const Tensor& t, int64_t off, int64_t n) const {
  const TensorView v = t.view();
  return TensorView(static_cast<char*>(v.data) + off * int64_t(dtype_size(v.dtype)), v.dtype, {n}, v.device);
}

void Zero1AdamW::to_bucket(Bucket& b, bool grads) {
  wait_reduced(b);  // a reduce_scatter in flight reads the bucket
  for (size_t i : b.order) {
    const TensorView& src = grads ? params_[i].grad : params_[i].value;
    be_.copy(flat(b.flat, offset_[i], src.numel()), TensorView(src.data, src.dtype, {src.numel()}, src.device));
  }
}

void Zero1AdamW::reload_master() {
  for (Bucket& b : buckets_) {
    if (!b.comm) continue;
    to_bucket(b, false);
    be_.copy(b.master.view(), flat(b.flat, b.lo, b.shard));
  }
}

CommRequest Zero1AdamW::started(CommRequest r) {
  if (!overlap_) r.wait();
  return r;
}

void Zero1AdamW::reduce_gradients() {
  for (Bucket& b : buckets_) {
    if (!b.comm) continue;
    to_bucket(b, true);
    b.reduced = started(b.comm->ireduce_scatter(b.flat.view(), b.grad.view(), be_.stream()));
  }
}

void Zero1AdamW::wait_reduced(Bucket& b) {
  b.reduced.wait();
  b.reduced = CommRequest();
}

void Zero1AdamW::count_norm_over(Comm& pp, std::vector<bool> counted) {
  FP8MOE_CHECK(counted.size() == params_.size(),
               "Zero1AdamW: " << counted.size() << " counted flags for " << params_.size() << " parameters");
  pp_ = &pp;
  counted_ = std::move(counted);
}

double Zero1AdamW::grad_norm() {
  // [replicated, experts]: the dp ranks' shards of each cover its bucket once over the dp group.
  Tensor ss = Tensor::host(DType::f64, {2});
  for (int k = 0; k < 2; ++k) {
    const Bucket& b = buckets_[k];
    double& sum = ss.ptr<double>()[k];
    sum = 0;
    if (!b.comm) continue;
    wait_reduced(buckets_[k]);
    if (!pp_) {
      sum = be_.sum_squares(b.grad.view());
      continue;
    }
    // The parts of this shard that belong to counted parameters, in flat order.
    for (size_t i : b.order) {
      if (!counted_[i]) continue;
      const int64_t x = std::max(offset_[i], b.lo), y = std::min(offset_[i] + params_[i].value.numel(), b.lo + b.shard);
      if (y > x) sum += be_.sum_squares(flat(b.grad, x - b.lo, y - x));
    }
  }
  Tensor dev = be_.empty(DType::f64, {2});
  be_.copy(dev.view(), ss.view());
  dp_.all_reduce(dev.view(), be_.stream());
  if (pp_) pp_->all_reduce(dev.view(), be_.stream());
  be_.copy(ss.view(), dev.view());
  be_.synchronize();
  return std::sqrt(ss.ptr<double>()[0] + ss.ptr<double>()[1]);
}

void Zero1AdamW::step(float lr, float grad_scale) {
  for (Bucket& b : buckets_) wait_reduced(b);
  ++t_;
  CommRequest gathered[2];
  for (int k = 0; k < 2; ++k) {
    Bucket& b = buckets_[k];
    if (!b.comm) continue;
    // This shard's part of [0, decayed) and of [decayed, numel): one adamw_step each.
    const int64_t lo = b.lo, hi = std::min(b.lo + b.shard, b.numel);
    for (const auto& [x, y, decay] :
         {std::tuple{lo, std::min(hi, b.decayed), true}, std::tuple{std::max(lo, b.decayed), hi, false}}) {
      if (y <= x) continue;
      Backend::AdamWStep s{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, decay ? cfg_.weight_decay : 0.0f, grad_scale, t_};
      be_.adamw_step(flat(b.master, x - lo, y - x), flat(b.grad, x - lo, y - x), flat(b.m, x - lo, y - x),
                     flat(b.v, x - lo, y - x), s);
    }
    gathered[k] = started(b.comm->iall_gather(b.master.view(), b.flat.view(), be_.stream()));
  }
  for (int k = 0; k < 2; ++k) {
    const Bucket& b = buckets_[k];
    if (!b.comm) continue;
    gathered[k].wait();
    for (size_t i : b.order) {
      const TensorView& dst = params_[i].value;
      be_.copy(TensorView(dst.data, dst.dtype, {dst.numel()}, dst.device), flat(b.flat, offset_[i], dst.numel()));
    }
  }
}

void Zero1AdamW::gather_moments(std::vector<Tensor>& m, std::vector<Tensor>& v) {
  m.assign(params_.size(), Tensor());
  v.assign(params_.size(), Tensor());
  for (Bucket& b : buckets_) {
    if (!b.comm) continue;
    for (const Tensor* part : {&b.m, &b.v}) {
      Tensor all = be_.empty(part->dtype(), {int64_t(b.comm->size()) * b.shard});
      b.comm->all_gather(part->view(), all.view(), be_.stream());
      Tensor host = be_.to_host(all);
      auto& out = part == &b.m ? m : v;
      const size_t es = dtype_size(part->dtype());
      for (size_t i : b.order) {
        const int64_t n = params_[i].value.numel();
        out[i] = Tensor::host(part->dtype(), {n});
        std::memcpy(out[i].view().data, static_cast<char*>(host.view().data) + offset_[i] * int64_t(es), size_t(n) * es);
      }
    }
  }
}

void Zero1AdamW::load_moments(const std::vector<TensorView>& m, const std::vector<TensorView>& v) {
  FP8MOE_CHECK(m.size() == params_.size() && v.size() == params_.size(),
               "Zero1AdamW::load_moments: " << m.size() << " and " << v.size() << " moments for " << params_.size()
                                            << " parameters");
  for (Bucket& b : buckets_) {
    if (!b.comm) continue;
    for (const Tensor* part : {&b.m, &b.v}) {
      const auto& in = part == &b.m ? m : v;
      const size_t es = dtype_size(part->dtype());
      Tensor host = Tensor::host(part->dtype(), {b.shard});
      std::memset(host.view().data, 0, size_t(b.shard) * es);
      for (size_t i : b.order) {
        const int64_t n = params_[i].value.numel();
        FP8MOE_CHECK(in[i].numel() == n && in[i].dtype == part->dtype(), params_[i].name << ": moment " << in[i].str()
                                                                                         << ", expected [" << n << "] "
                                                                                         << dtype_name(part->dtype()));
        const int64_t x = std::max(offset_[i], b.lo), y = std::min(offset_[i] + n, b.lo + b.shard);
        if (y <= x) continue;
        Tensor src = Tensor::host_like(in[i]);
        be_.copy(src.view(), in[i]);
        std::memcpy(static_cast<char*>(host.view().data) + size_t(x - b.lo) * es,
                    static_cast<const char*>(src.view().data) + size_t(x - offset_[i]) * es, size_t(y - x) * es);
      }
      be_.copy(part->view(), host.view());
    }
  }
}

int64_t Zero1AdamW::numel() const { return buckets_[0].numel + buckets_[1].numel; }
int64_t Zero1AdamW::shard_numel() const { return buckets_[0].shard + buckets_[1].shard; }
int64_t Zero1AdamW::expert_numel() const { return buckets_[1].numel; }

Zero1AdamW::Memory Zero1AdamW::memory() const {
  Memory r;
  for (const Bucket& b : buckets_) {
    if (!b.comm) continue;
    r.master += int64_t(b.master.view().nbytes());
    r.moments += int64_t(b.m.view().nbytes() + b.v.view().nbytes());
    r.gradient_shard += int64_t(b.grad.view().nbytes());
    r.bucket += int64_t(b.flat.view().nbytes());
  }
  return r;
}

}  // namespace fp8moe
