// ZeRO-1 AdamW (DeepSeek-V3 §3.2: ZeRO-1 data parallelism): the optimizer state is sharded over the
// data-parallel ranks, the parameters and gradients are not. One step:
//   the gradients copied into one flat FP32 bucket -> reduce_scatter over the ranks (summed in
//   rank order: the same bits on every rank and in every run) -> AdamW on this rank's shard (FP32
//   master weights and BF16 moments of 1/D of the parameters) -> all_gather of the updated shards
//   into every parameter.
// The update is elementwise, so with the same summed gradient it is bit-identical to AdamW on one
// rank. Expert gradients are zero on the ranks that do not hold the expert; adding those zeros is
// exact, so one bucket over the data-parallel group sums each expert over its replicas only.
//   fp8moe::Zero1AdamW opt(backend, *dp, refs, cfg);
//   opt.reduce_gradients();  const double norm = opt.grad_norm();  opt.step(lr, clip_scale(norm, 1.0f));
#pragma once
#include <vector>

#include "fp8moe/comm.hpp"
#include "fp8moe/optimizer.hpp"

namespace fp8moe {

class Zero1AdamW {
 public:
  // Parameters identical on every rank (same order, shapes and values); master weights taken from them.
  Zero1AdamW(Backend& backend, Comm& dp, std::vector<ParamRef> params, AdamWConfig cfg);
  // Sums every rank's gradients; this rank keeps its shard of the sum.
  void reduce_gradients();
  // sqrt(sum of squares) of the summed gradients (after reduce_gradients), the same on every rank.
  double grad_norm();
  // AdamW on the shard with the summed gradients times grad_scale, then the parameters all-gathered.
  void step(float lr, float grad_scale = 1.0f);
  int64_t steps() const { return t_; }
  void set_steps(int64_t t) { t_ = t; }
  const std::vector<ParamRef>& params() const { return params_; }
  const AdamWConfig& config() const { return cfg_; }

  // Checkpoints hold whole moments: every parameter's first and second moments [numel] (bf16 or
  // f32, host tensors), gathered from the shards (collective), and set from them (each rank takes
  // its shard).
  void gather_moments(std::vector<Tensor>& m, std::vector<Tensor>& v);
  void load_moments(const std::vector<TensorView>& m, const std::vector<TensorView>& v);
  // The master shard taken again from the parameters (after they were loaded).
  void reload_master();

  // Elements of the flat vector, of one shard, and the bytes this rank holds for the optimizer.
  int64_t numel() const { return numel_; }
  int64_t shard_numel() const { return shard_; }
  struct Memory {
    int64_t master = 0, moments = 0, gradient_shard = 0, bucket = 0;
  };
  Memory memory() const;

 private:
  TensorView flat(const Tensor& t, int64_t off, int64_t n) const;
  void to_bucket(bool grads);  // every parameter's gradient (or value) into the bucket
  Backend& be_;
  Comm& dp_;
  std::vector<ParamRef> params_;
  AdamWConfig cfg_;
  std::vector<int64_t> offset_;     // of each parameter in the flat vector
  std::vector<size_t> order_;       // parameters in flat order: decayed first, then the others
  int64_t numel_ = 0, decayed_ = 0;  // flat elements; [0, decayed_) are decayed
  int64_t shard_ = 0, lo_ = 0;       // elements per shard; this rank's first
  Tensor bucket_;                    // [D * shard] f32: gradients, then the gathered parameters
  Tensor grad_, master_, m_, v_;     // [shard] f32, f32, moments
  int64_t t_ = 0;
};

}  // namespace fp8moe
