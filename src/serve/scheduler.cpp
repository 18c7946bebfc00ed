// Continuous batching (scheduler.hpp).
#include "serve/scheduler.hpp"

#include <algorithm>
#include <chrono>
#include <set>

#include "fp8moe/error.hpp"
#include "serve/generate.hpp"

namespace fp8moe::serve {

namespace {

using Clock = std::chrono::steady_clock;

struct Seq {
  uint64_t id = 0;
  Request req;
  std::vector<int32_t> tokens;  // prompt + generated; the last generated one is not yet in the cache
  int64_t computed = 0;         // tokens whose latents are in the cache
  int64_t generated = 0;
  std::vector<int32_t> table;
  std::unique_ptr<Sampler> sampler;
  std::string pending;  // made, not yet emitted (may begin a stop string)
  Clock::time_point arrival, last;
  // Prefilled elsewhere (submit_prefilled): stores the prompt's latents at admission; the token
  // sampled there.
  std::function<void(const std::vector<int32_t>&)> fill;
  int32_t first = -1;
};

void keep_latest(std::vector<double>& v) {
  if (v.size() > 20000) v.erase(v.begin(), v.end() - 10000);
}

}  // namespace

struct Scheduler::Impl {
  Engine& engine;
  SchedulerOptions opt;
  BlockAllocator alloc;
  mutable std::mutex mu;  // incoming, cancels, stats
  std::deque<std::unique_ptr<Seq>> incoming;
  std::set<uint64_t> cancels;
  uint64_t next_id = 1;
  std::deque<std::unique_ptr<Seq>> waiting;   // arrival order (preempted ones at the front)
  std::vector<std::unique_ptr<Seq>> running;  // admission order
  SchedulerStats st;

  Impl(Engine& e, const SchedulerOptions& o) : engine(e), opt(o), alloc(e.cache().blocks()) {
    FP8MOE_CHECK(o.max_step_tokens >= 1, "SchedulerOptions::max_step_tokens must be >= 1, got " << o.max_step_tokens);
    FP8MOE_CHECK(o.max_running >= 1, "SchedulerOptions::max_running must be >= 1, got " << o.max_running);
  }

  void finish(Seq& s, const std::string& reason) {
    if (reason != "cancelled" && !s.pending.empty() && s.req.on_text) s.req.on_text(s.pending);
    s.pending.clear();
    alloc.release(s.table);
    std::vector<int32_t> gen(s.tokens.begin() + int64_t(s.req.prompt.size()), s.tokens.end());
    if (s.req.on_done) s.req.on_done(reason, gen);
    std::lock_guard<std::mutex> l(mu);
    (reason == "cancelled" ? st.cancelled : st.finished) += 1;
  }

  void preempt(size_t i) {
    std::unique_ptr<Seq> s = std::move(running[i]);
    running.erase(running.begin() + int64_t(i));
    alloc.release(s->table);
    s->computed = 0;
    waiting.push_front(std::move(s));
    std::lock_guard<std::mutex> l(mu);
    ++st.preemptions;
  }

  // The sampled token of s: appended, its text streamed; true when s is done (reason set).
  bool accept(Seq& s, int32_t tok, std::string& reason) {
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> l(mu);
      if (s.generated == 0) st.ttft.push_back(std::chrono::duration<double>(now - s.arrival).count());
      else st.itl.push_back(std::chrono::duration<double>(now - s.last).count());
      keep_latest(st.ttft);
      keep_latest(st.itl);
      ++st.generated_tokens;
    }
    s.last = now;
    ++s.generated;
    s.tokens.push_back(tok);
    if (tok == s.req.eos) {
      reason = "stop";
      return true;
    }
    s.pending += decode_token(tok);
    bool stopped = false;
    const size_t n = emittable(s.pending, s.req.stop, &stopped);
    if (n > 0 && s.req.on_text) s.req.on_text(std::string_view(s.pending).substr(0, n));
    s.pending.erase(0, n);
    if (stopped) {
      s.pending.clear();
      reason = "stop";
      return true;
    }
    if (s.generated >= s.req.max_tokens) {
      reason = "length";
      return true;
    }
    return false;
  }

