// The inference engine against the training model: greedy decoding over the paged latent cache
// equals recomputing Model::forward over the whole text for every token; the absorbed decode
// equals the expanded form to FP32 rounding; the cache across block boundaries and chunk splits;
// BF16 and FP8 caches within measured bounds; weights from a checkpoint and exported folders.
// Run: ctest --test-dir build -R test_serve   (FP8MOE_SERVE_BACKEND=cuda runs them on the GPU)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <set>

#include "fp8moe/export.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/safetensors.hpp"
#include "serve/engine.hpp"
#include "serve/sampler.hpp"
#include "serve/weights.hpp"
#include "serve_testing.hpp"
#include "testing.hpp"

namespace fp8moe::serve {
namespace {

using testing_env::backend_name;

// configs/tiny.json with wider initial weights: peaked logits, so that greedy choices are not
// near-ties that rounding could flip.
ModelConfig test_config() {
  ModelConfig c = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  c.initializer_range = 0.1;
  return c;
}

std::vector<int32_t> prompt_tokens(int64_t n, int seed = 1) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(int32_t((i * 37 + seed * 11) % 200 + 32));
  return p;
}

int32_t argmax(const float* x, int64_t n) { return int32_t(std::max_element(x, x + n) - x); }

// Greedy continuation by Model::forward over the whole text for every new token.
std::vector<int32_t> greedy_full_forward(Model& m, std::vector<int32_t> text, int64_t new_tokens,
                                         std::vector<std::vector<float>>* logits = nullptr) {
  std::vector<int32_t> out;
  const int64_t V = m.config().vocab_size;
  for (int64_t i = 0; i < new_tokens; ++i) {
    const int64_t S = int64_t(text.size());
    Tensor tok = Tensor::host(DType::i32, {1, S}), tg = Tensor::host(DType::i32, {1, S});
    std::copy(text.begin(), text.end(), tok.ptr<int32_t>());
    std::fill(tg.ptr<int32_t>(), tg.ptr<int32_t>() + S, -1);
    m.forward(tok.view(), tg.view());
    const Tensor l = m.backend().to_host(m.last_logits());
    const float* row = l.ptr<float>() + (S - 1) * V;
    if (logits) logits->emplace_back(row, row + V);
    out.push_back(argmax(row, V));
    text.push_back(out.back());
  }
  return out;
}

// Greedy continuation through the engine: the prompt prefilled in chunks of `chunk` tokens (0:
// whole), then one decode step per token; blocks allocated as the text grows.
std::vector<int32_t> greedy_engine(Engine& e, BlockAllocator& alloc, const std::vector<int32_t>& prompt,
                                   int64_t new_tokens, int64_t chunk = 0,
                                   std::vector<std::vector<float>>* logits = nullptr,
                                   const std::vector<int32_t>* forced = nullptr) {
  const int64_t V = e.config().vocab_size;
  std::vector<int32_t> table, out;
  int64_t pos = 0;
  const auto run = [&](std::vector<int32_t> toks) {
    const int64_t need = blocks_for(pos + int64_t(toks.size())) - int64_t(table.size());
    EXPECT_TRUE(alloc.allocate(need, table));
    const int64_t n = int64_t(toks.size());
    const Tensor l = e.step({{&table, pos, std::move(toks)}});
    pos += n;
    return std::vector<float>(l.ptr<float>(), l.ptr<float>() + V);
  };
  std::vector<float> last;
  const int64_t P = int64_t(prompt.size()), c = chunk > 0 ? chunk : P;
  for (int64_t s = 0; s < P; s += c)
    last = run(std::vector<int32_t>(prompt.begin() + s, prompt.begin() + std::min(P, s + c)));
  for (int64_t i = 0; i < new_tokens; ++i) {
    if (logits) logits->push_back(last);
    out.push_back(argmax(last.data(), V));
    if (i + 1 < new_tokens) last = run({forced ? (*forced)[size_t(i)] : out.back()});
  }
  alloc.release(table);
  return out;
}

double max_abs_diff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    for (size_t j = 0; j < a[i].size(); ++j) m = std::max(m, std::abs(double(a[i][j]) - double(b[i][j])));
  return m;
}
double max_abs(const std::vector<std::vector<float>>& a) {
  double m = 0;
  for (const auto& r : a)
    for (float v : r) m = std::max(m, std::abs(double(v)));
  return m;
}

