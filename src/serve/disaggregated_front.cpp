// The disaggregated server's front and decode rank (disaggregated_front.hpp).
#include "serve/disaggregated_front.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "fp8moe/error.hpp"

namespace fp8moe::serve {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kRequestHeader = 13, kEventHeader = 4;
constexpr int64_t kEnd = 0, kRequest = 1, kCancel = 2;  // front to decode rank
constexpr int64_t kText = 1, kDone = 2;                 // decode rank to front

Tensor i64s(const std::vector<int64_t>& v) {
  Tensor t = Tensor::host(DType::i64, {int64_t(v.size())});
  std::copy(v.begin(), v.end(), t.ptr<int64_t>());
  return t;
}
int64_t bits_of(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}
double double_of(int64_t b) {
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
}
std::string pack_stops(const std::vector<std::string>& stops) {
  std::string out;
  for (const std::string& s : stops) {
    const uint32_t n = uint32_t(s.size());
    out.append(reinterpret_cast<const char*>(&n), sizeof n);
    out += s;
  }
  return out;
}
std::vector<std::string> unpack_stops(const std::string& packed) {
  std::vector<std::string> out;
  for (size_t at = 0; at + sizeof(uint32_t) <= packed.size();) {
    uint32_t n;
    std::memcpy(&n, packed.data() + at, sizeof n);
    at += sizeof n;
    FP8MOE_CHECK(at + n <= packed.size(), "disaggregated front: a stop string runs past its message");
    out.push_back(packed.substr(at, n));
    at += n;
  }
  return out;
}
// n bytes from `peer` (nothing on the wire when n is 0).
std::string recv_bytes(Comm& comm, int64_t n, int peer, const Stream& st) {
  if (n == 0) return {};
  Tensor t = Tensor::host(DType::u8, {n});
  comm.recv(t.view(), peer, st);
  return std::string(reinterpret_cast<const char*>(t.ptr<uint8_t>()), size_t(n));
}

// The decode rank's sends in flight, each with its tensor kept alive until it completes; shared
// with the requests' callbacks, which may outlive the loop that made them.
struct Outbox {
  Comm& comm;
  int peer;
  Stream st;
  std::deque<std::pair<CommRequest, Tensor>> inflight;
  void post(Tensor t) {
    CommRequest r = comm.isend(t.view(), peer, st);
    inflight.emplace_back(std::move(r), std::move(t));
  }
  void reap() {
    while (!inflight.empty() && inflight.front().first.test()) inflight.pop_front();
  }
};

}  // namespace

struct DisaggregatedFront::Impl {
  Engine& engine;
  Comm& comm;
  int64_t max_chunk;
  BlockAllocator alloc;
  Stream st;
  struct Peer {  // a decode rank
    int rank = 0;
    int64_t blocks = 0;  // its cache
    int64_t live = 0;    // requests handed to it and not done
    int64_t handed = 0;  // requests handed to it
    Tensor event = i64s(std::vector<int64_t>(kEventHeader, 0));
    CommRequest event_req;
  };
  std::vector<Peer> peers;
  int64_t decode_blocks = 0;  // the smallest of the decode ranks' caches
  mutable std::mutex mu;  // waiting, cancels, next_id, stats
  std::deque<std::pair<uint64_t, Request>> waiting;
  std::map<uint64_t, Clock::time_point> arrival;
  std::set<uint64_t> cancels;
  uint64_t next_id = 1;
  SchedulerStats stats;
  struct Live {
    Request req;
    Clock::time_point arrival, last;
    bool any_text = false;
    size_t peer = 0;  // index into peers
  };
  std::map<uint64_t, Live> live;  // handed over; the engine thread's
  HandoverStats handover;
  bool finished = false;

