// `fp8moe bench gemm --shapes`: the problem list it parses (host only, runs without a GPU).
#include <gtest/gtest.h>

#include "bench/bench.hpp"
#include "testing.hpp"

using fp8moe::cuda::parse_gemm_shapes;

TEST(BenchShapes, ParsesKindsAndSizes) {
  const auto v = parse_gemm_shapes("fprop:4096x7168x2048,fprop32:8192x4096x2048,fprop32+:1x16x128,wgrad:2048x512x8192");
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[0].kind, "fprop");
  EXPECT_EQ(v[0].M, 4096);
  EXPECT_EQ(v[0].N, 7168);
  EXPECT_EQ(v[0].K, 2048);
  EXPECT_FALSE(v[0].f32());
  EXPECT_FALSE(v[0].accumulate());
  EXPECT_TRUE(v[1].f32());
  EXPECT_FALSE(v[1].accumulate());
  EXPECT_FALSE(v[1].b_1x128());
  EXPECT_TRUE(v[2].f32() && v[2].accumulate() && !v[2].b_1x128());
  EXPECT_EQ(v[2].M, 1);
  EXPECT_TRUE(v[3].f32() && v[3].accumulate() && v[3].b_1x128());
  EXPECT_EQ(v[3].K, 8192);
}

TEST(BenchShapes, RefusesBadItemsByName) {
  for (const char* bad : {"", "fprop", "gemm:1x2x128", "fprop:1x2", "fprop:1x2x128x4", "fprop:0x16x128",
                          "fprop:64x16x128,", "fprop:64x16x128 ", "wgrad:-1x16x128"})
    fp8moe::testing::expect_error([&] { parse_gemm_shapes(bad); }, "bench gemm --shapes");
}