struct Fixture {
  std::unique_ptr<Backend> be = make_backend(backend_name());
  std::unique_ptr<Model> model;
  explicit Fixture(const std::string& recipe, ModelConfig cfg = test_config()) {
    model = std::make_unique<Model>(cfg, Recipe::from_name(recipe), *be, 42);
  }
  std::unique_ptr<Engine> engine(EngineOptions o = {}) { return std::make_unique<Engine>(weights_of(*model), *be, o); }
};

EngineOptions exact_cache() {
  EngineOptions o;
  o.cache = CacheDType::f32;
  o.cache_blocks = 8;
  return o;
}

// 10 prompt tokens and 90 new ones: the text crosses the 64-token block boundary.
TEST(ServeEngine, PagedGreedyEqualsFullForwardFp32) {
  Fixture f("fp32");
  auto e = f.engine(exact_cache());
  BlockAllocator alloc(8);
  const auto prompt = prompt_tokens(10);
  std::vector<std::vector<float>> ref_l, eng_l;
  const auto ref = greedy_full_forward(*f.model, prompt, 90, &ref_l);
  const auto got = greedy_engine(*e, alloc, prompt, 90, 0, &eng_l);
  EXPECT_EQ(got, ref);
  const double d = max_abs_diff(ref_l, eng_l);
  std::cout << "fp32: max |logit diff| " << d << " of max |logit| " << max_abs(ref_l) << "\n";
  EXPECT_LT(d, 1e-4 * max_abs(ref_l));
}

// The FP8 recipe: the engine's Linears through gemm_fp8 (M = 1 in decode) and the routed experts
// through the masked grouped GEMM; the training forward runs the contiguous grouped GEMM and
// rounds the attention-out input through its E5M6 cache first, so logits agree to FP8 rounding.
TEST(ServeEngine, PagedGreedyEqualsFullForwardFp8) {
  Fixture f("fp8");
  // NOTES: the FP8 cache holds the latent as the training forward's kv_b_proj input tiles (1x128
  // E4M3), so the absorbed decode over it sees the values the FP8 recipe's expanded form sees.
  EngineOptions o = exact_cache();
  o.cache = CacheDType::fp8;
  auto e = f.engine(o);
  ASSERT_EQ(e->linear_precision(), LinearPrecision::fp8);
  BlockAllocator alloc(8);
  const auto prompt = prompt_tokens(58, 2);  // the CPU's FP8 GEMMs are slow: few full forwards
  std::vector<std::vector<float>> ref_l, eng_l;
  const auto ref = greedy_full_forward(*f.model, prompt, 12, &ref_l);
  const auto got = greedy_engine(*e, alloc, prompt, 12, 0, &eng_l);
  // NOTES: the two forms differ by FP8 rounding (the cache's BF16 RoPE key, the FP32 absorption of
  // the dequantized W_UK/W_UV against the FP8 GEMMs of the expanded form): a step whose best two
  // reference logits are closer than that bound may pick either token, and the texts part there.
  // Up to the first such step the tokens must agree and the logits stay within the bound.
  const double bound = 0.1 * max_abs(ref_l);
  const size_t n = std::min(ref.size(), ref_l.size());
  size_t agree = 0;  // steps before the first near tie
  for (; agree < n; ++agree) {
    std::vector<float> l = ref_l[agree];
    std::partial_sort(l.begin(), l.begin() + 2, l.end(), std::greater<float>());
    if (l[0] - l[1] < 2 * bound) break;
  }
  EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + agree), std::vector<int32_t>(ref.begin(), ref.begin() + agree));
  // The logits of the near-tie step still follow the same text.
  const size_t k = std::min(agree + 1, n);
  const std::vector<std::vector<float>> ref_k(ref_l.begin(), ref_l.begin() + k), eng_k(eng_l.begin(), eng_l.begin() + k);
  const double d = max_abs_diff(ref_k, eng_k);
  std::cout << "fp8: " << agree << " steps before the first near tie; max |logit diff| " << d << " of max |logit| "
            << max_abs(ref_l) << "\n";
  EXPECT_LT(d, bound);
}

