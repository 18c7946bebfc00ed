// The weight gradients of a backward pass on a stream of their own. A sublayer's W (its Wgrad
// GEMMs and the norms' weight gradients) needs only what its B kept, and the next sublayer's B
// needs only B's output; at the sizes of a small model each of their GEMMs fills a fraction of
// the SMs, so W(i) runs beside B(i-1). W(i) waits for B(i) (an event); the stream that queued B
// waits for W(i) once it has queued B(i-1), so that one W at a time runs beside the backward and
// the gradients are complete after join(). Each W's arithmetic and order are the serial ones:
// bitwise the same gradients. The tensors of B's stream that a W drops (what B kept for it) are
// set aside until that wait (fp8moe/free_hold.hpp); the W stream's own scratch is reused as usual.
//   WgradStream w(be);
//   for (i = last; i >= 0; --i) { B(i); w.run([&] { W(i); }); }
//   w.join();  // before anything reads the gradients
#pragma once
#include <functional>
#include <memory>

#include "fp8moe/backend.hpp"

namespace fp8moe::pipeline {

class WgradStream {
 public:
  explicit WgradStream(Backend& be);  // the stream and its events, made once
  ~WgradStream();
  WgradStream(const WgradStream&) = delete;
  WgradStream& operator=(const WgradStream&) = delete;

  // Joins the W before (the current stream waits for it), then queues `w` on the W stream after
  // the current stream's work so far.
  void run(const std::function<void()>& w);
  // The current stream of the last run() waits for its W; nothing when none is pending.
  void join();

 private:
  Backend& be_;
  Stream stream_, origin_;  // the W stream; the stream the pending W forked from
  Event forked_, done_;
  bool pending_ = false;
  std::shared_ptr<void> aside_;  // the pending W's set-aside frees
};

}  // namespace fp8moe::pipeline
