// AdamW against an FP64 re-derivation, BF16 moments close to FP32 ones, schedule, clipping, and the
// CPU-memory EMA against a sequential computation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "fp8moe/backend.hpp"
#include "fp8moe/ema.hpp"
#include "fp8moe/optimizer.hpp"
#include "testing.hpp"

using namespace fp8moe;

TEST(AdamW, MatchesFp64ReferenceWithFp32Moments) {
  auto rng = fp8moe::testing::make_rng();
  Tensor w = fp8moe::testing::random_normal(rng, DType::f32, {50});
  Tensor g = Tensor::host(DType::f32, {50});
  std::vector<double> rw(50), rm(50, 0), rv(50, 0);
  for (int i = 0; i < 50; ++i) rw[size_t(i)] = w.ptr<float>()[i];
  AdamWConfig cfg;
  cfg.moments = MomentPrecision::f32;
  auto cpu = make_backend("cpu");
  AdamW opt(*cpu, {{"w", w, g, true}}, cfg);
  std::normal_distribution<float> dist;
  for (int t = 1; t <= 20; ++t) {
    for (int i = 0; i < 50; ++i) g.ptr<float>()[i] = dist(rng);
    const float lr = 1e-2f, scale = 0.5f;
    opt.step(lr, scale);
    for (size_t i = 0; i < 50; ++i) {
      double gi = double(g.ptr<float>()[i]) * scale;
      rm[i] = 0.9 * rm[i] + 0.1 * gi;
      rv[i] = 0.95 * rv[i] + 0.05 * gi * gi;
      double upd = (rm[i] / (1 - std::pow(0.9, t))) / (std::sqrt(rv[i] / (1 - std::pow(0.95, t))) + 1e-8);
      rw[i] -= lr * (upd + 0.1 * rw[i]);
    }
  }
  for (size_t i = 0; i < 50; ++i) EXPECT_NEAR(w.ptr<float>()[i], rw[i], 1e-5 * (1 + std::fabs(rw[i])));
  EXPECT_EQ(opt.steps(), 20);
}

TEST(AdamW, Bf16MomentsStayCloseToFp32) {
  auto rng = fp8moe::testing::make_rng();
  Tensor w1 = fp8moe::testing::random_normal(rng, DType::f32, {1000});
  Tensor w2 = Tensor::host_like(w1.view());
  std::memcpy(w2.ptr<float>(), w1.ptr<float>(), 4000);
  Tensor g = Tensor::host(DType::f32, {1000});
  AdamWConfig c32, c16;
  c32.moments = MomentPrecision::f32;
  auto cpu = make_backend("cpu");
  AdamW o32(*cpu, {{"w", w1, g, true}}, c32), o16(*cpu, {{"w", w2, g, true}}, c16);
  EXPECT_EQ(o16.first_moments()[0].dtype(), DType::bf16);
  std::normal_distribution<float> dist;
  for (int t = 0; t < 50; ++t) {
    for (int i = 0; i < 1000; ++i) g.ptr<float>()[i] = dist(rng);
    o32.step(1e-3f);
    o16.step(1e-3f);
  }
  double diff = 0;
  for (int i = 0; i < 1000; ++i) diff = std::max(diff, double(std::fabs(w1.ptr<float>()[i] - w2.ptr<float>()[i])));
  EXPECT_LT(diff, 1e-3);  // 50 steps of lr 1e-3 move weights by up to 5e-2
}

TEST(LrSchedule, WarmupThenCosine) {
  LrSchedule s{1.0f, 0.1f, 10, 110};
  EXPECT_FLOAT_EQ(s.at(0), 0.1f);
  EXPECT_FLOAT_EQ(s.at(9), 1.0f);
  EXPECT_FLOAT_EQ(s.at(10), 1.0f);
  EXPECT_NEAR(s.at(60), 0.55f, 1e-6);
  EXPECT_FLOAT_EQ(s.at(110), 0.1f);
  EXPECT_FLOAT_EQ(s.at(500), 0.1f);
}

TEST(Clipping, ScalesToMaxNorm) {
  Tensor g = Tensor::host(DType::f32, {2});
  Tensor w = Tensor::host(DType::f32, {2});
  g.ptr<float>()[0] = 3;
  g.ptr<float>()[1] = 4;
  std::vector<ParamRef> ps{{"w", w, g, true}};
  EXPECT_DOUBLE_EQ(global_grad_norm(*make_backend("cpu"), ps), 5.0);
  EXPECT_FLOAT_EQ(clip_scale(5.0, 1.0f), 0.2f);
  EXPECT_FLOAT_EQ(clip_scale(0.5, 1.0f), 1.0f);
  EXPECT_FLOAT_EQ(clip_scale(5.0, 0.0f), 1.0f);
}

TEST(Ema, BackgroundUpdatesMatchSequentialAverage) {
  auto rng = fp8moe::testing::make_rng();
  Tensor w = fp8moe::testing::random_normal(rng, DType::f32, {300});
  Tensor g = Tensor::host(DType::f32, {300});
  std::vector<double> ref(300);
  for (int i = 0; i < 300; ++i) ref[size_t(i)] = w.ptr<float>()[i];
  auto cpu = make_backend("cpu");
  ParameterEma ema({{"w", w, g, true}}, 0.9f, *cpu);
  std::normal_distribution<float> dist;
  for (int step = 0; step < 30; ++step) {
    for (int i = 0; i < 300; ++i) w.ptr<float>()[i] += dist(rng);
    ema.update_async();  // snapshot taken now; the loop may change w right after
    for (int i = 0; i < 300; ++i) ref[size_t(i)] = 0.9 * ref[size_t(i)] + 0.1 * double(w.ptr<float>()[i]);
  }
  ema.wait();
  EXPECT_EQ(ema.updates(), 30);
  for (int i = 0; i < 300; ++i) EXPECT_NEAR(ema.averages()[0].ptr<float>()[i], ref[size_t(i)], 1e-4);
}

TEST(Ema, ThreadedFoldIsBitIdenticalToOneThread) {
  // Two parameters, one spanning several of the fold's chunks: the split must not change any bit.
  auto rng = fp8moe::testing::make_rng();
  Tensor a = fp8moe::testing::random_normal(rng, DType::f32, {3 * 65536 + 17});
  Tensor b = fp8moe::testing::random_normal(rng, DType::f32, {1000});
  Tensor ga = Tensor::host_like(a.view()), gb = Tensor::host_like(b.view());
  auto cpu = make_backend("cpu");
  const std::vector<ParamRef> refs{{"a", a, ga, true}, {"b", b, gb, true}};
  ParameterEma one(refs, 0.99f, *cpu, 1), four(refs, 0.99f, *cpu, 4);
  std::normal_distribution<float> dist;
  for (int step = 0; step < 3; ++step) {
    for (int64_t i = 0; i < a.numel(); ++i) a.ptr<float>()[i] += dist(rng);
    for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] += dist(rng);
    one.update_async();
    four.update_async();
    one.wait();
    four.wait();
  }
  for (size_t p = 0; p < 2; ++p)
    EXPECT_EQ(std::memcmp(one.averages()[p].ptr<float>(), four.averages()[p].ptr<float>(),
                          size_t(one.averages()[p].numel()) * sizeof(float)),
              0)
        << refs[p].name;
}