// Absorbed decode against the expanded (prefill) form over the same cache, on the same forced
// text: the two differ only in the order of FP32 sums.
TEST(ServeEngine, AbsorbedDecodeEqualsExpandedForm) {
  Fixture f("fp32");
  EngineOptions a = exact_cache(), x = exact_cache();
  x.absorbed_decode = false;
  auto ea = f.engine(a), ex = f.engine(x);
  BlockAllocator alloc(8);
  const auto prompt = prompt_tokens(5, 3);
  const auto forced = prompt_tokens(100, 4);
  std::vector<std::vector<float>> la, lx;
  greedy_engine(*ea, alloc, prompt, 100, 0, &la, &forced);
  greedy_engine(*ex, alloc, prompt, 100, 0, &lx, &forced);
  const double d = max_abs_diff(la, lx), m = max_abs(la);
  std::cout << "absorbed vs expanded: max |logit diff| " << d << " of max |logit| " << m << "\n";
  // NOTES: measured 1e-6 relative on the CPU; FP32 reassociation over ~100 keys allows ~1e-5.
  EXPECT_LT(d, 1e-5 * m);
  EXPECT_GT(d, 0.0) << "the two forms ran the same code";
}

// Chunked prefill (chunks of 37, straddling blocks) into a fragmented pool (another sequence's
// blocks in between) gives the logits of one whole prefill into fresh blocks.
TEST(ServeEngine, PagedCacheAcrossBlocksAndChunks) {
  Fixture f("fp32");
  auto e = f.engine(exact_cache());
  BlockAllocator alloc(8);
  const auto prompt = prompt_tokens(150, 5);
  std::vector<std::vector<float>> whole, chunked;
  greedy_engine(*e, alloc, prompt, 20, 0, &whole);
  std::vector<int32_t> other;
  ASSERT_TRUE(alloc.allocate(1, other));  // block 0 taken: the sequence gets blocks 1, 2, ...
  std::vector<int32_t> gap;
  ASSERT_TRUE(alloc.allocate(1, gap));
  std::vector<int32_t> other2;
  ASSERT_TRUE(alloc.allocate(1, other2));
  alloc.release(gap);  // block 1 free, 2 taken: the table is {1, 3, 4, 5}
  greedy_engine(*e, alloc, prompt, 20, 37, &chunked);
  const double d = max_abs_diff(whole, chunked);
  std::cout << "chunked + fragmented vs whole: max |logit diff| " << d << "\n";
  EXPECT_LT(d, 1e-5 * max_abs(whole));
}

// BF16 and FP8 caches against the exact one on a forced text of 120 tokens.
TEST(ServeEngine, Bf16AndFp8CacheErrorBounded) {
  ModelConfig cfg = test_config();
  cfg.initializer_range = 0.02;  // the training init: errors at their scale, not a chaotic model's
  Fixture f("fp32", cfg);
  const auto prompt = prompt_tokens(8, 6);
  const auto forced = prompt_tokens(120, 7);
  std::vector<std::vector<float>> exact, b16, f8;
  BlockAllocator alloc(8);
  EngineOptions o = exact_cache();
  greedy_engine(*f.engine(o), alloc, prompt, 120, 0, &exact, &forced);
  o.cache = CacheDType::bf16;
  greedy_engine(*f.engine(o), alloc, prompt, 120, 0, &b16, &forced);
  o.cache = CacheDType::fp8;
  auto e8 = f.engine(o);
  EXPECT_LT(e8->cache().bytes_per_token(), f.engine(exact_cache())->cache().bytes_per_token() / 2);
  greedy_engine(*e8, alloc, prompt, 120, 0, &f8, &forced);
  const double m = max_abs(exact), db = max_abs_diff(exact, b16), d8 = max_abs_diff(exact, f8);
  std::cout << "cache error (max |logit diff| / max |logit|): bf16 " << db / m << ", fp8 " << d8 / m << "\n";
  EXPECT_GT(db, 0.0);
  EXPECT_GT(d8, db) << "E4M3 keeps fewer bits than BF16";
  // NOTES: measured 1.1e-3 (bf16) and 9.7e-2 (fp8) of the largest logit over 120 tokens.
  EXPECT_LT(db / m, 5e-3);
  EXPECT_LT(d8 / m, 0.15);
}

