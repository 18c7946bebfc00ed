// The CUDA backend's runtime: the caching allocator (size classes, reuse without the device pool,
// the figures it reports, frees set aside for a second stream) and streams and events (ops go to
// the current stream; an event orders two streams). The size-class test runs without a GPU; the
// others skip without one.
//   build/tests/cuda/test_cuda_runtime
#include <gtest/gtest.h>

#include <vector>

#include "cuda/runtime/caching_allocator.hpp"
#include "cuda_test_util.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {
namespace {

TEST(CachingAllocator, SizeClassesHoldTheRequestAndWasteAtMostAQuarter) {
  size_t last = 0;
  for (size_t b : {size_t(1), size_t(511), size_t(512), size_t(513), size_t(4096), size_t(1) << 20, (size_t(1) << 20) + 1,
                   size_t(3) << 20, size_t(5000000), size_t(1) << 30, (size_t(1) << 30) + 12345}) {
    const size_t c = cuda::allocator_size_class(b);
    EXPECT_GE(c, b) << b;
    EXPECT_GE(c, last) << "classes grow with the request: " << b;
    last = c;
    if (b <= (size_t(1) << 20)) {
      EXPECT_EQ(c % 512, 0u) << b;
      EXPECT_LT(c - b, 512u) << b;
    } else {
      EXPECT_LE(double(c), 1.25 * double(b)) << b;
    }
  }
  // Requests a little apart share a class (MoE segments that move between steps).
  EXPECT_EQ(cuda::allocator_size_class(5000000), cuda::allocator_size_class(5100000));
}

TEST(CachingAllocator, FreedBlocksServeTheNextRequestsWithoutThePool) {
  FP8MOE_REQUIRE_GPU();
  auto be = make_backend("cuda");
  const std::vector<int64_t> sizes = {1000, 70000, 3 << 20, 1234567};
  std::vector<void*> first;
  {
    std::vector<Tensor> ts;
    for (int64_t n : sizes) ts.push_back(be->empty(DType::f32, {n}));
    for (const Tensor& t : ts) first.push_back(t.view().data);
  }
  const cuda::AllocatorStats before = cuda::allocator_stats();
  std::vector<Tensor> again;
  for (int64_t n : sizes) again.push_back(be->empty(DType::f32, {n}));
  const cuda::AllocatorStats after = cuda::allocator_stats();
  EXPECT_EQ(after.pool_allocations, before.pool_allocations) << "a cached block of the class and stream exists";
  EXPECT_EQ(after.allocations, before.allocations + int64_t(sizes.size()));
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(again[i].view().data, first[i]) << "size " << sizes[i];
  EXPECT_EQ(after.reserved, before.reserved);
}

TEST(CachingAllocator, MemoryStatsFollowTheTensors) {
  FP8MOE_REQUIRE_GPU();
  auto be = make_backend("cuda");
  const Backend::MemoryStats s0 = be->memory_stats();
  int64_t during = 0;
  {
    Tensor t = be->zeros(DType::bf16, {1 << 20});  // 2 MiB
    during = be->memory_stats().allocated;
    EXPECT_EQ(during - s0.allocated, int64_t(cuda::allocator_size_class(size_t(2) << 20)));
    EXPECT_GE(be->memory_stats().peak_allocated, during);
    EXPECT_GE(be->memory_stats().reserved, during);
  }
  EXPECT_EQ(be->memory_stats().allocated, s0.allocated);
  EXPECT_GE(be->memory_stats().reserved, during) << "the freed block stays cached";
}

// Work queued on a second stream may still read a block of the first that the host drops: set
// aside, it is not the first stream's next block of its class until it is put back; the second
// stream's own blocks are reused at once (its order covers them).
TEST(CachingAllocator, FreesOfOtherStreamsAreSetAsideUntilPutBack) {
  FP8MOE_REQUIRE_GPU();
  auto be = make_backend("cuda");
  const cudaStream_t first = static_cast<cudaStream_t>(be->stream().native());
  const Stream second_stream = be->new_stream();
  const cudaStream_t second = static_cast<cudaStream_t>(second_stream.native());
  const cuda::CachedBlock a = cuda::cached_malloc(12288, first), b = cuda::cached_malloc(12288, second);
  cuda::begin_set_aside(second);
  cuda::cached_free(a);
  cuda::cached_free(b);
  const cuda::CachedBlock a2 = cuda::cached_malloc(12288, first), b2 = cuda::cached_malloc(12288, second);
  EXPECT_NE(a2.ptr, a.ptr) << "the first stream's block is set aside";
  EXPECT_EQ(b2.ptr, b.ptr) << "the second stream's own block is reused";
  const std::vector<cuda::CachedBlock> aside = cuda::end_set_aside();
  ASSERT_EQ(aside.size(), 1u);
  EXPECT_EQ(aside[0].ptr, a.ptr);
  const int64_t in_use = cuda::allocator_stats().allocated;
  cuda::put_back_set_aside(aside);
  EXPECT_EQ(cuda::allocator_stats().allocated, in_use - int64_t(a.size));
  const cuda::CachedBlock a3 = cuda::cached_malloc(12288, first);
  EXPECT_EQ(a3.ptr, a.ptr) << "put back, it serves its stream again";
  for (const cuda::CachedBlock& x : {a2, b2, a3}) cuda::cached_free(x);
  EXPECT_THROW(
      {
        cuda::begin_set_aside(second);
        struct End {
          ~End() { (void)cuda::end_set_aside(); }
        } end;
        cuda::begin_set_aside(second);
      },
      Error);
}

TEST(CudaStreams, OpsGoToTheCurrentStreamAndAnEventOrdersTwoStreams) {
  FP8MOE_REQUIRE_GPU();
  auto be = make_backend("cuda");
  const Stream compute = be->stream();
  const Stream side = be->new_stream();
  ASSERT_FALSE(side == compute);
  const int64_t n = int64_t(1) << 24;  // 64 MiB: each axpy runs long enough to race
  constexpr int kAdds = 40;
  Tensor ones = be->zeros(DType::f32, {n}), x = be->zeros(DType::f32, {n});
  {
    Tensor h = Tensor::host(DType::f32, {n});
    for (int64_t i = 0; i < n; ++i) h.ptr<float>()[i] = 1.0f;
    be->copy(ones.view(), h.view());
  }
  compute.synchronize();
  Event done = be->new_event();
  {
    const StreamScope on_side(*be, side);
    EXPECT_TRUE(be->stream() == side);
    for (int i = 0; i < kAdds; ++i) be->axpy(1.0, ones.view(), 1.0, x.view());
    done.record(side);
  }
  EXPECT_TRUE(be->stream() == compute) << "the scope restores the stream";
  // NOTES: without this wait the read-back on the compute stream races the side stream's adds.
  done.wait(compute);
  Tensor h = be->to_host(x);
  EXPECT_TRUE(done.query());
  for (int64_t i : {int64_t(0), n / 2, n - 1}) EXPECT_EQ(h.ptr<float>()[i], float(kAdds)) << i;
}

}  // namespace
}  // namespace fp8moe
