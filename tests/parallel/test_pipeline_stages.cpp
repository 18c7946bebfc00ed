// Stages of the pipeline (include/fp8moe/pipeline_executor.hpp): the cost model's balanced split
// and the --pp-split override with its errors.
#include <gtest/gtest.h>

#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/pipeline_executor.hpp"

namespace fp8moe {
namespace {

ModelConfig layers(int64_t n, int64_t mtp = 1) {
  ModelConfig c = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  c.num_hidden_layers = n;
  c.num_nextn_predict_layers = mtp;
  return c;
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(PipelineStages, CostsFollowTheConfig) {
  const ModelConfig c = layers(4);
  const pipeline::StageCosts s = pipeline::stage_costs(c);
  ASSERT_EQ(s.sublayers.size(), 8u);
  EXPECT_EQ(s.sublayers[0], s.sublayers[2]);  // every attention sublayer alike
  EXPECT_LT(s.sublayers[1], s.sublayers[3]);  // the dense MLP (intermediate 256) below the MoE (3 experts of 128)
  EXPECT_GT(s.head, double(c.hidden_size * c.vocab_size));  // the head and the MTP module
}

TEST(PipelineStages, BalancedSplitLightensTheLastStage) {
  // The head and the MTP module weigh on the last stage: it gets the fewest sublayers.
  const pipeline::StageSplit s = pipeline::balanced_split(layers(8), 4);
  ASSERT_EQ(s.stages(), 4);
  EXPECT_EQ(s.first.front(), 0);
  EXPECT_EQ(s.first.back(), 16);
  for (int i = 0; i < 4; ++i) EXPECT_GE(s.size(i), 1);
  EXPECT_LT(s.size(3), s.size(1)) << s.str();
  // Without the head's weight the split is even.
  ModelConfig even = layers(8, 0);
  even.vocab_size = 256;
  EXPECT_EQ(pipeline::balanced_split(even, 1).str(), "16");
  EXPECT_EQ(pipeline::balanced_split(layers(2), 4).str(), "1,1,1,1");
}

TEST(PipelineStages, SplitOptionAndItsErrors) {
  EXPECT_EQ(pipeline::parse_split("3,1", layers(2), 2).str(), "3,1");
  expect_error([] { pipeline::parse_split("3,2", layers(2), 2); }, "covers 5 trunk sublayers, 'tiny' has 4");
  expect_error([] { pipeline::parse_split("4", layers(2), 2); }, "gives 1 stages, the schedule has 2");
  expect_error([] { pipeline::parse_split("4,0", layers(2), 2); }, "'0' is not a count of sublayers >= 1");
  expect_error([] { pipeline::parse_split("2,x", layers(2), 2); }, "'x' is not a count");
  expect_error([] { pipeline::balanced_split(layers(2), 8); }, "8 stages need at least as many trunk sublayers");
  EXPECT_EQ(pipeline::stages_for(pipeline::Method::DualPipeV, 4), 8);
  EXPECT_EQ(pipeline::stages_for(pipeline::Method::DualPipe, 4), 4);
}

}  // namespace
}  // namespace fp8moe
