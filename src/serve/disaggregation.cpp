// Prefill/decode disaggregation (disaggregation.hpp). One request on the wire:
//   header  i64 [5]  prompt tokens (0: no more requests), first token, max_tokens, cache blocks,
//                    bytes of the sampler's state
//   prompt  i32 [P]
//   state   u8, the sampler's state (Sampler::state)
//   blocks  the parts of LatentCache::export_blocks, in order
#include "serve/disaggregation.hpp"

#include <algorithm>
#include <chrono>

#include "fp8moe/error.hpp"

namespace fp8moe::serve {

namespace {

using Clock = std::chrono::steady_clock;

Tensor host_i64(std::initializer_list<int64_t> v) {
  Tensor t = Tensor::host(DType::i64, {int64_t(v.size())});
  std::copy(v.begin(), v.end(), t.ptr<int64_t>());
  return t;
}

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

Tensor host_bytes(std::string_view s) {
  Tensor t = Tensor::host(DType::u8, {int64_t(s.size())});
  std::copy(s.begin(), s.end(), reinterpret_cast<char*>(t.ptr<uint8_t>()));
  return t;
}

int64_t send_cache_blocks(Comm& comm, const std::vector<Tensor>& parts, int peer, const Stream& s) {
  int64_t bytes = 0;
  for (const Tensor& t : parts) {
    comm.send(t.view(), peer, s);
    bytes += int64_t(t.view().nbytes());
  }
  return bytes;
}

int64_t recv_cache_blocks(Comm& comm, const std::vector<Tensor>& parts, int peer, const Stream& s) {
  int64_t bytes = 0;
  for (const Tensor& t : parts) {
    comm.recv(t.view(), peer, s);
    bytes += int64_t(t.view().nbytes());
  }
  return bytes;
}

PrefillSender::PrefillSender(Engine& engine, Comm& comm, int decode_rank, int64_t max_chunk)
    : engine_(engine), comm_(comm), peer_(decode_rank), max_chunk_(max_chunk), alloc_(engine.cache().blocks()) {
  FP8MOE_CHECK(decode_rank >= 0 && decode_rank < comm.size() && decode_rank != comm.rank(),
               "PrefillSender: decode rank " << decode_rank << " is not another rank of the " << comm.size()
                                             << "-rank communicator");
  FP8MOE_CHECK(max_chunk >= 1, "PrefillSender: max_chunk must be >= 1, got " << max_chunk);
}

Prefilled prefill_for_handover(Engine& engine, BlockAllocator& alloc, const std::vector<int32_t>& prompt,
                               int64_t max_chunk, Sampler& sampler) {
  const int64_t P = int64_t(prompt.size());
  FP8MOE_CHECK(P >= 1, "prefill: empty prompt");
  std::vector<int32_t> table;
  FP8MOE_CHECK(alloc.allocate(blocks_for(P), table),
               "prefill: " << P << " prompt tokens exceed the prefill cache of " << alloc.total() * kBlockTokens
                           << " tokens");
  Prefilled out;
  try {
    Tensor logits;
    for (int64_t s = 0; s < P; s += max_chunk)
      logits = engine.step({{&table, s, std::vector<int32_t>(prompt.begin() + s, prompt.begin() + std::min(P, s + max_chunk))}});
    out.first = sampler.sample(logits.ptr<float>(), engine.config().vocab_size);
    out.sampler_state = sampler.state();
    out.blocks = int64_t(table.size());
    out.parts = engine.cache().export_blocks(table);
    engine.backend().synchronize();
  } catch (...) {
    alloc.release(table);
    throw;
  }
  alloc.release(table);
  return out;
}

int32_t PrefillSender::send(const std::vector<int32_t>& prompt, int64_t max_tokens, const SamplingParams& sampling) {
  const int64_t P = int64_t(prompt.size());
  FP8MOE_CHECK(max_tokens >= 1, "PrefillSender::send: max_tokens must be >= 1, got " << max_tokens);
  Sampler sampler(sampling);
  const Prefilled pre = prefill_for_handover(engine_, alloc_, prompt, max_chunk_, sampler);
  const Stream st = engine_.backend().stream();
  const auto t0 = Clock::now();
  comm_.send(host_i64({P, pre.first, max_tokens, pre.blocks, int64_t(pre.sampler_state.size())}).view(), peer_, st);
  Tensor p = Tensor::host(DType::i32, {P});
  std::copy(prompt.begin(), prompt.end(), p.ptr<int32_t>());
  comm_.send(p.view(), peer_, st);
  comm_.send(host_bytes(pre.sampler_state).view(), peer_, st);
  stats_.bytes += send_cache_blocks(comm_, pre.parts, peer_, st);
  engine_.backend().synchronize();
  stats_.seconds += since(t0);
  ++stats_.requests;
  return pre.first;
}

void PrefillSender::finish() { comm_.send(host_i64({0, 0, 0, 0, 0}).view(), peer_, engine_.backend().stream()); }

DecodeReceiver::DecodeReceiver(Scheduler& scheduler, Engine& engine, Comm& comm, int prefill_rank)
    : scheduler_(scheduler), engine_(engine), comm_(comm), peer_(prefill_rank) {
  FP8MOE_CHECK(prefill_rank >= 0 && prefill_rank < comm.size() && prefill_rank != comm.rank(),
               "DecodeReceiver: prefill rank " << prefill_rank << " is not another rank of the " << comm.size()
                                               << "-rank communicator");
}

bool DecodeReceiver::receive(Request base) {
  const Stream st = engine_.backend().stream();
  Tensor h = host_i64({0, 0, 0, 0, 0});
  comm_.recv(h.view(), peer_, st);
  const int64_t P = h.ptr<int64_t>()[0], first = h.ptr<int64_t>()[1], max_tokens = h.ptr<int64_t>()[2],
                blocks = h.ptr<int64_t>()[3], state_bytes = h.ptr<int64_t>()[4];
  if (P == 0) return false;
  FP8MOE_CHECK(blocks == blocks_for(P), "DecodeReceiver: " << blocks << " cache blocks for " << P << " prompt tokens");
  const auto t0 = Clock::now();
  Tensor p = Tensor::host(DType::i32, {P});
  comm_.recv(p.view(), peer_, st);
  Tensor state = Tensor::host(DType::u8, {state_bytes});
  comm_.recv(state.view(), peer_, st);
  auto parts = std::make_shared<std::vector<Tensor>>(engine_.cache().empty_export(blocks));
  stats_.bytes += recv_cache_blocks(comm_, *parts, peer_, st);
  engine_.backend().synchronize();
  stats_.seconds += since(t0);
  ++stats_.requests;
  base.prompt.assign(p.ptr<int32_t>(), p.ptr<int32_t>() + P);
  base.max_tokens = max_tokens;
  LatentCache& cache = engine_.cache();
  scheduler_.submit_prefilled(
      std::move(base), int32_t(first),
      [parts, &cache](const std::vector<int32_t>& table) { cache.import_blocks(table, *parts); },
      std::string(reinterpret_cast<const char*>(state.ptr<uint8_t>()), size_t(state_bytes)));
  return true;
}

}  // namespace fp8moe::serve
