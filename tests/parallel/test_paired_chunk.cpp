// The paired F&B chunk's order on the CPU backend (whose streams run every op at once): the host
// issues the halves' steps in turn in both modes, a step waits for the other stream only where
// both halves name a resource, a step that throws stops the chunk with its error, and a mode's
// name is checked. The waits themselves are tested on the GPU
// (tests/cuda/test_cuda_paired_chunk.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/paired_chunk.hpp"

namespace fp8moe::pipeline {
namespace {

TEST(PairedChunk, IssuesTheHalvesInTurn) {
  auto be = make_backend("cpu");
  PairedChunk pair(*be);
  for (FbMode mode : {FbMode::overlap, FbMode::serial}) {
    std::string order;
    auto step = [&](std::string name) { return ChunkStep{[&order, name] { order += name + " "; }, {}}; };
    pair.run({step("f0"), step("f1")}, {step("b0"), step("b1"), step("b2")}, mode);
    EXPECT_EQ(order, "f0 b0 f1 b1 b2 ") << fb_mode_name(mode);
  }
}

TEST(PairedChunk, WaitsOnlyWhereBothHalvesNameAResource) {
  auto be = make_backend("cpu");
  PairedChunk pair(*be);
  auto nothing = [](std::vector<int> shared) { return ChunkStep{[] {}, shared}; };
  // f1 names 2 after b0 did; b1 names 1 after f0 did; f0, b0 and b2 come first to their resource.
  const std::vector<ChunkStep> f = {nothing({1}), nothing({2})}, b = {nothing({2}), nothing({1}), nothing({3})};
  pair.run(f, b, FbMode::overlap);
  EXPECT_EQ(pair.shared_waits(), 2);
  pair.run({nothing({1})}, {nothing({2})}, FbMode::overlap);
  EXPECT_EQ(pair.shared_waits(), 0);
  pair.run(f, b, FbMode::serial);
  EXPECT_EQ(pair.shared_waits(), 0) << "one stream: nothing to wait for";
}

TEST(PairedChunk, AStepThatThrowsStopsTheChunk) {
  auto be = make_backend("cpu");
  PairedChunk pair(*be);
  int after = 0;
  const std::vector<ChunkStep> f = {{[] { throw Error("forward step failed"); }, {}}, {[&] { ++after; }, {}}};
  EXPECT_THROW(pair.run(f, {{[&] { ++after; }, {}}}, FbMode::overlap), Error);
  EXPECT_EQ(after, 0) << "steps after the failing one ran";
}

TEST(PairedChunk, ModeNames) {
  EXPECT_EQ(parse_fb_mode("overlap"), FbMode::overlap);
  EXPECT_EQ(parse_fb_mode("serial"), FbMode::serial);
  try {
    parse_fb_mode("both");
    ADD_FAILURE() << "an unknown mode was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected overlap or serial, got 'both'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fp8moe::pipeline
