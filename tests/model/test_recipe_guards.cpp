// Guards of the FP8 recipe's choices (report §3.3, SPEC.md §1): each test observes one choice in a
// training step of the tiny MoE config (configs/tiny.json) through a backend that records every
// quantized tensor and FP8 GEMM (spy_backend.hpp), not its effect on a loss, which on a model this
// small does not tell the choices apart (fp8, fp8-no-promotion and fp8-per-tensor all land within
// 3e-4 of the fp32 loss). Each test lists the change it catches; every listed change was made on a
// scratch copy of the source and the test failed with it (docs/ACCURACY.md, "Recipe guards").
// Run: ctest -R RecipeGuards (FP8MOE_SEED=<n> replays a seed).
#include <cfloat>
#include <cmath>
#include <set>

#include "fp8moe/optimizer.hpp"
#include "fp8moe/trainer.hpp"
#include "model_testing.hpp"
#include "spy_backend.hpp"

namespace fp8moe::testing {
namespace {

struct SpyRun {
  std::unique_ptr<SpyBackend> be = std::make_unique<SpyBackend>();
  StepStats st;
  MemoryAccount memory;
};

SpyRun spy_step(const std::string& recipe, bool check_gemms = false, const ModelConfig& cfg = tiny_config()) {
  auto rng = make_rng();
  const uint64_t seed = rng();
  auto [tok, tgt] = random_batch(rng, cfg);
  SpyRun r;
  r.be->check_gemms = check_gemms;
  Model model(cfg, Recipe::from_name(recipe), *r.be, seed);
  model.zero_grad();
  r.st = model.forward_backward(tok.view(), tgt.view(), 1.0);
  r.memory = model.saved_memory();
  return r;
}

bool is_pow2(float s) {
  int e;
  return std::frexp(s, &e) == 0.5f;
}

// The largest |decoded code| of every tile (1x128: per row per 128 columns) or block (128x128) of
// q whose scale is a normal quantization scale (not the all-zero tile's 1, not the FLT_MIN floor).
std::vector<double> tile_maxima(const QuantizedTensor& q) {
  const QuantizedView v = q.view();
  const int64_t R = v.rows(), C = v.cols();
  const bool tiles = v.kind == ScaleKind::tile_1x128;
  const int64_t br = tiles ? 1 : kQuantGroup;
  std::vector<double> out;
  for (int64_t r0 = 0; r0 < R; r0 += br)
    for (int64_t c0 = 0; c0 < C; c0 += kQuantGroup) {
      double m = 0;
      for (int64_t r = r0; r < std::min(R, r0 + br); ++r)
        for (int64_t c = c0; c < std::min(C, c0 + kQuantGroup); ++c)
          m = std::max(m, std::fabs(double(decode_value(v.values.dtype, v.values.data, r * C + c))));
      const float s = v.scale_at(r0, c0);
      if (m > 0 && s > FLT_MIN) out.push_back(m);
    }
  return out;
}

// Online absmax scales reach the format's maximum in every tile they cover: exactly (FP32
// scales: x / (amax / max) rounds to max) or at least half of it (power-of-two scales round the
// scale up by less than 2x; amax / s just above max / 2 may round down to it). Returns the number of tiles that do not.
int64_t tiles_short_of_max(const QuantizedTensor& q, ScaleMode mode) {
  const double mx = max_finite(q.values.dtype());
  int64_t bad = 0;
  for (double m : tile_maxima(q)) bad += mode == ScaleMode::fp32 ? m != mx : !(m >= mx / 2 && m <= mx);
  return bad;
}

// Catches: activations quantized per tensor (quantize_per_tensor in model::quant_act, or
// Recipe::per_tensor set for fp8: no 1x128 quantization reaches the backend), with coarser tiles
// (a 128x128 block per activation tile: most rows of a block stay short of 448), or with a scale
// that is not the tile's own absmax (a delayed, history-based amax).
// Seen failing: with quantize_1x128 of the CPU reference taking each tile's amax over its whole
// row instead of its 128-column group (11229 of 32398 tiles short of the maximum).
TEST(RecipeGuards, ActivationsIn1x128TilesWithOnlineScales) {
  const SpyRun r = spy_step("fp8");
  int64_t tiles = 0, bad = 0;
  for (const auto& q : r.be->quantized) {
    if (q.q.kind != ScaleKind::tile_1x128) continue;
    ASSERT_EQ(q.q.scales.size(0), ceil_div(q.q.values.size(1), kQuantGroup)) << q.op << " " << q.out;
    tiles += int64_t(tile_maxima(q.q).size());
    bad += tiles_short_of_max(q.q, q.mode);
  }
  std::cout << "[ guard    ] 1x128 tiles: " << tiles << " checked, " << bad << " short of the format maximum\n";
  EXPECT_GT(tiles, 1000);
  EXPECT_EQ(bad, 0);
}

// Catches: weights quantized per tensor, or in 1x128 tiles instead of 128x128 blocks (scales of
// each row), or with blocks of another size.
// Seen failing: with model::quant_weight calling quantize_per_tensor (0 blocks recorded).
TEST(RecipeGuards, WeightsIn128x128Blocks) {
  const SpyRun r = spy_step("fp8");
  int64_t blocks = 0, bad = 0, rows_short = 0, rows = 0;
  for (const auto* q : r.be->of("quantize_128x128")) {
    const auto ss = scale_shape(ScaleKind::block_128x128, q->q.values.size(0), q->q.values.size(1));
    ASSERT_EQ(q->q.scales.size(0), ss[0]);
    ASSERT_EQ(q->q.scales.size(1), ss[1]);
    EXPECT_EQ(q->mode, ScaleMode::fp32) << "the report's weight scales are FP32";
    blocks += int64_t(tile_maxima(q->q).size());
    bad += tiles_short_of_max(q->q, q->mode);
    // The same codes seen as 1x128 tiles: a block's scale is shared by its 128 rows, so most rows
    // stay short of the maximum (with 1x128 weight scales every row would reach it).
    QuantizedTensor as_rows{q->q.values, Tensor::host(DType::f32, {ss[1], scale_ld(q->q.values.size(0))}),
                            ScaleKind::tile_1x128};
    std::fill_n(as_rows.scales.ptr<float>(), as_rows.scales.numel(), 1.0f);
    rows += int64_t(tile_maxima(as_rows).size());
    rows_short += tiles_short_of_max(as_rows, ScaleMode::fp32);
  }
  std::cout << "[ guard    ] 128x128 blocks: " << blocks << " checked, " << bad << " short of 448; " << rows_short << " of "
            << rows << " rows inside them short of 448\n";
  EXPECT_GT(blocks, 20);
  EXPECT_EQ(bad, 0);
  EXPECT_GT(rows_short, rows / 2);
}

// The report's three places for power-of-two scales: the attention-out Linear input (its E5M6
// cache), the activations before MoE dispatch (the routed experts' input, gathered and quantized
// by moe_permute_quantize) and the activation gradients before the MoE down projection (its dy, of
// the expert-sorted rows, quantized by quantize_1x128_and_128x1); ordinary tensors keep FP32 scales.
// Catches: Recipe::pow2_mode set to fp32 for fp8, or any one place passing the ordinary scale
// mode (attention.cpp's linear_input of the attention output, moe.cpp's moe_permute_quantize or
// the mlp_backward_input's dy_mode of the routed experts).
// Seen failing: with pow2_mode = ScaleMode::fp32 in Recipe::from_name (384 of 384, 512 of 2048 and
// 508 of 2048 scales not powers of two at the three places), with moe.cpp passing scale_mode as
// the routed experts' dy_mode (the down projection's 508 of 2048 only), and with moe.cpp passing
// scale_mode to moe_permute_quantize (the dispatch's 512 of 2048 only).
TEST(RecipeGuards, PowerOfTwoScalesAtTheReportsThreePlaces) {
  // Expert width 256 != hidden 128: the down projection's dy [rows, hidden] is told apart by shape
  // from the gate and up projections' [rows, 256].
  ModelConfig cfg = tiny_config();
  cfg.moe_intermediate_size = 256;
  const SpyRun r = spy_step("fp8", false, cfg);
  const auto check_all_pow2 = [](const std::vector<const SpyBackend::Quantized*>& qs, const char* what) {
    ASSERT_FALSE(qs.empty()) << what << ": not quantized at all";
    int64_t n = 0, bad = 0;
    for (const auto* q : qs) {
      EXPECT_EQ(q->mode, ScaleMode::pow2) << what;
      for (int64_t i = 0; i < q->q.scales.numel(); ++i, ++n) bad += !is_pow2(q->q.scales.ptr<float>()[i]);
    }
    std::cout << "[ guard    ] " << what << ": " << qs.size() << " tensors, " << bad << " of " << n
              << " scales not a power of two\n";
    EXPECT_EQ(bad, 0) << what;
  };
  std::vector<const SpyBackend::Quantized*> attn_out, dispatch, down_dy;
  std::set<int64_t> dispatch_rows;
  for (const auto& q : r.be->quantized) {
    if (q.q.values.dtype() == DType::e5m6) attn_out.push_back(&q);
    if (q.op == "moe_permute_quantize") dispatch.push_back(&q), dispatch_rows.insert(q.q.values.size(0));
  }
  const int64_t D = cfg.hidden_size;
  for (const auto* q : r.be->of("quantize_1x128_and_128x1", "rows"))
    if (dispatch_rows.count(q->q.values.size(0)) && q->q.values.size(1) == D) down_dy.push_back(q);
  const int64_t moe_layers = cfg.num_moe_layers();
  EXPECT_EQ(int64_t(dispatch.size()), moe_layers);
  EXPECT_EQ(int64_t(down_dy.size()), moe_layers);
  check_all_pow2(attn_out, "attention-out Linear input");
  check_all_pow2(dispatch, "activations before MoE dispatch");
  check_all_pow2(down_dy, "activation gradients before the MoE down projection");
  // Elsewhere FP32 scales: most are not powers of two.
  int64_t n = 0, p2 = 0;
  for (const auto* q : r.be->of("rmsnorm_forward_fp8"))
    for (int64_t i = 0; i < q->q.scales.numel(); ++i, ++n) p2 += is_pow2(q->q.scales.ptr<float>()[i]);
  EXPECT_GT(n, 0);
  EXPECT_LT(p2, n / 10) << "the norms' Linear inputs keep FP32 scales";
}

// The attention-out Linear input is cached in E5M6 (1-5-6: 3 more mantissa bits than E4M3 at the
// range of E5M2), packed two codes in three bytes: 0.75 of its BF16 cache's bytes, scales apart.
// Catches: the cache in E4M3 (Recipe::attn_out_cache = e4m3, the fp8-f32-cache ablation's
// choice), or E5M6 stored in two bytes (the dtype_bytes of e5m6, the memory account).
// Seen failing: with attn_out_cache = DType::e4m3 for "fp8" (attn_out cached e4m3, 0.5 of BF16, no
// E5M6 tensor), and with dtype_bytes(e5m6, n) = 2 n (E5M6 unpacked: 1.0 of BF16).
TEST(RecipeGuards, AttentionOutCachedInPackedE5M6) {
  const SpyRun r = spy_step("fp8");
  const ModelConfig c = tiny_config();
  const int64_t T = c.batch_size * c.seq_len, Tp = round_up(T, kQuantGroup), K = c.num_attention_heads * c.v_head_dim;
  const MemoryAccount bf = predict_memory(c, Recipe::from_name("bf16"), T);
  int64_t layers = 0;
  for (const auto& it : r.memory.items) {
    if (it.tensor != "attn_out") continue;
    ++layers;
    EXPECT_EQ(it.dtype, DType::e5m6) << it.layer;
    EXPECT_EQ(it.bytes * 2, Tp * K * 3) << it.layer << ": 1.5 bytes per value";
    for (const auto& b : bf.items)
      if (b.layer == it.layer && b.tensor == "attn_out") {
        EXPECT_EQ(b.bytes, T * K * 2);
        std::cout << "[ guard    ] " << it.layer << " attn_out: " << it.bytes << " bytes (+ scales) vs BF16 " << b.bytes
                  << " at " << T << " tokens; " << double(it.bytes) / double(Tp * K * 2) << " of BF16 per cached row\n";
      }
  }
  EXPECT_EQ(layers, c.num_layers_total());
  // What the cache holds: E5M6 codes, their precision beyond E4M3's (a 6-bit mantissa: values that
  // E4M3's 3 bits cannot hold), and its power-of-two scales.
  int64_t e5m6_tensors = 0, finer = 0, total = 0;
  for (const auto& q : r.be->quantized) {
    if (q.q.values.dtype() != DType::e5m6) continue;
    ++e5m6_tensors;
    for (int64_t i = 0; i < q.q.values.numel(); ++i) {
      const uint16_t code = e5m6_load(q.q.values.ptr<uint8_t>(), i);
      finer += (code & 0x7) != 0;  // the three mantissa bits E4M3 lacks
      ++total;
    }
  }
  EXPECT_EQ(e5m6_tensors, c.num_layers_total());
  EXPECT_GT(finer, total / 2) << "the cache uses E5M6's 6-bit mantissa";
}

// Promotion every N_c = 128: the FP8 GEMMs' partial sums go to FP32 every 128 elements of K, so
// every FP8 GEMM of a training step is within FP32 rounding of the FP64 product of its quantized
// operands. Measured (tiny config, 2 seeds): worst 1.40e-7 and 1.42e-7 with promotion, 1.46e-3
// and 1.50e-3 with the Tensor Cores' 14-bit accumulation never promoted (fp8-no-promotion); bound
// 3.3e-7 (2.3x the worst).
// Catches: the fp8 recipe's AccumConfig without promotion (promote_every = 0), or with fewer kept
// bits inside a group than FP32 (AccumMode::tensor_core with 14 bits per 128).
// Seen failing: with fp8's accum set as fp8-no-promotion's (worst 1.2e-3), and with
// AccumConfig{tensor_core, 14, 128} (worst 9.5e-4: at the tiny config's K of 128 to 1024 the
// 14-bit truncation inside a group dominates).
TEST(RecipeGuards, FP8GemmsPromotedEvery128) {
  constexpr double kBound = 3.3e-7;
  for (const std::string recipe : {"fp8", "fp8-no-promotion"}) {
    const SpyRun r = spy_step(recipe, /*check_gemms=*/true);
    double worst = 0;
    int64_t n = 0;
    for (const auto& g : r.be->gemms) {
      if (g.op != "gemm_fp8") continue;
      worst = std::max(worst, g.rel_error);
      ++n;
    }
    std::cout << "[ guard    ] " << recipe << ": " << n << " FP8 GEMMs, worst error vs the FP64 product " << worst << "\n";
    EXPECT_GT(n, 20);
    if (recipe == "fp8") {
      EXPECT_LT(worst, kBound);
      for (const auto& g : r.be->gemms) EXPECT_EQ(g.accum.mode, AccumMode::fp32) << g.op;
    } else {
      EXPECT_GT(worst, 100 * kBound) << "the ablation's signature: the guard above tells the two apart";
    }
  }
}

// AdamW's first and second moments in BF16 (the master weights and gradients stay FP32): two
// bytes per parameter each, by default in the optimizer and in `fp8moe train`.
// Catches: the defaults changed to FP32 moments (AdamWConfig::moments, TrainOptions::moments).
// Seen failing: with AdamWConfig::moments = MomentPrecision::f32 (moments f32: 8 bytes per parameter).
TEST(RecipeGuards, AdamWMomentsInBf16) {
  EXPECT_EQ(TrainOptions{}.moments, "bf16");
  auto be = make_backend("cpu");
  Model model(tiny_config(), Recipe::from_name("fp8"), *be, 1);
  std::vector<ParamRef> refs;
  int64_t n = 0;
  for (auto& p : model.parameters())
    if (p.trainable) refs.push_back({p.name, p.weight, p.grad, p.decay}), n += p.weight.numel();
  AdamW opt(*be, refs, AdamWConfig{});
  int64_t bytes = 0;
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_EQ(opt.first_moments()[i].dtype(), DType::bf16);
    EXPECT_EQ(opt.second_moments()[i].dtype(), DType::bf16);
    bytes += int64_t(opt.first_moments()[i].view().nbytes() + opt.second_moments()[i].view().nbytes());
  }
  EXPECT_EQ(bytes, 4 * n);
  for (auto& p : model.parameters()) EXPECT_EQ(p.weight.dtype(), DType::f32) << p.name;
}

}  // namespace
}  // namespace fp8moe::testing