  Impl(Engine& e, Comm& c, const std::vector<int>& decode_ranks, int64_t chunk)
      : engine(e), comm(c), max_chunk(chunk), alloc(e.cache().blocks()), st(e.backend().stream()) {
    FP8MOE_CHECK(!decode_ranks.empty(), "DisaggregatedFront: no decode rank");
    std::set<int> seen;
    for (int p : decode_ranks) {
      FP8MOE_CHECK(p >= 0 && p < c.size() && p != c.rank(),
                   "DisaggregatedFront: decode rank " << p << " is not another rank of the " << c.size()
                                                      << "-rank communicator");
      FP8MOE_CHECK(seen.insert(p).second, "DisaggregatedFront: decode rank " << p << " is listed twice");
    }
    FP8MOE_CHECK(chunk >= 1, "DisaggregatedFront: max_chunk must be >= 1, got " << chunk);
    peers.resize(decode_ranks.size());
    for (size_t i = 0; i < peers.size(); ++i) {
      Peer& q = peers[i];
      q.rank = decode_ranks[i];
      Tensor b = i64s({0});
      comm.recv(b.view(), q.rank, st);
      q.blocks = b.ptr<int64_t>()[0];
      decode_blocks = i == 0 ? q.blocks : std::min(decode_blocks, q.blocks);
      q.event_req = comm.irecv(q.event.view(), q.rank, st);
    }
  }

  // The decode rank with the fewest requests in flight (the first of those tied): each rank's
  // cache and batch are the same size, so this spreads both.
  size_t pick_peer() const {
    size_t best = 0;
    for (size_t i = 1; i < peers.size(); ++i)
      if (peers[i].live < peers[best].live) best = i;
    return best;
  }

  void on_event(Peer& q) {
    const int peer = q.rank;
    const int64_t* v = q.event.ptr<int64_t>();
    const int64_t kind = v[0], n = v[2], tokens = v[3];
    const uint64_t id = uint64_t(v[1]);
    const auto it = live.find(id);
    FP8MOE_CHECK(it != live.end(), "DisaggregatedFront: the decode rank sent for unknown request " << id);
    Live& L = it->second;
    const auto now = Clock::now();
    if (kind == kText) {
      const std::string text = recv_bytes(comm, n, peer, st);
      {
        std::lock_guard<std::mutex> l(mu);
        (L.any_text ? stats.itl : stats.ttft)
            .push_back(std::chrono::duration<double>(now - (L.any_text ? L.last : L.arrival)).count());
      }
      L.any_text = true;
      L.last = now;
      if (L.req.on_text) L.req.on_text(text);
      return;
    }
    FP8MOE_CHECK(kind == kDone, "DisaggregatedFront: unknown message kind " << kind << " from the decode rank");
    const std::string reason = recv_bytes(comm, n, peer, st);
    std::vector<int32_t> gen(static_cast<size_t>(tokens));
    if (tokens > 0) {
      Tensor t = Tensor::host(DType::i32, {tokens});
      comm.recv(t.view(), peer, st);
      std::copy(t.ptr<int32_t>(), t.ptr<int32_t>() + tokens, gen.begin());
    }
    Request req = std::move(L.req);
    live.erase(it);
    --q.live;
    {
      std::lock_guard<std::mutex> l(mu);
      --stats.running;
      (reason == "cancelled" ? stats.cancelled : stats.finished) += 1;
      stats.generated_tokens += tokens;
    }
    if (req.on_done) req.on_done(reason, gen);
  }

  void hand_over(uint64_t id, Request r) {
    Sampler sampler(r.sampling);
    Prefilled pre;
    try {
      pre = prefill_for_handover(engine, alloc, r.prompt, max_chunk, sampler);
    } catch (...) {
      {
        std::lock_guard<std::mutex> l(mu);
        --stats.running;
        ++stats.cancelled;
      }
      if (r.on_done) r.on_done("cancelled", {});
      throw;
    }
    const std::string stops = pack_stops(r.stop);
    const int64_t P = int64_t(r.prompt.size());
    const size_t to = pick_peer();
    const int peer = peers[to].rank;
    const auto t0 = Clock::now();
    comm.send(i64s({kRequest, int64_t(id), P, pre.first, r.max_tokens, pre.blocks, r.eos, r.sampling.top_k,
                    int64_t(r.sampling.seed), bits_of(r.sampling.temperature), bits_of(r.sampling.top_p),
                    int64_t(stops.size()), int64_t(pre.sampler_state.size())})
                  .view(),
              peer, st);
    Tensor p = Tensor::host(DType::i32, {P});
    std::copy(r.prompt.begin(), r.prompt.end(), p.ptr<int32_t>());
    comm.send(p.view(), peer, st);
    if (!stops.empty()) comm.send(host_bytes(stops).view(), peer, st);
    comm.send(host_bytes(pre.sampler_state).view(), peer, st);
    handover.bytes += send_cache_blocks(comm, pre.parts, peer, st);
    handover.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    ++handover.requests;
    Clock::time_point arrived;
    {
      std::lock_guard<std::mutex> l(mu);
      arrived = arrival[id];
      arrival.erase(id);
    }
    live.emplace(id, Live{std::move(r), arrived, arrived, false, to});
    ++peers[to].live;
    ++peers[to].handed;
  }

