// Vocabulary shared by every schedule: method names, op classes and labels, op costs, and the
// generator dispatch. The generators themselves are in schedule_1f1b.cpp and schedule_dualpipe.cpp.
#include <array>
#include <string>

#include "schedule_build.hpp"

namespace fp8moe::pipeline {

namespace {
constexpr std::array<std::pair<Method, std::string_view>, 4> kMethodNames{{
    {Method::OneFOneB, "1f1b"},
    {Method::ZB1P, "zb1p"},
    {Method::DualPipe, "dualpipe"},
    {Method::DualPipeV, "dualpipev"},
}};
}  // namespace

std::string_view method_name(Method method) {
  for (const auto& [m, name] : kMethodNames)
    if (m == method) return name;
  return "?";
}

Method parse_method(std::string_view name) {
  for (const auto& [m, known] : kMethodNames)
    if (known == name) return m;
  FP8MOE_CHECK(false, "method: expected one of 1f1b, zb1p, dualpipe, dualpipev, got '" << name << "'");
  return Method::OneFOneB;
}

const std::vector<Method>& all_methods() {
  static const std::vector<Method> methods{Method::OneFOneB, Method::ZB1P, Method::DualPipe,
                                           Method::DualPipeV};
  return methods;
}

bool is_compute(OpKind kind) {
  return kind == OpKind::Forward || kind == OpKind::Backward || kind == OpKind::Weight ||
         kind == OpKind::ForwardBackward;
}
bool is_comm(OpKind kind) { return !is_compute(kind); }

void check_costs(const OpCosts& c) {
  FP8MOE_CHECK(c.forward > 0, "cost-f: the forward cost must be > 0, got " << c.forward);
  FP8MOE_CHECK(c.weight >= 0, "cost-w: the backward-for-weights cost must be >= 0, got " << c.weight);
  FP8MOE_CHECK(c.backward > c.weight,
               "cost-b: the full backward cost must exceed the backward-for-weights cost (an "
               "input-only backward costs B - W > 0), got B = "
                   << c.backward << ", W = " << c.weight);
  FP8MOE_CHECK(c.forward_backward > 0, "cost-fb: the overlapped F&B cost must be > 0, got " << c.forward_backward);
  FP8MOE_CHECK(c.comm_latency >= 0, "comm: the communication latency must be >= 0, got " << c.comm_latency);
}

double op_cost(const Op& op, const OpCosts& c) {
  switch (op.kind) {
    case OpKind::Forward: return c.forward;
    case OpKind::Backward: return op.defers_weights ? c.backward - c.weight : c.backward;
    case OpKind::Weight: return c.weight;
    case OpKind::ForwardBackward: return c.forward_backward;
    default: return 0;
  }
}

namespace detail {

int pass_lane(const Schedule& s, const Pass& p) {
  switch (s.method) {
    case Method::DualPipe: return s.micro_batch_direction[p.micro_batch];
    case Method::DualPipeV: return p.stage >= s.num_ranks ? 1 : 0;
    default: return 0;
  }
}

int pass_display_id(const Schedule& s, const Pass& p) {
  if (s.method != Method::DualPipe) return p.micro_batch;
  // Figure 5 numbers each direction's micro-batches from 0.
  return s.micro_batch_direction[p.micro_batch] == 0 ? p.micro_batch
                                                     : p.micro_batch - s.num_micro_batches / 2;
}

Schedule linear_pipeline(Method method, int pp, int micro_batches) {
  Schedule s;
  s.method = method;
  s.num_ranks = pp;
  s.num_stages = pp;
  s.num_micro_batches = micro_batches;
  s.micro_batch_direction.assign(micro_batches, 0);
  s.stage_rank.assign(1, std::vector<int>(pp));
  for (int stage = 0; stage < pp; ++stage) s.stage_rank[0][stage] = stage;
  s.rank_ops.assign(pp, {});
  return s;
}

}  // namespace detail

std::string op_label(const Schedule& s, const Op& op) {
  auto compute = [&](char upper, const Pass& p) {
    const char letter = detail::pass_lane(s, p) == 0 ? upper : char(upper - 'A' + 'a');
    return letter + std::to_string(detail::pass_display_id(s, p));
  };
  const std::string peer = std::to_string(op.peer);
  switch (op.kind) {
    case OpKind::Forward: return compute('F', op.pass);
    case OpKind::Backward: return compute('B', op.pass);
    case OpKind::Weight: return compute('W', op.pass);
    case OpKind::ForwardBackward: return compute('F', op.pass) + "+" + compute('B', op.backward_pass);
    case OpKind::SendActivation: return "send(" + compute('F', op.pass) + ")->r" + peer;
    case OpKind::RecvActivation: return "recv(" + compute('F', op.pass) + ")<-r" + peer;
    case OpKind::SendGradient: return "send(" + compute('B', op.pass) + ")->r" + peer;
    case OpKind::RecvGradient: return "recv(" + compute('B', op.pass) + ")<-r" + peer;
  }
  return "?";
}

Schedule make_schedule(Method method, int pp, int micro_batches) {
  switch (method) {
    case Method::OneFOneB: return one_f_one_b_schedule(pp, micro_batches);
    case Method::ZB1P: return zb1p_schedule(pp, micro_batches);
    case Method::DualPipe: return dualpipe_schedule(pp, micro_batches);
    case Method::DualPipeV: return dualpipev_schedule(pp, micro_batches);
  }
  FP8MOE_CHECK(false, "method: unknown schedule method");
  return {};
}

}  // namespace fp8moe::pipeline
