// The stream-ordered caching allocator of the CUDA backend: every tensor and scratch buffer of the
// backend comes from here. A freed block goes back to a free list of its size class and of the
// stream it was allocated on, and the next request of that class on that stream takes it at once:
// the stream's own order guarantees that the earlier user's work has run before the new user's
// (as PyTorch's CUDACachingAllocator does). In the steady state of a training step no CUDA call
// is made: a miss takes memory from the device's stream-ordered pool (cudaMallocAsync), and
// nothing is returned to the driver until release_cached() or an allocation that fails (then the
// cache is released and the allocation tried once more).
// A block used on another stream than its own must be kept alive until that use has run (or the
// owning stream made to wait for an event recorded after it): the allocator does not track it.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fp8moe::cuda {

struct AllocatorStats {
  int64_t allocated = 0;       // bytes of the blocks in use, as requested (rounded to their class)
  int64_t peak_allocated = 0;  // high-water mark of `allocated`
  int64_t reserved = 0;        // bytes held from the pool: in use + cached
  int64_t peak_reserved = 0;
  int64_t allocations = 0;     // requests served
  int64_t pool_allocations = 0;  // requests that went to the pool (misses)
  int64_t graph_reserved = 0;    // bytes of `reserved` kept for graphs
};

// The size class of a request: multiples of 512 bytes up to 1 MiB; above, four classes per power
// of two (2^k, 1.25, 1.5, 1.75 x 2^k), so that shapes that vary a little from step to step (MoE
// segments) share blocks and at most a fifth of a block is unused.
size_t allocator_size_class(size_t bytes);

// A block of the cache: its memory, and what the allocator needs to take it back (the caller
// keeps it, so that no table maps pointers to blocks).
struct CachedBlock {
  void* ptr = nullptr;  // nullptr: no block (a request of 0 bytes)
  size_t size = 0;      // its size class
  cudaStream_t stream = nullptr;
  int device = 0;
  bool graph = false;  // kept for graphs
};

// Thread-safe; one cache per device. `device` is the device current at the call, which the
// backend knows (asking the runtime costs as much as the cache's own work); without it, the
// runtime is asked.
CachedBlock cached_malloc(size_t bytes, cudaStream_t stream, int device);
CachedBlock cached_malloc(size_t bytes, cudaStream_t stream);
// A block from cached_malloc, once (no block is ignored): it becomes free on its own stream, or,
// while frees are held, at the end of the hold.
void cached_free(const CachedBlock& b);
// While held (nested holds count), freed blocks are set aside and return to their streams' free
// lists only at release_frees(): for work on two streams whose tensors cross between them, where
// the host drops a tensor of one stream while the other may still use it. The caller makes the
// owning streams wait for the other stream before it releases (the allocator does not track uses).
void hold_frees();
void release_frees();
// From begin_set_aside(s) to end_set_aside() (one at a time), a freed block of another stream
// than `s` is set aside, not freed: work queued on `s` (a second stream) may still read it, and
// its own stream has not yet waited for that work. end_set_aside() hands these blocks over;
// put_back_set_aside() frees them once their streams have waited for `s` (an event). Blocks of
// `s` itself are freed as usual: `s`'s order covers them.
void begin_set_aside(cudaStream_t stream);
std::vector<CachedBlock> end_set_aside();
void put_back_set_aside(const std::vector<CachedBlock>& blocks);
// Graph capture on `stream` (Backend::begin_capture): until end_graph_pool(), the requests of
// that stream, and of every stream that joined its capture (by waiting for one of its events),
// take blocks kept for graphs (its graph free list first, then its ordinary free list, then a new
// cudaMalloc: a capture must not record pool allocations), and every block of those streams
// freed meanwhile is kept for graphs too, because a recorded kernel may use it at each replay. A
// block kept for graphs returns to the graph free list of its stream whenever it is freed, never
// to the ordinary one: the memory a graph's replays write is never another tensor's outside
// graphs. One capture at a time per process. The graphs of one stream share its graph blocks: a graph
// must not be replayed after another one of its stream has been captured.
void begin_graph_pool(cudaStream_t stream);
void end_graph_pool();
AllocatorStats allocator_stats();
void reset_peak_stats();
// Returns the cached free blocks to the pool (stream-ordered) and the pool's unused memory to the
// driver.
void release_cached();

}  // namespace fp8moe::cuda
