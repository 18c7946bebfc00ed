// ZeRO-1 AdamW (DeepSeek-V3 §3.2: ZeRO-1 data parallelism): the optimizer state is sharded over the
// data-parallel ranks, the parameters and gradients are not. Two flat FP32 buckets:
//   replicated  the parameters every data-parallel rank holds, sharded over the dp group;
//   experts     this rank's routed experts (expert parallelism), sharded over the edp group: the
//               dp / ep ranks that hold the same experts.
// One step, per bucket:
//   the gradients copied into the bucket -> reduce_scatter over its group (summed in rank order:
//   the same bits on every rank and in every run) -> AdamW on this rank's shard (FP32 master
//   weights and BF16 moments) -> all_gather of the updated shards into every parameter.
// The collectives are started (Comm::ireduce_scatter, iall_gather) and waited for only where
// their result is needed, so that one bucket's communication overlaps the other's computation:
// the experts' gradients are copied into their bucket while the replicated bucket's
// reduce_scatter runs, and the replicated shard's squares are summed during the experts'; the
// experts' AdamW runs during the replicated bucket's all_gather, and the replicated parameters
// are copied out of their bucket during the experts'. No AdamW can start before both
// reduce_scatters end: the clipping scale is the whole model's gradient norm.
// The update is elementwise, so with the same summed gradient it is bit-identical to AdamW on one
// rank. The gradient norm is the whole model's: the squares of the replicated shards summed over
// the dp ranks, those of the expert shards (every expert once: the ep ranks hold different
// experts, their edp groups shard them), added in that order; with pipeline ranks holding their
// stages' parameters (count_norm_over), those sums over the pipeline ranks as well.
//   fp8moe::Zero1AdamW opt(backend, *dp, refs, cfg, edp.get(), expert);
//   opt.reduce_gradients();  const double norm = opt.grad_norm();  opt.step(lr, clip_scale(norm, 1.0f));
#pragma once
#include <vector>

#include "fp8moe/comm.hpp"
#include "fp8moe/optimizer.hpp"

namespace fp8moe {

class Zero1AdamW {
 public:
  // Parameters in the same order and shapes on every rank of `dp`; those with expert[i] set (a
  // routed expert's, with `edp` given) identical on the ranks of `edp` only, the others on every
  // rank of `dp`. Master weights taken from them. `edp` is a subgroup of `dp`, ordered as it is.
  Zero1AdamW(Backend& backend, Comm& dp, std::vector<ParamRef> params, AdamWConfig cfg, Comm* edp = nullptr,
             std::vector<bool> expert = {});
  // Pipeline ranks each holding some of the model's parameters (a stage shard): the gradient norm
  // becomes the whole model's over `pp` too, the squares of the parameters with counted[i] (those
  // no lower pipeline rank holds: each parameter once) summed over the dp group, then over `pp`
  // in rank order. Without this call every parameter counts and the sums stop at dp.
  void count_norm_over(Comm& pp, std::vector<bool> counted);
  // Starts the sums of every rank's gradients; this rank keeps its shards of the sums (grad_norm
  // and step wait for them). Other collectives may be posted meanwhile (the trainer's loss sums).
  void reduce_gradients();
  // sqrt(sum of squares) of the summed gradients of the whole model (after reduce_gradients), the
  // same on every rank.
  double grad_norm();
  // AdamW on the shards with the summed gradients times grad_scale, then the parameters all-gathered.
  void step(float lr, float grad_scale = 1.0f);
  // Off: every collective waited for as soon as it is started (one bucket after the other), the
  // same bits; what the overlap gains is measured against it.
  void set_overlap(bool on) { overlap_ = on; }
  int64_t steps() const { return t_; }
  void set_steps(int64_t t) { t_ = t; }
  const std::vector<ParamRef>& params() const { return params_; }
  const AdamWConfig& config() const { return cfg_; }

  // Checkpoints hold whole moments: every parameter's first and second moments [numel] (bf16 or
  // f32, host tensors), gathered from the shards (collective), and set from them (each rank takes
  // its shard).
  void gather_moments(std::vector<Tensor>& m, std::vector<Tensor>& v);
  void load_moments(const std::vector<TensorView>& m, const std::vector<TensorView>& v);
  // The master shards taken again from the parameters (after they were loaded).
  void reload_master();

  // Elements this rank's parameters hold (replicated + its experts), of its shards, and the bytes
  // this rank holds for the optimizer (both buckets).
  int64_t numel() const;
  int64_t shard_numel() const;
  int64_t expert_numel() const;  // of this rank's routed experts (the experts bucket)
  struct Memory {
    int64_t master = 0, moments = 0, gradient_shard = 0, bucket = 0;
  };
  Memory memory() const;

 private:
  struct Bucket {
    Comm* comm = nullptr;
    std::vector<size_t> order;         // its parameters in flat order: decayed first, then the others
    int64_t numel = 0, decayed = 0;    // flat elements; [0, decayed) are decayed
    int64_t shard = 0, lo = 0;         // elements per shard; this rank's first
    Tensor flat;                       // [ranks * shard] f32: gradients, then the gathered parameters
    Tensor grad, master, m, v;         // [shard] f32, f32, moments
    CommRequest reduced;               // the reduce_scatter into grad, until waited for
  };
  TensorView flat(const Tensor& t, int64_t off, int64_t n) const;
  void to_bucket(Bucket& b, bool grads);  // its parameters' gradients (or values) into the bucket
  CommRequest started(CommRequest r);     // r, or r waited for without overlap
  void wait_reduced(Bucket& b);
  Backend& be_;
  std::vector<ParamRef> params_;
  AdamWConfig cfg_;
  Comm& dp_;
  Bucket buckets_[2];            // replicated over dp; routed experts over edp
  std::vector<int> bucket_of_;   // of each parameter
  std::vector<int64_t> offset_;  // of each parameter in its bucket
  Comm* pp_ = nullptr;           // count_norm_over
  std::vector<bool> counted_;
  int64_t t_ = 0;
  bool overlap_ = true;
};

}  // namespace fp8moe