  bool step() {
    FP8MOE_CHECK(!finished, "DisaggregatedFront::step: the front has finished");
    bool worked = false;
    for (Peer& q : peers)
      while (q.event_req.test()) {
        worked = true;
        on_event(q);
        q.event_req = comm.irecv(q.event.view(), q.rank, st);
      }
    std::set<uint64_t> cs;
    {
      std::lock_guard<std::mutex> l(mu);
      cs.swap(cancels);
    }
    for (uint64_t id : cs) {
      std::optional<Request> gone;
      {
        std::lock_guard<std::mutex> l(mu);
        for (auto it = waiting.begin(); it != waiting.end(); ++it)
          if (it->first == id) {
            gone = std::move(it->second);
            waiting.erase(it);
            arrival.erase(id);
            --stats.waiting;
            ++stats.cancelled;
            break;
          }
      }
      if (gone) {
        if (gone->on_done) gone->on_done("cancelled", {});
        worked = true;
      } else if (const auto it = live.find(id); it != live.end()) {  // its decode rank answers with its end
        std::vector<int64_t> h(kRequestHeader, 0);
        h[0] = kCancel;
        h[1] = int64_t(id);
        comm.send(i64s(h).view(), peers[it->second.peer].rank, st);
        worked = true;
      }
    }
    std::optional<std::pair<uint64_t, Request>> next;
    {
      std::lock_guard<std::mutex> l(mu);
      if (!waiting.empty()) {
        next = std::move(waiting.front());
        waiting.pop_front();
        --stats.waiting;
        ++stats.running;
      }
    }
    if (next) {
      hand_over(next->first, std::move(next->second));
      worked = true;
    }
    std::lock_guard<std::mutex> l(mu);
    ++stats.steps;
    return worked;
  }

  void finish() {
    if (finished) return;
    finished = true;
    std::vector<int64_t> h(kRequestHeader, 0);
    h[0] = kEnd;
    for (const Peer& q : peers) comm.send(i64s(h).view(), q.rank, st);
  }
};

DisaggregatedFront::DisaggregatedFront(Engine& e, Comm& comm, const std::vector<int>& decode_ranks, int64_t max_chunk)
    : impl_(std::make_unique<Impl>(e, comm, decode_ranks, max_chunk)) {}

DisaggregatedFront::~DisaggregatedFront() {
  try {
    impl_->finish();  // a decode rank left waiting would never return
  } catch (const std::exception&) {
  }
}

uint64_t DisaggregatedFront::submit(Request r) {
  Impl& m = *impl_;
  validate_request(r, m.engine.config(), m.decode_blocks);
  FP8MOE_CHECK(blocks_for(int64_t(r.prompt.size())) <= m.alloc.total(),
               "prompt: " << r.prompt.size() << " tokens exceed the prefill cache of " << m.alloc.total() * kBlockTokens
                          << " tokens");
  std::lock_guard<std::mutex> l(m.mu);
  const uint64_t id = m.next_id++;
  m.stats.prompt_tokens += int64_t(r.prompt.size());
  ++m.stats.waiting;
  m.arrival[id] = Clock::now();
  m.waiting.emplace_back(id, std::move(r));
  return id;
}

void DisaggregatedFront::cancel(uint64_t id) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->cancels.insert(id);
}

bool DisaggregatedFront::step() { return impl_->step(); }

SchedulerStats DisaggregatedFront::stats() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  SchedulerStats s = impl_->stats;
  s.blocks_total = 0;  // the decode ranks' caches; their use is not reported back
  for (const auto& q : impl_->peers) s.blocks_total += q.blocks;
  return s;
}

bool DisaggregatedFront::idle() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->waiting.empty() && impl_->cancels.empty() && impl_->live.empty();
}

