// The paired F&B chunk on two streams (include/fp8moe/paired_chunk.hpp).
#include "fp8moe/paired_chunk.hpp"

#include <algorithm>
#include <set>

#include "fp8moe/error.hpp"
#include "fp8moe/free_hold.hpp"

namespace fp8moe::pipeline {

std::string_view fb_mode_name(FbMode mode) { return mode == FbMode::overlap ? "overlap" : "serial"; }

FbMode parse_fb_mode(std::string_view name) {
  if (name == "overlap") return FbMode::overlap;
  if (name == "serial") return FbMode::serial;
  FP8MOE_CHECK(false, "F&B mode: expected overlap or serial, got '" << name << "'");
}

PairedChunk::PairedChunk(Backend& be)
    : be_(be), second_(be.new_stream()), to_second_(be.new_event()), to_first_(be.new_event()) {}

void PairedChunk::run(const std::vector<ChunkStep>& forward, const std::vector<ChunkStep>& backward, FbMode mode) {
  const size_t n = std::max(forward.size(), backward.size());
  shared_waits_ = 0;
  if (mode == FbMode::serial) {
    for (size_t i = 0; i < n; ++i) {
      if (i < forward.size()) forward[i].run();
      if (i < backward.size()) backward[i].run();
    }
    return;
  }
  const Stream first = be_.stream();
  // Tensors of the first stream that the backward drops (its saved activations, its output
  // gradient) keep their bytes until the first stream has waited for the second.
  const std::shared_ptr<void> hold = hold_frees(be_);
  // The backward reads what the first stream wrote before the chunk (its output gradient, the
  // activations its forward saved, a received message's copy).
  to_second_.record(first);
  to_second_.wait(second_);
  std::set<int> touched[2];  // resources named so far by each half
  auto issue = [&](const ChunkStep& step, int half) {
    const Stream& mine = half == 0 ? first : second_;
    const Stream& other = half == 0 ? second_ : first;
    Event& ev = half == 0 ? to_first_ : to_second_;
    if (std::any_of(step.shared.begin(), step.shared.end(), [&](int r) { return touched[1 - half].count(r) > 0; })) {
      ev.record(other);
      ev.wait(mine);
      ++shared_waits_;
    }
    touched[half].insert(step.shared.begin(), step.shared.end());
    const StreamScope on(be_, mine);
    step.run();
  };
  try {
    for (size_t i = 0; i < n; ++i) {
      if (i < forward.size()) issue(forward[i], 0);
      if (i < backward.size()) issue(backward[i], 1);
    }
  } catch (...) {
    to_first_.record(second_);
    to_first_.wait(first);
    throw;
  }
  // What the backward produced (its input gradient, the weight gradients) is read on the first
  // stream from here on.
  to_first_.record(second_);
  to_first_.wait(first);
}

}  // namespace fp8moe::pipeline