// The shared expert as a ninth routed expert (weight 1, every token) computes the same layer.
TEST(ServeEngine, SharedExpertAsRoutedExpert) {
  for (const char* recipe : {"fp32", "fp8"}) {
    Fixture f(recipe);
    EngineOptions a = exact_cache(), b = exact_cache();
    b.shared_as_routed = true;
    BlockAllocator alloc(8);
    const auto prompt = prompt_tokens(20, 8);
    std::vector<std::vector<float>> la, lb;
    const auto ta = greedy_engine(*f.engine(a), alloc, prompt, 30, 0, &la);
    const auto tb = greedy_engine(*f.engine(b), alloc, prompt, 30, 0, &lb);
    EXPECT_EQ(ta, tb) << recipe;
    // NOTES: measured 2e-6 (fp32: the order of one sum) and, on the CPU backend, 1.2e-4 (fp8: that
    // rounding moves the next layer's E4M3 tiles) of the largest logit. On the GPU the decode rows
    // of the shared expert run on the few-rows GEMM (mma.sync) and the routed form on the grouped
    // WGMMA kernel, whose Tensor Core sums round apart: 2.5e-3 measured over 30 steps.
    const double tol = std::string(recipe) == "fp32" ? 1e-5 : 5e-3;
    std::cout << recipe << " shared as routed: max |logit diff| " << max_abs_diff(la, lb) << "\n";
    EXPECT_LT(max_abs_diff(la, lb), tol * max_abs(la)) << recipe;
  }
}

// A decode step of the FP8 engine reads the device back once, for its logits: the MoE layers'
// expert layouts are built on the device (a read of the routing per MoE layer otherwise), and
// the tokens they route still reach the expert loads and the virtual GPUs' counts when asked.
// The step defers the device checks and restores the caller's mode.
TEST(ServeEngine, DecodeStepReadsBackOnlyTheLogits) {
  for (const bool shared_as_routed : {false, true}) {
    Fixture f("fp8");
    EngineOptions o = exact_cache();
    o.shared_as_routed = shared_as_routed;
    o.expert_gpus = 2;
    auto e = f.engine(o);
    BlockAllocator alloc(8);
    std::vector<std::vector<int32_t>> tables(3);
    std::vector<int64_t> pos(3, 0);
    int64_t tokens = 0;
    for (size_t s = 0; s < tables.size(); ++s) {
      const auto p = prompt_tokens(int64_t(5 + 7 * s), int(s) + 1);
      ASSERT_TRUE(alloc.allocate(blocks_for(40), tables[s]));
      e->step({{&tables[s], 0, p}});
      pos[s] = int64_t(p.size());
      tokens += pos[s];
    }
    for (int i = 0; i < 4; ++i) {
      std::vector<SeqChunk> chunks;
      for (size_t s = 0; s < tables.size(); ++s) chunks.push_back({&tables[s], pos[s]++, {int32_t(40 + i + int(s))}});
      const int64_t before = f.be->host_reads();
      const Tensor l = e->step(chunks);
      EXPECT_EQ(f.be->host_reads() - before, 1) << "shared_as_routed " << shared_as_routed << ", step " << i;
      EXPECT_EQ(f.be->checks(), Backend::Checks::immediate) << "the step's deferred checks outlived it";
      ASSERT_EQ(l.size(0), 3);
      tokens += 3;
    }
    const int64_t k = f.model->config().num_experts_per_tok;
    for (size_t ml = 0; ml < e->expert_loads().size(); ++ml) {
      double routed = 0;
      for (double v : e->expert_loads()[ml]) routed += v;
      int64_t on_gpus = 0;
      for (int64_t v : e->gpu_tokens()[ml]) on_gpus += v;
      EXPECT_EQ(routed, double(tokens * k)) << "MoE layer " << ml;
      EXPECT_EQ(on_gpus, tokens * k) << "MoE layer " << ml;
    }
  }
}

