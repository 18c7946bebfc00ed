// Single-prompt generation (generate.hpp).
#include "serve/generate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

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

namespace {

using Clock = std::chrono::steady_clock;

float log_prob(const float* x, int64_t V, int32_t tok) {
  const float m = *std::max_element(x, x + V);
  double s = 0;
  for (int64_t i = 0; i < V; ++i) s += std::exp(double(x[i]) - m);
  return float(double(x[tok]) - m - std::log(s));
}

// The text of the tokens as they come: stop strings withheld until they can no longer match.
struct Emitter {
  const GenerateOptions& opt;
  const std::function<void(std::string_view)>& on_text;
  GenerateResult& r;
  std::string pending;
  // Appends token `tok`, chosen from `logits` [V]; true when the text is complete (EOS, a stop
  // string, max_tokens).
  bool push(int32_t tok, const float* logits, int64_t V) {
    r.tokens.push_back(tok);
    r.logprobs.push_back(log_prob(logits, V, tok));
    if (tok == opt.eos) {
      r.finish_reason = "stop";
      return true;
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
      return true;
    }
    return int64_t(r.tokens.size()) >= opt.max_tokens;
  }
  void flush() {
    if (pending.empty()) return;
    r.text += pending;
    if (on_text) on_text(pending);
    pending.clear();
  }
};

// The prompt's tokens and a block table for `positions` positions, after the checks.
std::vector<int32_t> prepare(Engine& engine, std::string_view prompt, const GenerateOptions& opt, int64_t positions,
                             BlockAllocator& alloc, std::vector<int32_t>& table) {
  std::vector<int32_t> p = encode_text(prompt);
  const ModelConfig& cfg = engine.config();
  FP8MOE_CHECK(!p.empty(), "prompt: empty (expected at least one byte of text)");
  FP8MOE_CHECK(opt.max_tokens >= 1, "max_tokens must be >= 1, got " << opt.max_tokens);
  FP8MOE_CHECK(opt.prefill_chunk >= 1, "prefill_chunk must be >= 1, got " << opt.prefill_chunk);
  FP8MOE_CHECK(positions <= cfg.max_position_embeddings,
               "prompt (" << p.size() << " tokens) + max_tokens (" << opt.max_tokens << ") needs " << positions
                          << " positions, beyond the context of " << cfg.max_position_embeddings << " tokens");
  FP8MOE_CHECK(alloc.allocate(blocks_for(positions), table),
               positions << " positions need " << blocks_for(positions) << " cache blocks, the cache has "
                         << engine.cache().blocks());
  return p;
}

}  // namespace

GenerateResult generate(Engine& engine, std::string_view prompt, const GenerateOptions& opt,
                        const std::function<void(std::string_view)>& on_text) {
  BlockAllocator alloc(engine.cache().blocks());
  std::vector<int32_t> table;
  const std::vector<int32_t> p =
      prepare(engine, prompt, opt, int64_t(encode_text(prompt).size()) + opt.max_tokens, alloc, table);
  Sampler sampler(opt.sampling);
  GenerateResult r;
  r.finish_reason = "length";
  Emitter out{opt, on_text, r, {}};
  const auto t0 = Clock::now();
  Tensor logits;
  const int64_t P = int64_t(p.size()), V = engine.config().vocab_size;
  for (int64_t s = 0; s < P; s += opt.prefill_chunk)
    logits = engine.step({{&table, s, std::vector<int32_t>(p.begin() + s, p.begin() + std::min(P, s + opt.prefill_chunk))}});
  const auto t1 = Clock::now();
  r.prefill_s = std::chrono::duration<double>(t1 - t0).count();
  for (int64_t i = 0;; ++i) {
    const int32_t tok = sampler.sample(logits.ptr<float>(), V);
    ++r.main_steps;
    if (out.push(tok, logits.ptr<float>(), V)) break;
    logits = engine.step({{&table, P + i, {tok}}});
  }
  out.flush();
  r.decode_s = std::chrono::duration<double>(Clock::now() - t1).count();
  return r;
}

Tensor prompt_logits(Engine& engine, std::string_view prompt) {
  BlockAllocator alloc(engine.cache().blocks());
  std::vector<int32_t> table;
  GenerateOptions o;
  o.max_tokens = 1;
  std::vector<int32_t> p = prepare(engine, prompt, o, int64_t(encode_text(prompt).size()), alloc, table);
  const int64_t P = int64_t(p.size());
  return engine.step({{&table, 0, std::move(p), P}});
}

