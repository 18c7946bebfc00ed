// The timeline of a pipeline step: summaries and the Chrome trace (include/fp8moe/pipeline_trace.hpp).
#include "fp8moe/pipeline_trace.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace fp8moe::pipeline {

RankSummary summarize(const std::vector<ExecutedOp>& ops) {
  RankSummary s;
  if (ops.empty()) return s;
  double end = 0;
  for (const ExecutedOp& e : ops) {
    end = std::max(end, e.end);
    for (const Component& c : e.components) end = std::max(end, c.end);
    s.wait += e.wait;
    if (!is_compute(e.op.kind)) continue;
    const double t = e.end - e.start - e.wait;
    s.busy += t;
    switch (e.op.kind) {
      case OpKind::Forward:
        s.forward += t, ++s.forwards;
        break;
      case OpKind::Backward:
        if (e.op.defers_weights) s.backward_input += t, ++s.backward_inputs;
        else s.backward += t, ++s.backwards;
        break;
      case OpKind::Weight:
        s.weight += t, ++s.weights;
        break;
      default:
        s.forward_backward += t, ++s.forward_backwards;
        for (const Component& c : e.components) {  // the wait before the chunk is neither half's
          if (c.name.starts_with("F ")) s.fb_forward_half += c.end - c.start;
          if (c.name.starts_with("B ") || c.name.starts_with("W ")) s.fb_backward_half += c.end - c.start;
        }
        break;
    }
  }
  s.step = end - ops.front().start;
  s.bubble = s.step - s.busy;
  return s;
}

OpCosts measured_costs(const std::vector<RankSummary>& ranks) {
  RankSummary t;
  for (const RankSummary& r : ranks) {
    t.forward += r.forward, t.forwards += r.forwards;
    t.backward += r.backward, t.backwards += r.backwards;
    t.backward_input += r.backward_input, t.backward_inputs += r.backward_inputs;
    t.weight += r.weight, t.weights += r.weights;
    t.forward_backward += r.forward_backward, t.forward_backwards += r.forward_backwards;
  }
  auto mean = [](double sum, int n) { return n > 0 ? sum / n : 0.0; };
  OpCosts c;
  c.forward = mean(t.forward, t.forwards);
  c.weight = mean(t.weight, t.weights);
  c.backward = t.backwards > 0 ? mean(t.backward, t.backwards) : mean(t.backward_input, t.backward_inputs) + c.weight;
  // Without a deferred W the split of B does not matter to the schedule; half of it keeps the
  // costs valid (B > W).
  if (t.weights == 0) c.weight = c.backward / 2;
  c.forward_backward = t.forward_backwards > 0 ? mean(t.forward_backward, t.forward_backwards) : c.forward + c.backward;
  c.comm_latency = 0;
  return c;
}

namespace {

std::string quoted(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    o += ch;
  }
  return o + "\"";
}

void event(std::ostringstream& o, bool& first, const std::string& name, const char* cat, int rank, int tid, double start,
           double end) {
  char buf[160];
  std::snprintf(buf, sizeof buf, ",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}", cat, rank,
                tid, start * 1e6, std::max(0.0, end - start) * 1e6);
  o << (first ? "\n" : ",\n") << "{\"name\":" << quoted(name) << buf;
  first = false;
}

}  // namespace

std::string chrome_trace(const Schedule& schedule, int rank, const std::vector<ExecutedOp>& ops) {
  std::ostringstream o;
  o << "{\"traceEvents\":[";
  bool first = true;
  const std::string process = "rank " + std::to_string(rank) + " (" + std::string(method_name(schedule.method)) + ")";
  o << "\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank << ",\"args\":{\"name\":" << quoted(process) << "}}";
  first = false;
  for (const ExecutedOp& e : ops) {
    const std::string label = op_label(schedule, e.op);
    if (!is_compute(e.op.kind)) {
      event(o, first, label, "comm", rank, 1, e.start, e.end);
      continue;
    }
    event(o, first, label, "op", rank, 0, e.start, e.end);
    for (const Component& c : e.components) event(o, first, c.name, c.name == "wait" ? "wait" : "component", rank, 0, c.start, c.end);
  }
  o << "\n],\"displayTimeUnit\":\"ms\"}\n";
  return o.str();
}

}  // namespace fp8moe::pipeline