// Decode steps as graphs (EngineOptions::graphs) against the same engine eagerly: the same logits
// bit for bit over decode steps that cross a block boundary (the tables widen: a new recording)
// and drop a sequence (a new batch), in both cache formats, and most steps are replays.
TEST(ServeEngine, DecodeGraphsAreTheEagerStepsBitForBit) {
  Fixture f("fp8");
  if (!f.be->can_capture()) GTEST_SKIP() << "backend " << f.be->name() << " does not capture graphs";
  for (const CacheDType cache : {CacheDType::bf16, CacheDType::fp8}) {
    EngineOptions o;
    o.cache = cache;
    o.cache_blocks = 12;
    EngineOptions eager_o = o;
    eager_o.graphs = false;
    auto graphs = f.engine(o), eager = f.engine(eager_o);
    std::vector<std::vector<int32_t>> tables(3);
    for (size_t s = 0; s < tables.size(); ++s)
      for (int32_t b = 0; b < 4; ++b) tables[s].push_back(int32_t(s) * 4 + b);
    std::vector<int64_t> pos(3, 0);
    const auto both = [&](const std::vector<SeqChunk>& chunks, const std::string& what) {
      const Tensor a = graphs->step(chunks), b = eager->step(chunks);
      EXPECT_TRUE(a.numel() == b.numel() && std::memcmp(a.ptr<float>(), b.ptr<float>(), size_t(a.numel()) * 4) == 0)
          << what;
      return a;
    };
    for (size_t s = 0; s < tables.size(); ++s) {
      const auto p = prompt_tokens(int64_t(50 + 3 * s), int(s) + 1);
      both({{&tables[s], 0, p}}, "prefill " + std::to_string(s));
      pos[s] = int64_t(p.size());
    }
    std::vector<int32_t> next(3, 7);
    for (int i = 0; i < 24; ++i) {
      const size_t live = i < 16 ? 3 : 2;  // the last sequence ends after 16 steps
      std::vector<SeqChunk> chunks;
      for (size_t s = 0; s < live; ++s) chunks.push_back({&tables[s], pos[s]++, {next[s]}});
      const Tensor l = both(chunks, std::string(cache_dtype_name(cache)) + " decode step " + std::to_string(i));
      const int64_t V = f.model->config().vocab_size;
      for (size_t s = 0; s < live; ++s) next[s] = argmax(l.ptr<float>() + s * V, V);
    }
    EXPECT_TRUE(graphs->graph_note().empty()) << graphs->graph_note();
    EXPECT_GE(graphs->graph_replays(), 16) << cache_dtype_name(cache);
    EXPECT_EQ(eager->graph_replays(), 0);
  }
}

// A checkpoint as the trainer writes it, and its exports: FP8 export = the FP8 engine on the
// checkpoint bit for bit (the exported E4M3 blocks are what it quantizes at load); BF16 export
// close to the FP32 weights.
TEST(ServeEngine, LoadsCheckpointAndExportedFolders) {
  ModelConfig cfg = test_config();
  cfg.initializer_range = 0.02;
  Fixture f("fp8", cfg);
  const auto dir = testing::test_dir("serve_load");
  const std::string ckpt = (dir / "checkpoint.safetensors").string();
  std::map<std::string, TensorView> tensors;
  std::vector<Tensor> keep;
  for (Parameter& p : f.model->parameters()) {
    keep.push_back(f.be->to_host(p.weight));
    tensors.emplace(p.name, keep.back().view());
  }
  save_safetensors(ckpt, tensors,
                   {{"format", "fp8moe-checkpoint-1"}, {"recipe", "fp8"}, {"model_config", config_to_json(f.model->config())}});
  export_checkpoint(ckpt, (dir / "hf_fp8").string(), "fp8", false);
  export_checkpoint(ckpt, (dir / "hf_bf16").string(), "bf16", false);
  const WeightSet wc = load_checkpoint_weights(ckpt), w8 = load_hf_weights((dir / "hf_fp8").string()),
                  wb = load_hf_weights((dir / "hf_bf16").string());
  EXPECT_EQ(wc.recipe, "fp8");
  EXPECT_EQ(w8.format, "fp8");
  EXPECT_EQ(wb.format, "bf16");
  const auto prompt = prompt_tokens(12, 9);
  std::vector<std::vector<float>> lc, l8, lb;
  BlockAllocator alloc(8);
  const auto tc = greedy_engine(*std::make_unique<Engine>(wc, *f.be, exact_cache()), alloc, prompt, 20, 0, &lc);
  // The others follow the checkpoint's text: logits compared on the same tokens.
  const auto t8 = greedy_engine(*std::make_unique<Engine>(w8, *f.be, exact_cache()), alloc, prompt, 20, 0, &l8, &tc);
  auto eb = std::make_unique<Engine>(wb, *f.be, exact_cache());
  EXPECT_EQ(eb->linear_precision(), LinearPrecision::bf16);
  greedy_engine(*eb, alloc, prompt, 20, 0, &lb, &tc);
  // The export's E4M3 blocks are what the engine quantizes at load: the folder with its FP8
  // weights swapped for the checkpoint's FP32 ones serves the same logits bit for bit.
  WeightSet mix = w8;
  for (auto it = mix.tensors.begin(); it != mix.tensors.end();) {
    if (it->first.ends_with("_scale_inv")) {
      it = mix.tensors.erase(it);
      continue;
    }
    if (it->second.dtype() == DType::e4m3) it->second = wc.tensors.at(it->first);
    ++it;
  }
  std::vector<std::vector<float>> lm;
  greedy_engine(*std::make_unique<Engine>(mix, *f.be, exact_cache()), alloc, prompt, 20, 0, &lm, &tc);
  EXPECT_EQ(max_abs_diff(l8, lm), 0.0);
  // The FP8 folder differs from the checkpoint by its BF16 embedding, norms and head.
  std::cout << "fp8 export vs fp8 checkpoint: max |logit diff| " << max_abs_diff(lc, l8) << " of " << max_abs(lc)
            << "\n";
  // NOTES: measured 0.11 (fp8 folder) and 0.08 (bf16 folder) of the largest logit, which is
  // small (0.78: the training init's near-uniform logits).
  EXPECT_LT(max_abs_diff(lc, l8), 0.2 * max_abs(lc));
  std::cout << "bf16 export vs fp8 checkpoint: max |logit diff| " << max_abs_diff(lc, lb) << " of " << max_abs(lc) << "\n";
  EXPECT_LT(max_abs_diff(lc, lb), 0.2 * max_abs(lc));
  testing::expect_error([&] { load_hf_weights((dir / "missing").string()); }, "no config.json");
  testing::expect_error([&] { load_checkpoint_weights((dir / "hf_bf16" / "model.safetensors").string()); },
                        "expected fp8moe-checkpoint-1");
}