GenerateResult generate_speculative(Engine& engine, std::string_view prompt, const GenerateOptions& opt,
                                    const std::function<void(std::string_view)>& on_text) {
  FP8MOE_CHECK(engine.options().mtp, "speculative decoding needs the MTP module (EngineOptions::mtp)");
  FP8MOE_CHECK(engine.options().batch_invariant,
               "speculative decoding needs EngineOptions::batch_invariant (the verified rows' logits as decoding "
               "them one by one gives)");
  Sampler sampler(opt.sampling);
  BlockAllocator alloc(engine.cache().blocks());
  std::vector<int32_t> table;
  // One position past the text: the last step may feed a draft there.
  const std::vector<int32_t> p =
      prepare(engine, prompt, opt, int64_t(encode_text(prompt).size()) + opt.max_tokens + 1, alloc, table);
  GenerateResult r;
  r.finish_reason = "length";
  Emitter out{opt, on_text, r, {}};
  const int64_t P = int64_t(p.size()), V = engine.config().vocab_size;
  const auto t0 = Clock::now();
  // Prefill: the main model chunk by chunk (keeping each chunk's trunk output), then the MTP
  // module at the same positions, fed the token after each (the last one: the first main token).
  std::vector<std::pair<int64_t, Tensor>> hidden;
  Tensor logits;
  for (int64_t s = 0; s < P; s += opt.prefill_chunk) {
    Tensor h;
    logits = engine.step({{&table, s, std::vector<int32_t>(p.begin() + s, p.begin() + std::min(P, s + opt.prefill_chunk))}}, &h);
    hidden.emplace_back(s, h);
  }
  int32_t m = sampler.sample(logits.ptr<float>(), V);
  Tensor draft;
  for (const auto& [s, h] : hidden) {
    const int64_t e = std::min(P, s + opt.prefill_chunk);
    std::vector<int32_t> next(p.begin() + s + 1, p.begin() + std::min(P, e + 1));  // tokens s+1 .. e
    if (e == P) next.push_back(m);
    draft = engine.mtp_step({{&table, s, next}}, h.view());
  }
  const auto t1 = Clock::now();
  r.prefill_s = std::chrono::duration<double>(t1 - t0).count();
  ++r.main_steps;
  int64_t pos = P;  // where m goes
  if (!out.push(m, logits.ptr<float>(), V)) {
    while (true) {
      // Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): d drawn from the draft's
      // distribution q and accepted with probability min(1, p(d) / q(d)) under the main model's p,
      // else a token drawn from normalize(max(p - q, 0)), is distributed as p. At temperature 0
      // both are one-hot: d is accepted exactly when it is the main model's argmax.
      const std::vector<double> q = sampler.distribution(draft.ptr<float>(), V);
      const int32_t d = sampler.draw(q);
      Tensor h;
      // m and d as decode rows (attending to positions <= pos and <= pos + 1): the logits plain
      // decoding computes at pos and, once d is the token there, at pos + 1.
      const Tensor lg = engine.step({{&table, pos, {m, d}, 2, true}}, &h);
      ++r.main_steps;
      ++r.drafted;
      std::vector<double> pm = sampler.distribution(lg.ptr<float>(), V);  // then its residual
      if (sampler.uniform() * q[size_t(d)] < pm[size_t(d)]) {
        ++r.accepted;
        const int32_t a1 = sampler.sample(lg.ptr<float>() + V, V);
        if (out.push(d, lg.ptr<float>(), V) || out.push(a1, lg.ptr<float>() + V, V)) break;
        draft = engine.mtp_step({{&table, pos, {d, a1}, 1, true}}, h.view());
        m = a1;
        pos += 2;
      } else {
        bool residual = false;
        for (size_t i = 0; i < pm.size(); ++i) residual |= (pm[i] = std::max(pm[i] - q[i], 0.0)) > 0;
        // p <= q everywhere leaves no mass (p = q up to rounding, where d is always accepted).
        const int32_t a0 = residual ? sampler.draw(pm) : sampler.sample(lg.ptr<float>(), V);
        // The sequence now ends at pos + 1 (a0 not yet fed): the draft's latents there lie past
        // every length read and are overwritten when a0 is fed; the MTP module never saw d.
        if (out.push(a0, lg.ptr<float>(), V)) break;
        TensorView h0 = h.view();
        h0.shape[0] = 1;
        draft = engine.mtp_step({{&table, pos, {a0}}}, h0);
        m = a0;
        pos += 1;
      }
    }
  }
  out.flush();
  r.decode_s = std::chrono::duration<double>(Clock::now() - t1).count();
  return r;
}

}  // namespace fp8moe::serve