  bool step() {
    std::set<uint64_t> cancel;
    {
      std::lock_guard<std::mutex> l(mu);
      while (!incoming.empty()) {
        waiting.push_back(std::move(incoming.front()));
        incoming.pop_front();
      }
      cancel.swap(cancels);
    }
    if (!cancel.empty()) {
      for (size_t i = running.size(); i-- > 0;)
        if (cancel.count(running[i]->id)) {
          finish(*running[i], "cancelled");
          running.erase(running.begin() + int64_t(i));
        }
      for (size_t i = waiting.size(); i-- > 0;)
        if (cancel.count(waiting[i]->id)) {
          finish(*waiting[i], "cancelled");
          waiting.erase(waiting.begin() + int64_t(i));
        }
    }
    // The batch: the running requests in admission order (preempting from the back when a chunk
    // finds no free block), then admissions while the budget, the batch size and the blocks allow.
    int64_t budget = opt.max_step_tokens;
    std::vector<std::pair<Seq*, int64_t>> batch;
    const size_t waiting_before = waiting.size();
    for (size_t i = 0; i < running.size() && budget > 0;) {
      Seq& s = *running[i];
      const int64_t n = std::min<int64_t>(int64_t(s.tokens.size()) - s.computed, budget);
      const int64_t need = blocks_for(s.computed + n) - int64_t(s.table.size());
      while (need > alloc.free_blocks() && running.size() - 1 > i) preempt(running.size() - 1);
      if (need > alloc.free_blocks()) {  // nothing after it to preempt: it yields itself
        preempt(i);
        continue;
      }
      alloc.allocate(need, s.table);
      batch.emplace_back(&s, n);
      budget -= n;
      ++i;
    }
    // No admission in a step that preempted: the blocks it freed are for the running requests.
    const bool preempted = waiting.size() != waiting_before;
    while (!preempted && !waiting.empty() && budget > 0 && int64_t(running.size()) < opt.max_running) {
      Seq& s = *waiting.front();
      if (s.fill) {  // its blocks, the latents handed over, then the first token as if sampled here
        const int64_t need = blocks_for(s.computed + 1);
        if (need > alloc.free_blocks()) break;
        alloc.allocate(need, s.table);
        s.fill(s.table);
        s.fill = nullptr;
        std::string reason;
        if (accept(s, s.first, reason)) {
          finish(s, reason);
          waiting.pop_front();
          continue;
        }
      }
      const int64_t n = std::min<int64_t>(int64_t(s.tokens.size()) - s.computed, budget);
      const int64_t need = blocks_for(s.computed + n) - int64_t(s.table.size());
      if (need > alloc.free_blocks()) break;
      alloc.allocate(need, s.table);
      batch.emplace_back(&s, n);
      budget -= n;
      running.push_back(std::move(waiting.front()));
      waiting.pop_front();
    }
    update_counts();
    if (batch.empty()) return false;
    std::vector<SeqChunk> chunks;
    for (auto& [s, n] : batch)
      chunks.push_back({&s->table, s->computed,
                        std::vector<int32_t>(s->tokens.begin() + s->computed, s->tokens.begin() + s->computed + n)});
    const Tensor logits = engine.step(chunks);
    const int64_t V = engine.config().vocab_size;
    std::set<Seq*> done;
    for (size_t c = 0; c < batch.size(); ++c) {
      Seq& s = *batch[c].first;
      s.computed += batch[c].second;
      if (s.computed < int64_t(s.tokens.size())) continue;  // a prefill chunk short of the end
      std::string reason;
      if (accept(s, s.sampler->sample(logits.ptr<float>() + int64_t(c) * V, V), reason)) {
        finish(s, reason);
        done.insert(&s);
      }
    }
    std::erase_if(running, [&](const std::unique_ptr<Seq>& s) { return done.count(s.get()) > 0; });
    {
      std::lock_guard<std::mutex> l(mu);
      ++st.steps;
    }
    update_counts();
    return true;
  }