// The benchmark's random weights: every parameter of the list at its shape, N(0, initializer_range)
// where the model draws normals (mean and deviation within 3% over ~10^5 values), ones and zeros
// where it sets them, the same values for the same seed; an engine loads them.
TEST(ServeEngine, RandomWeightsFollowTheParameterList) {
  const ModelConfig cfg = load_config(std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json");
  const WeightSet a = random_weights(cfg, 5), b = random_weights(cfg, 5), c = random_weights(cfg, 6);
  double sum = 0, sq = 0;
  int64_t n = 0;
  for (const model::ParamSpec& s : model::parameter_specs(cfg)) {
    ASSERT_TRUE(a.tensors.count(s.name)) << s.name;
    const Tensor& t = a.tensors.at(s.name);
    ASSERT_EQ(t.view().ndim, int(s.shape.size())) << s.name;
    for (size_t d = 0; d < s.shape.size(); ++d) ASSERT_EQ(t.size(int(d)), s.shape[d]) << s.name;
    const float* v = t.ptr<float>();
    EXPECT_EQ(std::vector<float>(v, v + t.numel()),
              std::vector<float>(b.tensors.at(s.name).ptr<float>(), b.tensors.at(s.name).ptr<float>() + t.numel()));
    if (s.init == model::ParamSpec::normal) {
      EXPECT_NE(v[0], c.tensors.at(s.name).ptr<float>()[0]) << s.name << ": another seed, other values";
      for (int64_t j = 0; j < t.numel(); ++j, ++n) {
        sum += v[j];
        sq += double(v[j]) * v[j];
      }
    } else {
      const float want = s.init == model::ParamSpec::ones ? 1.0f : 0.0f;
      EXPECT_EQ(*std::min_element(v, v + t.numel()), want) << s.name;
      EXPECT_EQ(*std::max_element(v, v + t.numel()), want) << s.name;
    }
  }
  ASSERT_GT(n, 100000);
  const double mean = sum / double(n), sd = std::sqrt(sq / double(n) - mean * mean);
  EXPECT_LT(std::abs(mean), 0.03 * cfg.initializer_range);
  EXPECT_NEAR(sd, cfg.initializer_range, 0.03 * cfg.initializer_range);
  auto be = make_backend("cpu");
  EngineOptions eo;
  eo.cache_blocks = 4;
  Engine engine(a, *be, eo);
  EXPECT_EQ(engine.cache().bytes_per_token() > 0, true);
}

TEST(ServeSampler, SeedRepeatsAndGreedyLimits) {
  std::vector<float> logits(300);
  std::mt19937_64 rng(3);
  for (float& v : logits) v = float(std::normal_distribution<double>(0, 2)(rng));
  const int32_t best = argmax(logits.data(), 300);
  EXPECT_EQ(Sampler({}).sample(logits.data(), 300), best);
  SamplingParams p{.temperature = 1.0, .top_k = 1, .top_p = 1, .seed = 5};
  EXPECT_EQ(Sampler(p).sample(logits.data(), 300), best);
  p = {.temperature = 1.0, .top_k = 0, .top_p = 1e-6, .seed = 5};
  EXPECT_EQ(Sampler(p).sample(logits.data(), 300), best);
  p = {.temperature = 1.5, .top_k = 50, .top_p = 0.9, .seed = 11};
  Sampler a(p), b(p);
  std::vector<int32_t> da, db;
  std::set<int32_t> distinct;
  for (int i = 0; i < 200; ++i) {
    da.push_back(a.sample(logits.data(), 300));
    db.push_back(b.sample(logits.data(), 300));
    distinct.insert(da.back());
  }
  EXPECT_EQ(da, db);
  EXPECT_GT(distinct.size(), 5u);
  std::vector<int32_t> sorted_ids(300);
  std::iota(sorted_ids.begin(), sorted_ids.end(), 0);
  std::sort(sorted_ids.begin(), sorted_ids.end(), [&](int32_t x, int32_t y) { return logits[x] > logits[y]; });
  for (int32_t t : distinct)
    EXPECT_LT(std::find(sorted_ids.begin(), sorted_ids.end(), t) - sorted_ids.begin(), 50) << "outside top-k";
  testing::expect_error([] { Sampler({.temperature = -1}); }, "temperature");
  testing::expect_error([] { Sampler({.top_k = -2}); }, "top_k");
  testing::expect_error([] { Sampler({.top_p = 0}); }, "top_p");
}

}  // namespace
}  // namespace fp8moe::serve
namespace fp8moe::serve {
// Rows written at scattered slots read back in table order; the error of each cache dtype.
TEST(ServeLatentCache, RoundTripThroughBlocks) {
  auto be = make_backend(backend_name());
  for (auto dt : {CacheDType::f32, CacheDType::bf16, CacheDType::fp8}) {
    LatentCache c(*be, 1, 4, 128, 32, dt);
    auto rng = testing::make_rng();
    Tensor x = testing::random_normal(rng, DType::f32, {100, 160});
    std::vector<int64_t> slots;
    std::vector<int32_t> table{2, 0};
    for (int64_t p = 0; p < 100; ++p) slots.push_back(table[p / 64] * 64 + p % 64);
    Tensor xd = be->empty(DType::f32, {100, 160});
    be->copy(xd.view(), x.view());
    c.write(0, xd.view(), slots);
    const Tensor r = be->to_host(c.read(0, table, 100));
    double m = 0;
    for (int64_t i = 0; i < 100 * 160; ++i) m = std::max(m, double(std::abs(r.ptr<float>()[i] - x.ptr<float>()[i])));
    std::cout << cache_dtype_name(dt) << " cache: max |error| " << m << " on N(0, 1) rows\n";
    // NOTES: bf16 keeps 8 bits (2^-8 * |x| <= 0.016 for |x| < 4); E4M3 3 bits (2^-4 * amax of its tile).
    EXPECT_LE(m, dt == CacheDType::f32 ? 0.0 : dt == CacheDType::bf16 ? 0.016 : 0.3);
    if (dt != CacheDType::f32) {
      EXPECT_GT(m, 0.0);
    }
  }
  BlockAllocator a(3);
  std::vector<int32_t> t1, t2;
  EXPECT_TRUE(a.allocate(2, t1));
  EXPECT_FALSE(a.allocate(2, t2));
  EXPECT_TRUE(t2.empty());
  EXPECT_EQ(a.used_blocks(), 2);
  a.release(t1);
  EXPECT_EQ(a.free_blocks(), 3);
  EXPECT_TRUE(a.allocate(3, t2));
  EXPECT_EQ(t2, (std::vector<int32_t>{0, 1, 2}));
}
}  // namespace fp8moe::serve
