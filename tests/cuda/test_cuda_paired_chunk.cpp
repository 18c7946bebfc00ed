// The paired F&B chunk on two CUDA streams (include/fp8moe/paired_chunk.hpp): each dependency the
// chunk keeps is tested where leaving it out races. Slow work (tens of passes over 256 MiB) sits
// ahead of the read or write a dependency orders, so that without it the other stream runs first
// and the values show it:
//   - the second stream's work starts after the current stream's work issued before the chunk;
//   - the current stream's work after the chunk sees the second stream's;
//   - steps of the two halves naming one resource run in the host's order;
//   - a tensor of the current stream dropped by the backward half while its stream still reads it
//     keeps its bytes (the freed memory is held until the streams join).
// Then the executor itself: DualPipeV on one rank, overlapped against serial, bitwise.
//   build/tests/cuda/test_cuda_paired_chunk
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "cuda_test_util.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/paired_chunk.hpp"
#include "fp8moe/pipeline_executor.hpp"
#include "micro_batches.hpp"

namespace fp8moe {
namespace {

constexpr int64_t kN = int64_t(1) << 26;  // floats: 256 MiB per tensor
constexpr int kSlow = 40;                 // passes of the slow work

struct Fixture {
  std::unique_ptr<Backend> be = make_cuda_backend();
  pipeline::PairedChunk pair{*be};
  Tensor ones;
  // Each of `zeros` made kN zeros, and the device idle.
  explicit Fixture(std::vector<Tensor*> zeros) {
    Tensor h = Tensor::host(DType::f32, {kN});
    for (int64_t i = 0; i < kN; ++i) h.ptr<float>()[i] = 1.0f;
    ones = testing::to_device(*be, h);
    for (Tensor* t : zeros) *t = be->zeros(DType::f32, {kN});
    be->synchronize();
  }
  void overlap(const std::vector<pipeline::ChunkStep>& forward, const std::vector<pipeline::ChunkStep>& backward) {
    pair.run(forward, backward, pipeline::FbMode::overlap);
  }
  // t += 1, kSlow times, on the current stream.
  void slow_add(const Tensor& t) {
    for (int i = 0; i < kSlow; ++i) be->axpy(1.0, ones.view(), 1.0, t.view());
  }
  // How many elements of t differ from v.
  int64_t unequal(const Tensor& t, float v) {
    const Tensor h = be->to_host(t);
    int64_t n = 0;
    for (int64_t i = 0; i < h.numel(); ++i) n += h.ptr<float>()[i] != v;
    return n;
  }
};

TEST(PairedChunkCuda, SecondStreamWaitsForTheWorkBefore) {
  FP8MOE_REQUIRE_GPU();
  Tensor x, y;
  Fixture f({&x, &y});
  f.slow_add(x);  // before the chunk, on the current stream
  f.overlap({{[] {}, {}}}, {{[&] { f.be->copy(y.view(), x.view()); }, {}}});
  EXPECT_EQ(f.unequal(y, float(kSlow)), 0) << "the backward half read x before the work ahead of the chunk wrote it";
}

TEST(PairedChunkCuda, CurrentStreamWaitsForTheSecondAfter) {
  FP8MOE_REQUIRE_GPU();
  Tensor z;
  Fixture f({&z});
  f.overlap({{[] {}, {}}}, {{[&] { f.slow_add(z); }, {}}});
  Tensor w = f.be->zeros(DType::f32, {kN});
  f.be->copy(w.view(), z.view());  // on the current stream, after the chunk
  EXPECT_EQ(f.unequal(w, float(kSlow)), 0) << "the work after the chunk read z before the backward half wrote it";
}

TEST(PairedChunkCuda, SharedResourceKeepsTheHostOrder) {
  FP8MOE_REQUIRE_GPU();
  Tensor w;
  Fixture f({&w});
  // Forward: w += 1, kSlow times; then the backward: w *= 2. In order: 2 kSlow.
  f.overlap({{[&] { f.slow_add(w); }, {7}}}, {{[&] { f.be->axpy(0.0, f.ones.view(), 2.0, w.view()); }, {7}}});
  EXPECT_EQ(f.pair.shared_waits(), 1);
  EXPECT_EQ(f.unequal(w, float(2 * kSlow)), 0) << "the halves' steps on one resource ran out of order";
}

TEST(PairedChunkCuda, DroppedTensorKeepsItsBytesUntilTheJoin) {
  FP8MOE_REQUIRE_GPU();
  auto t = std::make_shared<Tensor>();  // the current stream's
  Tensor busy, v;
  Fixture f({t.get(), &busy, &v});
  Backend& be = *f.be;
  be.axpy(7.0, f.ones.view(), 0.0, t->view());
  be.synchronize();
  // The backward half queues its read of t behind slow work and drops t; the forward half's next
  // step takes a tensor of t's size on the current stream and zeroes it at once.
  const auto read_and_drop = [&] {
    f.slow_add(busy);
    be.copy(v.view(), t->view());
    t.reset();
  };
  const auto reuse = [&] { be.zero(be.empty(DType::f32, {kN}).view()); };
  f.overlap({{[] {}, {}}, {reuse, {}}}, {{read_and_drop, {}}});
  EXPECT_EQ(f.unequal(v, 7.0f), 0) << "t's bytes were reused on the current stream before the backward half read them";
}

// The executor's F&B chunks on two streams against one stream: DualPipeV's two stages on one rank
// (five chunks in four micro-batches, the head's MTP module and stage 0's backward both adding to
// the embedding's gradient), the same losses and gradients bit for bit, over several steps.
TEST(PairedChunkCuda, ExecutorOverlappedEqualsSerial) {
  FP8MOE_REQUIRE_SM90();
  auto be = make_cuda_backend();
  // The sources' configs, or the working folder's when the binary runs away from its sources.
  const std::string in_sources = std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json";
  ModelConfig cfg = load_config(std::filesystem::exists(in_sources) ? in_sources : "configs/tiny.json");
  cfg.seq_len = 64;
  cfg.batch_size = 2;
  const int M = 4;
  const pipeline::Schedule schedule = pipeline::make_schedule(pipeline::Method::DualPipeV, 2, M);
  const pipeline::StageSplit split = pipeline::balanced_split(cfg, 2);
  std::vector<Tensor> tok, tgt;
  testing::seeded_micro_batches(cfg, M, 5, tok, tgt);
  Model overlapped(cfg, Recipe::from_name("fp8"), *be, 3), serial(cfg, Recipe::from_name("fp8"), *be, 3);
  pipeline::Executor a(overlapped, schedule, split, nullptr), b(serial, schedule, split, nullptr);
  b.set_fb_mode(pipeline::FbMode::serial);
  int chunks = 0;
  for (const pipeline::Op& op : schedule.rank_ops[0]) chunks += op.kind == pipeline::OpKind::ForwardBackward;
  ASSERT_GT(chunks, 0);
  for (int step = 0; step < 3; ++step) {
    overlapped.zero_grad();
    serial.zero_grad();
    const std::vector<StepStats> sa = a.run(tok, tgt, 1.0 / M), sb = b.run(tok, tgt, 1.0 / M);
    be->synchronize();
    for (int m = 0; m < M; ++m) {
      EXPECT_EQ(sa[size_t(m)].loss, sb[size_t(m)].loss) << "step " << step << " micro-batch " << m;
      EXPECT_EQ(sa[size_t(m)].expert_loads, sb[size_t(m)].expert_loads) << "step " << step << " micro-batch " << m;
    }
    for (const Parameter& p : overlapped.parameters()) {
      if (!p.trainable) continue;
      const Tensor ga = be->to_host(p.grad), gb = be->to_host(serial.parameter(p.name).grad);
      EXPECT_EQ(std::memcmp(ga.view().data, gb.view().data, ga.view().nbytes()), 0) << "step " << step << ": " << p.name;
    }
  }
}

}  // namespace
}  // namespace fp8moe
