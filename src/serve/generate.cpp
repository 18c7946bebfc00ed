// Single-prompt generation (generate.hpp).
#include "serve/generate.hpp"

#include <chrono>

#include "fp8moe/error.hpp"

namespace fp8moe::serve {

std::vector<int32_t> encode_text(std::string_view text) {
  std::vector<int32_t> t;
  for (unsigned char c : text) t.push_back(int32_t(c));
  return t;
}

std::string decode_token(int32_t token) {
  return token >= 0 && token < 256 ? std::string(1, char(token)) : std::string();
}

size_t emittable(std::string_view text, const std::vector<std::string>& stop, bool* stopped) {
  *stopped = false;
  size_t cut = text.size();
  for (const std::string& s : stop) {
    if (s.empty()) continue;
    const size_t at = text.find(s);
    if (at != std::string_view::npos && at < cut) {
      cut = at;
      *stopped = true;
    }
  }
  if (*stopped) return cut;
  for (const std::string& s : stop)  // a suffix that may grow into s
    for (size_t n = std::min(s.size() - 1, text.size()); n > 0; --n)
      if (text.substr(text.size() - n) == std::string_view(s).substr(0, n)) {
        cut = std::min(cut, text.size() - n);
        break;
      }
  return cut;
}

GenerateResult generate(Engine& engine, std::string_view prompt, const GenerateOptions& opt,
                        const std::function<void(std::string_view)>& on_text) {
  using clock = std::chrono::steady_clock;
  const std::vector<int32_t> p = encode_text(prompt);
  const ModelConfig& cfg = engine.config();
  FP8MOE_CHECK(!p.empty(), "prompt: empty (expected at least one byte of text)");
  FP8MOE_CHECK(opt.max_tokens >= 1, "max_tokens must be >= 1, got " << opt.max_tokens);
  FP8MOE_CHECK(opt.prefill_chunk >= 1, "prefill_chunk must be >= 1, got " << opt.prefill_chunk);
  const int64_t total = int64_t(p.size()) + opt.max_tokens;
  FP8MOE_CHECK(total <= cfg.max_position_embeddings,
               "prompt (" << p.size() << " tokens) + max_tokens (" << opt.max_tokens << ") = " << total
                          << " exceeds the context of " << cfg.max_position_embeddings << " tokens");
  BlockAllocator alloc(engine.cache().blocks());
  std::vector<int32_t> table;
  FP8MOE_CHECK(alloc.allocate(blocks_for(total), table),
               "prompt + max_tokens = " << total << " tokens need " << blocks_for(total) << " cache blocks, the cache has "
                                        << engine.cache().blocks());
  Sampler sampler(opt.sampling);
  GenerateResult r;
  const auto t0 = clock::now();
  Tensor logits;
  const int64_t P = int64_t(p.size());
  for (int64_t s = 0; s < P; s += opt.prefill_chunk)
    logits = engine.step({{&table, s, std::vector<int32_t>(p.begin() + s, p.begin() + std::min(P, s + opt.prefill_chunk))}});
  const auto t1 = clock::now();
  r.prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const int64_t V = cfg.vocab_size;
  std::string pending;  // made, not yet emitted (may begin a stop string)
  r.finish_reason = "length";
  for (int64_t i = 0; i < opt.max_tokens; ++i) {
    const int32_t tok = sampler.sample(logits.ptr<float>(), V);
    r.tokens.push_back(tok);
    if (tok == opt.eos) {
      r.finish_reason = "stop";
      break;
    }
    pending += decode_token(tok);
    bool stopped = false;
    const size_t n = emittable(pending, opt.stop, &stopped);
    if (n > 0) {
      r.text += pending.substr(0, n);
      if (on_text) on_text(std::string_view(pending).substr(0, n));
      pending.erase(0, n);
    }
    if (stopped) {
      r.finish_reason = "stop";
      pending.clear();
      break;
    }
    if (i + 1 < opt.max_tokens) logits = engine.step({{&table, P + i, {tok}}});
  }
  if (!pending.empty()) {
    r.text += pending;
    if (on_text) on_text(pending);
  }
  r.decode_s = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

}  // namespace fp8moe::serve