void DisaggregatedFront::finish() { impl_->finish(); }

const HandoverStats& DisaggregatedFront::handover() const { return impl_->handover; }

std::vector<int64_t> DisaggregatedFront::handovers_per_rank() const {
  std::vector<int64_t> n;
  for (const auto& q : impl_->peers) n.push_back(q.handed);
  return n;
}

void serve_decode_rank(Scheduler& scheduler, Engine& engine, Comm& comm, int front) {
  FP8MOE_CHECK(front >= 0 && front < comm.size() && front != comm.rank(),
               "serve_decode_rank: front rank " << front << " is not another rank of the " << comm.size()
                                                << "-rank communicator");
  const Stream st = engine.backend().stream();
  comm.send(i64s({engine.cache().blocks()}).view(), front, st);
  auto out = std::make_shared<Outbox>(Outbox{comm, front, st, {}});
  auto local = std::make_shared<std::map<uint64_t, uint64_t>>();  // the front's id -> the scheduler's
  LatentCache& cache = engine.cache();
  Tensor h = i64s(std::vector<int64_t>(kRequestHeader, 0));
  CommRequest next = comm.irecv(h.view(), front, st);
  for (;;) {
    bool worked = false;
    if (next.test()) {
      worked = true;
      const std::vector<int64_t> v(h.ptr<int64_t>(), h.ptr<int64_t>() + kRequestHeader);
      const uint64_t id = uint64_t(v[1]);
      if (v[0] == kEnd) break;
      if (v[0] == kCancel) {
        const auto it = local->find(id);
        if (it != local->end()) scheduler.cancel(it->second);
      } else {
        FP8MOE_CHECK(v[0] == kRequest, "serve_decode_rank: unknown message kind " << v[0] << " from the front");
        const int64_t P = v[2], blocks = v[5];
        FP8MOE_CHECK(P >= 1 && blocks == blocks_for(P),
                     "serve_decode_rank: " << blocks << " cache blocks for " << P << " prompt tokens");
        Request r;
        Tensor p = Tensor::host(DType::i32, {P});
        comm.recv(p.view(), front, st);
        r.prompt.assign(p.ptr<int32_t>(), p.ptr<int32_t>() + P);
        r.max_tokens = v[4];
        r.eos = int32_t(v[6]);
        r.sampling.top_k = v[7];
        r.sampling.seed = uint64_t(v[8]);
        r.sampling.temperature = double_of(v[9]);
        r.sampling.top_p = double_of(v[10]);
        r.stop = unpack_stops(recv_bytes(comm, v[11], front, st));
        const std::string sampler_state = recv_bytes(comm, v[12], front, st);
        auto parts = std::make_shared<std::vector<Tensor>>(cache.empty_export(blocks));
        recv_cache_blocks(comm, *parts, front, st);
        r.on_text = [out, id](std::string_view s) {
          out->post(i64s({kText, int64_t(id), int64_t(s.size()), 0}));
          if (!s.empty()) out->post(host_bytes(s));
        };
        r.on_done = [out, local, id](const std::string& reason, const std::vector<int32_t>& t) {
          out->post(i64s({kDone, int64_t(id), int64_t(reason.size()), int64_t(t.size())}));
          if (!reason.empty()) out->post(host_bytes(reason));
          if (!t.empty()) {
            Tensor g = Tensor::host(DType::i32, {int64_t(t.size())});
            std::copy(t.begin(), t.end(), g.ptr<int32_t>());
            out->post(std::move(g));
          }
          local->erase(id);
        };
        const int32_t first = int32_t(v[3]);
        try {
          (*local)[id] = scheduler.submit_prefilled(std::move(r), first, [parts, &cache](const std::vector<int32_t>& table) {
            cache.import_blocks(table, *parts);
          }, sampler_state);
        } catch (const Error& e) {  // the front validated it against this cache: a mismatch of the two ranks
          std::fprintf(stderr, "fp8moe decode rank: request %llu refused: %s\n", (unsigned long long)id, e.what());
          out->post(i64s({kDone, int64_t(id), 9, 0}));
          out->post(host_bytes("cancelled"));
        }
      }
      next = comm.irecv(h.view(), front, st);
    }
    worked = scheduler.step() || worked;
    out->reap();
    if (!worked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace fp8moe::serve
