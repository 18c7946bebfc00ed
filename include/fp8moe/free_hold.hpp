// Freed device memory held back from reuse while two streams share tensors. The CUDA backend's
// caching allocator hands a freed block to the next request on the stream that allocated it at
// once, which is safe only while that stream is the block's only user. When work on a second
// stream reads tensors of the first (the pipeline executor's paired F&B chunk), the host may drop
// such a tensor while the second stream has not yet run its use: under a hold the block is set
// aside and returns to its free list only when the handle goes, by when the caller has made the
// owning stream wait for the other (an event). The cost is the memory freed during the hold, not
// reused until its end.
//   { auto hold = hold_frees(be); ...two streams...; done.record(second); done.wait(first); }
#pragma once
#include <memory>

#include "fp8moe/backend.hpp"

namespace fp8moe {

// Holds (nested holds count) until the last copy of the handle goes. Nothing on the CPU, where
// every op has run when it returns.
std::shared_ptr<void> hold_frees(const Backend& be);

}  // namespace fp8moe
