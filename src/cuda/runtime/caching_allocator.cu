// The caching allocator (caching_allocator.hpp): free lists per (device, stream, size class); one
// mutex, held for a hash lookup and a vector push or pop. Blocks kept for graphs have free lists
// of their own, with the same keys. The callers hold their blocks' descriptions.
#include "cuda/runtime/caching_allocator.hpp"

#include <algorithm>
#include <bit>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda {

size_t allocator_size_class(size_t bytes) {
  constexpr size_t kSmallStep = 512, kSmallMax = size_t(1) << 20;
  if (bytes <= kSmallMax) return std::max(kSmallStep, (bytes + kSmallStep - 1) / kSmallStep * kSmallStep);
  // 2^k <= bytes - 1 < 2^(k+1): classes 2^k * (1 + i/4), i = 1..4.
  const int k = std::bit_width(bytes - 1) - 1;
  const size_t quarter = size_t(1) << (k - 2);
  return (bytes + quarter - 1) / quarter * quarter;
}

namespace {

using Block = CachedBlock;

struct Key {
  int device;
  cudaStream_t stream;
  size_t size;
  bool operator==(const Key& o) const { return device == o.device && stream == o.stream && size == o.size; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return (std::hash<const void*>()(k.stream) * 31 + std::hash<size_t>()(k.size)) * 31 + size_t(k.device);
  }
};

class Cache {
 public:
  Block allocate(size_t bytes, cudaStream_t stream, int device) {
    const size_t size = allocator_size_class(bytes);
    const Key key{device, stream, size};
    bool graph = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stat(device).allocations;
      graph = capturing_ && captured(stream);
      if (graph) {
        if (void* p = pop(graph_free_, key)) return taken(Block{p, size, stream, device, true});
        if (void* p = pop(free_, key)) {
          stat(device).graph_reserved += int64_t(size);
          return taken(Block{p, size, stream, device, true});
        }
      } else if (void* p = pop(free_, key)) {
        return taken(Block{p, size, stream, device});
      }
    }
    void* p = nullptr;
    if (graph) {
      // Not a stream operation, so the capture records nothing; cudaMallocAsync would add an
      // allocation node to the graph.
      FP8MOE_CUDA_CHECK(cudaMalloc(&p, size));
    } else {
      cudaMemPool_t pool = pool_of(device);
      cudaError_t e = cudaMallocAsync(&p, size, pool, stream);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        release(device);
        e = cudaMallocAsync(&p, size, pool, stream);
      }
      FP8MOE_CUDA_CHECK(e);
    }
    std::lock_guard<std::mutex> lock(mu_);
    AllocatorStats& st = stat(device);
    ++st.pool_allocations;
    st.reserved += int64_t(size);
    if (graph) st.graph_reserved += int64_t(size);
    st.peak_reserved = std::max(st.peak_reserved, st.reserved);
    return taken(Block{p, size, stream, device, graph});
  }

  void free(Block b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!b.graph && capturing_ && captured(b.stream)) {  // a recorded kernel may have used it
      b.graph = true;
      stat(b.device).graph_reserved += int64_t(b.size);
    }
    if (aside_ && b.stream != aside_stream_) {
      aside_blocks_.push_back(b);  // its stream may not have waited yet for the one that used it
      return;
    }
    if (holds_ > 0) {
      held_.push_back(b);  // still counted as allocated: it is not reusable yet
      return;
    }
    put_back(b);
  }

  void begin_graph(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    FP8MOE_CHECK(!capturing_, "graph capture: another capture is in progress in this process");
    capturing_ = true;
    capture_stream_ = stream;
  }
  void end_graph() {
    std::lock_guard<std::mutex> lock(mu_);
    capturing_ = false;
    capture_stream_ = nullptr;
  }

  void hold() {
    std::lock_guard<std::mutex> lock(mu_);
    ++holds_;
  }
  void release_held() {
    std::lock_guard<std::mutex> lock(mu_);
    if (holds_ > 0 && --holds_ > 0) return;
    for (const Block& b : held_) put_back(b);
    held_.clear();
  }

  void begin_set_aside(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    FP8MOE_CHECK(!aside_, "caching allocator: frees are already being set aside");
    aside_ = true;
    aside_stream_ = stream;
  }
  std::vector<Block> end_set_aside() {
    std::lock_guard<std::mutex> lock(mu_);
    aside_ = false;
    return std::exchange(aside_blocks_, {});
  }
  void put_back_set_aside(const std::vector<Block>& blocks) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Block& b : blocks) {
      if (holds_ > 0) held_.push_back(b);
      else put_back(b);
    }
  }

  void release(int device) {
    std::vector<std::pair<void*, cudaStream_t>> cached;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end();) {
        if (it->first.device != device) {
          ++it;
          continue;
        }
        for (void* p : it->second) cached.emplace_back(p, it->first.stream);
        stat(device).reserved -= int64_t(it->first.size * it->second.size());
        it = free_.erase(it);
      }
    }
    for (const auto& [p, s] : cached) (void)cudaFreeAsync(p, s);
    // The blocks return to the driver once the streams have passed their frees.
    (void)cudaDeviceSynchronize();
    (void)cudaMemPoolTrimTo(pool_of(device), 0);
  }

  AllocatorStats stats(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    return stat(device);
  }
  void reset_peak(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    AllocatorStats& st = stat(device);
    st.peak_allocated = st.allocated;
    st.peak_reserved = st.reserved;
  }

 private:
  // Under mu_. Whether work on `s` is being recorded: the stream the capture began on, or one
  // that joined it by waiting for an event of a captured stream (only asked during a capture).
  bool captured(cudaStream_t s) const {
    if (s == capture_stream_) return true;
    // Asking about the legacy stream while a stream that syncs with it records is an error.
    if (s == nullptr) return false;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &status) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return status == cudaStreamCaptureStatusActive;
  }
  AllocatorStats& stat(int device) {
    if (size_t(device) >= stats_.size()) stats_.resize(size_t(device) + 1);
    return stats_[size_t(device)];
  }
  Block taken(const Block& b) {
    AllocatorStats& st = stat(b.device);
    st.allocated += int64_t(b.size);
    st.peak_allocated = std::max(st.peak_allocated, st.allocated);
    return b;
  }
  void put_back(const Block& b) {
    stat(b.device).allocated -= int64_t(b.size);
    (b.graph ? graph_free_ : free_)[Key{b.device, b.stream, b.size}].push_back(b.ptr);
  }
  using FreeLists = std::unordered_map<Key, std::vector<void*>, KeyHash>;
  static void* pop(FreeLists& lists, const Key& k) {
    auto it = lists.find(k);
    if (it == lists.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    return p;
  }
  // The device's stream-ordered pool, set to keep what it is given back for reuse instead of
  // returning it to the driver at every synchronization (release() trims it).
  cudaMemPool_t pool_of(int device) {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (size_t(device) >= pools_.size()) pools_.resize(size_t(device) + 1, nullptr);
    if (!pools_[size_t(device)]) {
      cudaMemPool_t pool = nullptr;
      FP8MOE_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
      uint64_t keep = UINT64_MAX;
      FP8MOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
      pools_[size_t(device)] = pool;
    }
    return pools_[size_t(device)];
  }

  std::mutex mu_, pool_mu_;
  FreeLists free_;
  FreeLists graph_free_;  // blocks kept for graphs (never returned to the pool)
  bool capturing_ = false;
  cudaStream_t capture_stream_ = nullptr;
  int holds_ = 0;
  std::vector<Block> held_;  // freed while held
  bool aside_ = false;  // begin_set_aside .. end_set_aside
  cudaStream_t aside_stream_ = nullptr;
  std::vector<Block> aside_blocks_;
  std::vector<AllocatorStats> stats_;  // per device
  std::vector<cudaMemPool_t> pools_;
};

