// The single-pipeline schedules: 1F1B (PipeDream-Flush) and ZB1P (ZeroBubble's ZB-H1).
// Rank r holds stage r. Both warm up with PP-1-r forwards and then alternate one forward with one
// backward, which caps the activations a rank holds at PP.
// ZB1P splits each backward into an input-gradient B and a deferred weight-gradient W. Rank r runs
// W of micro-batch i right after B of micro-batch i+r, so the later ranks, which sit on the critical
// path of the backward chain, postpone their W's into the cool-down, where the earlier ranks would
// otherwise wait; the lag r keeps passes with F done and W not done at PP or fewer, as in 1F1B.
#include "schedule_build.hpp"

namespace fp8moe::pipeline {

namespace {

using detail::RankOps;

void check_single_pipeline_request(Method method, int pp, int micro_batches) {
  FP8MOE_CHECK(pp >= 1, method_name(method) << ": pp must be >= 1, got " << pp);
  FP8MOE_CHECK(micro_batches >= pp,
               method_name(method) << ": micro-batches must be >= pp so that the warm-up fills every "
                                      "stage, got micro-batches = "
                                   << micro_batches << ", pp = " << pp);
}

void forward_with_comm(RankOps& ops, Pass p, int last_stage) {
  if (p.stage > 0) ops.recv_activation(RankOps::prev_stage(p));
  ops.forward(p);
  if (p.stage < last_stage) ops.send_activation(p);
}

void backward_with_comm(RankOps& ops, Pass p, bool defers_weights, int last_stage) {
  if (p.stage < last_stage) ops.recv_gradient(RankOps::next_stage(p));
  ops.backward(p, defers_weights);
  if (p.stage > 0) ops.send_gradient(p);
}

Schedule single_pipeline(Method method, int pp, int micro_batches) {
  check_single_pipeline_request(method, pp, micro_batches);
  const bool split_backward = method == Method::ZB1P;
  Schedule s = detail::linear_pipeline(method, pp, micro_batches);
  const int last = pp - 1;
  for (int rank = 0; rank < pp; ++rank) {
    RankOps ops(s, rank);
    const int warmup = pp - 1 - rank;
    const int weight_lag = rank;  // ZB1P only
    int next_f = 0, next_b = 0, next_w = 0;
    auto backward_then_weight = [&] {
      const int mb = next_b++;
      backward_with_comm(ops, {mb, rank}, split_backward, last);
      if (split_backward && mb - weight_lag >= 0) ops.weight({next_w++, rank});
    };
    for (int i = 0; i < warmup; ++i) forward_with_comm(ops, {next_f++, rank}, last);
    while (next_f < micro_batches) {
      forward_with_comm(ops, {next_f++, rank}, last);
      backward_then_weight();
    }
    while (next_b < micro_batches) backward_then_weight();
    while (split_backward && next_w < micro_batches) ops.weight({next_w++, rank});
  }
  return s;
}

}  // namespace

Schedule one_f_one_b_schedule(int pp, int micro_batches) {
  return single_pipeline(Method::OneFOneB, pp, micro_batches);
}

Schedule zb1p_schedule(int pp, int micro_batches) { return single_pipeline(Method::ZB1P, pp, micro_batches); }

}  // namespace fp8moe::pipeline
