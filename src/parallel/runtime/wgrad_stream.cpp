#include "parallel/runtime/wgrad_stream.hpp"

#include "fp8moe/free_hold.hpp"

namespace fp8moe::pipeline {

WgradStream::WgradStream(Backend& be)
    : be_(be), stream_(be.new_stream()), forked_(be.new_event()), done_(be.new_event()) {}

WgradStream::~WgradStream() {
  try {
    join();
  } catch (...) {  // a failed wait: the error was raised where the work failed
  }
}

void WgradStream::run(const std::function<void()>& w) {
  join();
  origin_ = be_.stream();
  forked_.record(origin_);
  forked_.wait(stream_);
  pending_ = true;
  const StreamScope on(be_, stream_);
  try {
    aside_ = set_aside_frees(be_, w);
  } catch (...) {
    done_.record(stream_);
    throw;
  }
  done_.record(stream_);
}

void WgradStream::join() {
  if (!pending_) return;
  pending_ = false;
  done_.wait(origin_);
  aside_.reset();
}

}  // namespace fp8moe::pipeline