// Made on first use and never destroyed: blocks may be freed during static destruction, after
// the context is gone, and the process returns the memory anyway.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

int current_device() {
  int device = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace

CachedBlock cached_malloc(size_t bytes, cudaStream_t stream, int device) {
  return bytes == 0 ? CachedBlock{} : cache().allocate(bytes, stream, device);
}
CachedBlock cached_malloc(size_t bytes, cudaStream_t stream) { return cached_malloc(bytes, stream, current_device()); }
void cached_free(const CachedBlock& b) {
  if (b.ptr) cache().free(b);
}
void hold_frees() { cache().hold(); }
void begin_graph_pool(cudaStream_t stream) { cache().begin_graph(stream); }
void end_graph_pool() { cache().end_graph(); }
void release_frees() { cache().release_held(); }
void begin_set_aside(cudaStream_t stream) { cache().begin_set_aside(stream); }
std::vector<CachedBlock> end_set_aside() { return cache().end_set_aside(); }
void put_back_set_aside(const std::vector<CachedBlock>& blocks) { cache().put_back_set_aside(blocks); }
AllocatorStats allocator_stats() { return cache().stats(current_device()); }
void reset_peak_stats() { cache().reset_peak(current_device()); }
void release_cached() { cache().release(current_device()); }

}  // namespace fp8moe::cuda
