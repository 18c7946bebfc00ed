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
#include <functional>
#include <memory>

#include "fp8moe/backend.hpp"

namespace fp8moe {

// Holds (nested holds count) until the last copy of the handle goes. Nothing on the CPU, where
// every op has run when it returns.
std::shared_ptr<void> hold_frees(const Backend& be);

// Runs `work` (ops on the backend's current stream, a second one) and sets aside the blocks of
// other streams that it frees (the host drops tensors of the first stream that the second has
// only queued its reads of): they return to the cache when the handle goes, by when the caller
// has made the first stream wait for the second (an event). The second stream's own blocks are
// freed as usual, so that `work` reuses its scratch memory. Nothing on the CPU.
std::shared_ptr<void> set_aside_frees(Backend& be, const std::function<void()>& work);

}  // namespace fp8moe