  std::unique_ptr<Seq> make_seq(Request r);  // validated
  uint64_t enqueue(std::unique_ptr<Seq> s);

  void update_counts() {
    std::lock_guard<std::mutex> l(mu);
    st.waiting = int64_t(waiting.size() + incoming.size());
    st.running = int64_t(running.size());
    st.blocks_used = alloc.used_blocks();
    st.blocks_total = alloc.total();
  }
};

Scheduler::Scheduler(Engine& engine, const SchedulerOptions& opt) : impl_(std::make_unique<Impl>(engine, opt)) {}
Scheduler::~Scheduler() = default;

uint64_t Scheduler::submit(Request r) { return impl_->enqueue(impl_->make_seq(std::move(r))); }

uint64_t Scheduler::submit_prefilled(Request r, int32_t first, std::function<void(const std::vector<int32_t>& table)> fill,
                                     const std::string& sampler_state) {
  const int32_t V = int32_t(impl_->engine.config().vocab_size);
  FP8MOE_CHECK(first >= 0 && first < V, "submit_prefilled: first token " << first << " outside the vocabulary [0, "
                                                                         << V << ")");
  FP8MOE_CHECK(fill, "submit_prefilled: no fill function");
  std::unique_ptr<Seq> s = impl_->make_seq(std::move(r));
  if (!sampler_state.empty()) s->sampler->set_state(sampler_state);
  s->computed = int64_t(s->tokens.size());
  s->first = first;
  s->fill = std::move(fill);
  return impl_->enqueue(std::move(s));
}

void validate_request(const Request& r, const ModelConfig& cfg, int64_t cache_blocks) {
  FP8MOE_CHECK(!r.prompt.empty(), "prompt: empty (expected at least one token)");
  for (int32_t t : r.prompt)
    FP8MOE_CHECK(t >= 0 && t < cfg.vocab_size, "prompt: token " << t << " outside the vocabulary [0, " << cfg.vocab_size << ")");
  FP8MOE_CHECK(r.max_tokens >= 1, "max_tokens must be >= 1, got " << r.max_tokens);
  const int64_t total = int64_t(r.prompt.size()) + r.max_tokens;
  FP8MOE_CHECK(total <= cfg.max_position_embeddings,
               "prompt (" << r.prompt.size() << " tokens) + max_tokens (" << r.max_tokens << ") = " << total
                          << " exceeds the context of " << cfg.max_position_embeddings << " tokens");
  FP8MOE_CHECK(blocks_for(total) <= cache_blocks,
               "prompt + max_tokens = " << total << " tokens exceed the cache of " << cache_blocks * kBlockTokens
                                        << " tokens");
  validate(r.sampling);
}

std::unique_ptr<Seq> Scheduler::Impl::make_seq(Request r) {
  validate_request(r, engine.config(), alloc.total());
  auto s = std::make_unique<Seq>();
  s->sampler = std::make_unique<Sampler>(r.sampling);
  s->tokens = r.prompt;
  s->req = std::move(r);
  s->arrival = Clock::now();
  return s;
}

uint64_t Scheduler::Impl::enqueue(std::unique_ptr<Seq> s) {
  std::lock_guard<std::mutex> l(mu);
  s->id = next_id++;
  st.prompt_tokens += int64_t(s->req.prompt.size());
  const uint64_t id = s->id;
  incoming.push_back(std::move(s));
  ++st.waiting;
  return id;
}

void Scheduler::cancel(uint64_t id) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->cancels.insert(id);
}

bool Scheduler::step() { return impl_->step(); }

bool Scheduler::idle() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->incoming.empty() && impl_->st.waiting == 0 && impl_->st.running == 0 && impl_->cancels.empty();
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->st;
}

}  // namespace fp8moe::serve
