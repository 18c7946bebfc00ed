// `fp8moe bench ep` (bench.hpp): the expert-parallel kernels of src/cuda/ep/ with P ranks as P
// buffers on one GPU, one stream each, at DeepSeek-V3's routing (T tokens per rank, top-k of E
// experts drawn uniformly without repeats, hidden D).
//
// Each step is timed from an event before it on a lead stream, which every rank's stream waits
// for, to the last rank's end (the lead waits for all); median of `iters`, L2 flushed (512 MiB
// memset) before each. Bytes: only those that leave a rank, counted once (the dispatch's FP8 row,
// its scales, weights and ids per (token, other rank); the combine's BF16 row per slot computed on
// another rank), over the step's time; the device copy (cudaMemcpyAsync D2D) of the same run is
// counted once too (bytes copied). On one GPU the rows a rank keeps cost the same as the others,
// so the "all rows" column counts them as well. The combine's time includes the weighted sum on
// arrival (its reads of the k rows and its f32 writes are not counted).
// With --pull, the combine's sources read the rows from the expert ranks' buffers
// (EpConfig::pull_combine).
// With --low-latency, the low-latency mode (EpConfig::low_latency, decode): T = 128 tokens per rank
// unless --tokens says otherwise, the buffer sized for T; dispatch and combine timed as above, and
// both captured in one CUDA graph per rank and replayed; DeepEP's low-latency figures on H800 (its
// README, EP 8, 128 tokens, hidden 7168, top-8 of 256) printed beside.
// With --gemm, an FP8 GEMM (4096 x 7168 x 7168, ours) is timed alone and while the ranks run
// dispatch and combine back to back on their SMs: its slowdown.
// Under mpirun (more than one process), a process per rank on the GPU of its local rank (several
// processes may share one), the buffers shared by CUDA IPC (EpGroup::ipc): dispatch and combine
// per rank, beside the communicator's all-to-all of the same bytes (NCCL where every rank has a
// GPU of its own, else the MPI engine through the host) and a copy into the next rank's memory
// (the peer copy), all measured in the same run (run_ep_bench_ranks).
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "comm/comm_checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/ep/ep_api.hpp"
#include "cuda/ep/ep_launch.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/runtime/cuda_stream.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/error.hpp"
#include "parallel/runtime/ep_reference.hpp"

namespace fp8moe::cuda {

namespace {

using namespace bench;
using ep::EpGroup;
using ep::EpRank;

std::vector<int> parse_ranks(const std::string& s) {
  std::vector<int> v;
  for (const std::string& item : comma_list(s, "bench ep --ranks")) v.push_back(std::stoi(item));
  return v;
}

// P ranks of T tokens of D columns, top-k of E experts, num_sms blocks per kernel per rank.
ep::EpConfig ep_config(int P, int64_t T, int64_t D, int64_t k, int64_t E, int num_sms) {
  ep::EpConfig cfg;
  cfg.ranks = P;
  cfg.max_tokens = T;
  cfg.hidden = D;
  cfg.topk = k;
  cfg.experts = E;
  cfg.num_sms = num_sms;
  return cfg;
}

template <class T>
void upload(void* dst, const std::vector<T>& h) {
  FP8MOE_CUDA_CHECK(cudaMemcpy(dst, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

using bench::median;

// Times `steps` (one launch per rank each) across all ranks' streams.
struct MultiTimer {
  EpGroup& g;
  cudaStream_t lead;
  DeviceBuffer flush{size_t(512) << 20};
  cudaEvent_t start, stop;
  std::vector<cudaEvent_t> done;
  explicit MultiTimer(EpGroup& group) : g(group) {
    FP8MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&lead, cudaStreamNonBlocking));
    FP8MOE_CUDA_CHECK(cudaEventCreate(&start));
    FP8MOE_CUDA_CHECK(cudaEventCreate(&stop));
    done.resize(size_t(g.size()));
    for (auto& e : done) FP8MOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~MultiTimer() {
    for (auto& e : done) cudaEventDestroy(e);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(lead);
  }
  // One timed run of fn(rank) on every rank; returns microseconds (synchronizes).
  double once(const std::function<void(int)>& fn) {
    FP8MOE_CUDA_CHECK(cudaMemsetAsync(flush.p, 0, flush.bytes, lead));
    FP8MOE_CUDA_CHECK(cudaEventRecord(start, lead));
    for (int r = 0; r < g.size(); ++r) FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(g.rank(r).stream(), start));
    for (int r = 0; r < g.size(); ++r) fn(r);
    for (int r = 0; r < g.size(); ++r) {
      FP8MOE_CUDA_CHECK(cudaEventRecord(done[size_t(r)], g.rank(r).stream()));
      FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(lead, done[size_t(r)]));
    }
    FP8MOE_CUDA_CHECK(cudaEventRecord(stop, lead));
    FP8MOE_CUDA_CHECK(cudaEventSynchronize(stop));
    for (int r = 0; r < g.size(); ++r) g.rank(r).check();
    float ms = 0;
    FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return 1e3 * double(ms);
  }
};

// Copy bandwidth, bytes copied per second (counted once), of `bytes` D2D: cudaMemcpyAsync, or with
// `blocks` > 0 block_copy on that many blocks of `threads` (the SM budget of the kernels).
double copy_gbs(size_t bytes, int warmup, int iters, int blocks = 0, int threads = 0) {
  DeviceBuffer a(bytes), b(bytes), flush(size_t(512) << 20);
  cudaEvent_t e0, e1;
  FP8MOE_CUDA_CHECK(cudaEventCreate(&e0));
  FP8MOE_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int i = 0; i < warmup + iters; ++i) {
    FP8MOE_CUDA_CHECK(cudaMemsetAsync(flush.p, 0, flush.bytes, nullptr));
    FP8MOE_CUDA_CHECK(cudaEventRecord(e0, nullptr));
    if (blocks > 0) block_copy(a.p, b.p, bytes, blocks, threads, nullptr);
    else FP8MOE_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, nullptr));
    FP8MOE_CUDA_CHECK(cudaEventRecord(e1, nullptr));
    FP8MOE_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= warmup) us.push_back(1e3 * double(ms));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return double(bytes) / (median(us) * 1e3);
}

struct RankData {
  ::fp8moe::ep::RankTokens tok;
  std::unique_ptr<DeviceBuffer> idx, w, x, scales, slot_row, rows, out;
  std::vector<uint16_t> rows_h;
};

// A rank's T tokens: a uniform top-k of E routing, random E4M3 codes (no NaN) of D columns and
// power-of-two 1x128 scales, uploaded (idx, w, x, and the scales as [G, scale_ld(T)]), each device
// buffer `pad` bytes longer; out [T, D] f32 allocated.
void make_tokens(std::mt19937_64& rng, int64_t T, int64_t k, int64_t E, int64_t D, RankData& r, size_t pad = 0) {
  const int64_t G = D / 128;
  std::uniform_int_distribution<int> ex(-3, 3);
  r.tok.tokens = T;
  ::fp8moe::ep::route_uniformly(rng, T, k, E, r.tok.idx, r.tok.w);
  r.tok.x.resize(size_t(T * D));
  for (size_t i = 0; i < r.tok.x.size(); i += 8) {
    const uint64_t v = rng() & 0x7777777777777777ull;
    std::memcpy(&r.tok.x[i], &v, std::min<size_t>(8, r.tok.x.size() - i));
  }
  r.tok.scales.resize(size_t(T * G));
  for (auto& s : r.tok.scales) s = std::ldexp(1.0f, ex(rng));
  std::vector<float> sc(size_t(G * scale_ld(T)), 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t gg = 0; gg < G; ++gg) sc[size_t(gg * scale_ld(T) + t)] = r.tok.scales[size_t(t * G + gg)];
  r.idx = std::make_unique<DeviceBuffer>(r.tok.idx.size() * 4 + pad);
  r.w = std::make_unique<DeviceBuffer>(r.tok.w.size() * 4 + pad);
  r.x = std::make_unique<DeviceBuffer>(r.tok.x.size() + pad);
  r.scales = std::make_unique<DeviceBuffer>(sc.size() * 4);
  r.out = std::make_unique<DeviceBuffer>(size_t(T * D) * 4 + pad);
  upload(r.idx->p, r.tok.idx);
  upload(r.w->p, r.tok.w);
  upload(r.x->p, r.tok.x);
  upload(r.scales->p, sc);
}

// BF16 values drawn from [-4, 4), as their bit patterns.
std::vector<uint16_t> bf16_pool(std::mt19937_64& rng, size_t n) {
  std::vector<uint16_t> pool(n);
  std::uniform_real_distribution<float> val(-4.0f, 4.0f);
  for (auto& h : pool) {
    const float f = val(rng);
    uint32_t b;
    std::memcpy(&b, &f, 4);
    h = uint16_t(b >> 16);
  }
  return pool;
}

// The low-latency mode (EpConfig::low_latency): see the header comment.
int run_ep_low_latency_bench(const EpBenchOptions& opt, double copy) {
  const int64_t T = opt.tokens, D = opt.hidden, k = opt.topk, E = opt.experts, G = D / 128;
  const uint64_t seed = opt.seed ? opt.seed : std::random_device{}();
  std::mt19937_64 rng(seed);
  std::printf("# low-latency mode: T = N = %lld tokens per rank, top-%lld of %lld experts (uniform), D = %lld, "
              "num_sms %d blocks per kernel per rank, seed %llu, median of %d, L2 flushed. Bytes leaving a rank: "
              "dispatch FP8 row + scales + slot per (token, expert) slot on another rank, combine BF16 row per such "
              "slot; device copy %.0f GB/s. DeepEP (README, H800, EP 8 = 8 GPUs): dispatch 77 us, combine 114 us\n",
              (long long)T, (long long)k, (long long)E, (long long)D, opt.num_sms, (unsigned long long)seed, opt.iters,
              copy);
  std::printf("| ranks | step | us | MiB leaving | GB/s leaving | DeepEP H800 EP 8 us | bit-exact |\n"
              "|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  int failures = 0;
  auto cpu = make_cpu_backend();
  for (int P : parse_ranks(opt.ranks)) {
    ep::EpConfig cfg = ep_config(P, T, D, k, E, opt.num_sms);
    cfg.low_latency = true;
    auto g = EpGroup::local(cfg);
    const int64_t epr = E / P, M = P * T, R = epr * M;
    std::vector<RankData> rd(static_cast<size_t>(P));
    std::vector<int64_t> count(size_t(E), 0);
    double disp_out = 0, comb_out = 0;
    for (int p = 0; p < P; ++p) {
      RankData& r = rd[size_t(p)];
      make_tokens(rng, T, k, E, D, r, 16);
      for (const int32_t e : r.tok.idx) {
        ++count[size_t(e)];
        if (e / epr != p) disp_out += double(D + G * 4 + 4), comb_out += double(D) * 2;
      }
    }
    // The experts' rows in the masked layout, random below each expert's count.
    for (int d = 0; d < P; ++d) {
      RankData& r = rd[size_t(d)];
      r.rows_h.assign(size_t(R * D), 0);
      for (int64_t e = 0; e < epr; ++e) {
        const int64_t n = count[size_t(d * epr + e)] * D;
        const std::vector<uint16_t> v = bf16_pool(rng, size_t(n));
        std::copy(v.begin(), v.end(), r.rows_h.begin() + e * M * D);
      }
      r.rows = std::make_unique<DeviceBuffer>(r.rows_h.size() * 2);
      upload(r.rows->p, r.rows_h);
    }
    auto dispatch = [&](int p, bool hook = false) {
      RankData& r = rd[size_t(p)];
      QuantizedView q{dview(r.x->p, DType::e4m3, T, D), dview(r.scales->p, DType::f32, G, scale_ld(T)),
                      ScaleKind::tile_1x128};
      g->rank(p).low_latency_dispatch(q, dview(r.idx->p, DType::i32, T, k), hook);
    };
    auto combine = [&](int p, bool hook = false) {
      RankData& r = rd[size_t(p)];
      g->rank(p).low_latency_combine(dview(r.rows->p, DType::bf16, R, D), dview(r.w->p, DType::f32, T, k),
                                     dview(r.out->p, DType::f32, T, D), false, hook);
    };
    auto receive = [&](int p) { g->rank(p).low_latency_receive(); };
    MultiTimer mt(*g);
    std::vector<double> td, tc, tg;
    for (int i = 0; i < opt.warmup + opt.iters; ++i) {
      const double a = mt.once([&](int p) { dispatch(p); });
      const double b = mt.once([&](int p) { combine(p); });
      if (i >= opt.warmup) td.push_back(a), tc.push_back(b);
    }
    // With the receive hook: the send launch and the receive launch of each step timed apart.
    std::vector<double> hook_t[4];
    for (int i = 0; i < opt.warmup + opt.iters; ++i) {
      const double t[4] = {mt.once([&](int p) { dispatch(p, true); }), mt.once(receive),
                           mt.once([&](int p) { combine(p, true); }), mt.once(receive)};
      if (i >= opt.warmup)
        for (int j = 0; j < 4; ++j) hook_t[j].push_back(t[j]);
    }
    // Both steps captured in one graph per rank, replayed.
    std::vector<cudaGraphExec_t> exec(static_cast<size_t>(P));
    for (int p = 0; p < P; ++p) {
      cudaStream_t st = g->rank(p).stream();
      FP8MOE_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
      dispatch(p);
      combine(p);
      cudaGraph_t graph;
      FP8MOE_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
      FP8MOE_CUDA_CHECK(cudaGraphInstantiate(&exec[size_t(p)], graph, 0));
      FP8MOE_CUDA_CHECK(cudaGraphDestroy(graph));
    }
    for (int i = 0; i < opt.warmup + opt.iters; ++i) {
      const double a = mt.once([&](int p) { FP8MOE_CUDA_CHECK(cudaGraphLaunch(exec[size_t(p)], g->rank(p).stream())); });
      if (i >= opt.warmup) tg.push_back(a);
    }
    for (auto e : exec) FP8MOE_CUDA_CHECK(cudaGraphExecDestroy(e));
    // Bit-exactness against the host reference (the last replay's results).
    std::string exact_d = "-", exact_c = "-";
    if (opt.check) {
      std::vector<::fp8moe::ep::RankTokens> src;
      for (auto& r : rd) src.push_back(r.tok);
      const auto want = ::fp8moe::ep::reference_low_latency_dispatch(src, k, epr, D, G);
      bool ok_d = true, ok_c = true;
      for (int d = 0; d < P && ok_d; ++d) {
        const auto rv = g->rank(d).low_latency_received();
        std::vector<int32_t> cnt(static_cast<size_t>(epr));
        FP8MOE_CUDA_CHECK(cudaMemcpy(cnt.data(), rv.counts.data, cnt.size() * 4, cudaMemcpyDeviceToHost));
        for (int64_t e = 0; e < epr && ok_d; ++e) {
          const auto& ref = want[size_t(d)][size_t(e)];
          ok_d &= cnt[size_t(e)] == int32_t(ref.src_slot.size());
          if (!ok_d) break;
          std::vector<uint8_t> gx(ref.x.size());
          FP8MOE_CUDA_CHECK(cudaMemcpy(gx.data(), static_cast<uint8_t*>(rv.x.values.data) + e * M * D, gx.size(),
                                       cudaMemcpyDeviceToHost));
          ok_d &= gx == ref.x;
        }
      }
      std::vector<std::vector<uint16_t>> rows;
      for (auto& r : rd) rows.push_back(std::move(r.rows_h));  // not needed after this
      for (int p = 0; p < P && ok_c; ++p) {
        std::vector<uint16_t> back = ::fp8moe::ep::reference_low_latency_combine_rows(src, rows, p, k, epr, M, D);
        std::vector<int32_t> slot_row(size_t(T * k));
        for (size_t i = 0; i < slot_row.size(); ++i) slot_row[i] = int32_t(i);
        std::vector<float> ref(size_t(T * D)), got(size_t(T * D));
        cpu->moe_combine(TensorView(back.data(), DType::bf16, {T * k, D}),
                         TensorView(slot_row.data(), DType::i32, {T, k}),
                         TensorView(rd[size_t(p)].tok.w.data(), DType::f32, {T, k}),
                         TensorView(ref.data(), DType::f32, {T, D}), false);
        FP8MOE_CUDA_CHECK(cudaMemcpy(got.data(), rd[size_t(p)].out->p, got.size() * 4, cudaMemcpyDeviceToHost));
        ok_c &= std::memcmp(got.data(), ref.data(), ref.size() * 4) == 0;
      }
      exact_d = ok_d ? "yes (counts, FP8 rows)" : "NO";
      exact_c = ok_c ? "yes" : "NO";
      failures += !ok_d + !ok_c;
    }
    const double us_d = median(td), us_c = median(tc), us_g = median(tg);
    std::printf("| %d | dispatch | %.1f | %.1f | %.0f | %s | %s |\n", P, us_d, disp_out / (1 << 20),
                disp_out / (us_d * 1e3), P == 8 ? "77" : "-", exact_d.c_str());
    std::printf("| %d | combine | %.1f | %.1f | %.0f | %s | %s |\n", P, us_c, comb_out / (1 << 20),
                comb_out / (us_c * 1e3), P == 8 ? "114" : "-", exact_c.c_str());
    std::printf("| %d | dispatch + combine, one graph per rank | %.1f | %.1f | %.0f | %s | - |\n", P, us_g,
                (disp_out + comb_out) / (1 << 20), (disp_out + comb_out) / (us_g * 1e3), "-");
    std::printf("| %d | with the receive hook: dispatch send / receive launch, combine send / receive launch | "
                "%.1f / %.1f, %.1f / %.1f | - | - | - | - |\n",
                P, median(hook_t[0]), median(hook_t[1]), median(hook_t[2]), median(hook_t[3]));
    std::fflush(stdout);
  }
  return failures == 0 ? 0 : 1;
}

// ---- under mpirun: a process per rank ----

// Every rank's v, in rank order (its bytes, exchanged through the communicator's bootstrap).
template <class V>
std::vector<V> all_ranks(Comm& c, V v) {
  std::vector<V> out;
  for (const std::string& m : c.exchange(std::string(reinterpret_cast<const char*>(&v), sizeof v))) {
    V x{};
    FP8MOE_CHECK(m.size() == sizeof x, "bench ep: a rank sent " << m.size() << " bytes for a figure");
    std::memcpy(&x, m.data(), sizeof x);
    out.push_back(x);
  }
  return out;
}
// One timed run of fn, queued on stream s of every rank: each rank's L2 flushed, then a barrier,
// then the run, timed by events on s; the slowest rank's microseconds (a rank's time includes
// the others' later starts, up to the host's launch skew).
struct RankTimer {
  Comm& c;
  DeviceBuffer flush{size_t(512) << 20};
  cudaEvent_t a = nullptr, b = nullptr;
  explicit RankTimer(Comm& comm) : c(comm) {
    FP8MOE_CUDA_CHECK(cudaEventCreate(&a));
    FP8MOE_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~RankTimer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  double once(cudaStream_t s, const std::function<void()>& fn) {
    FP8MOE_CUDA_CHECK(cudaMemsetAsync(flush.p, 0, flush.bytes, s));
    FP8MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    c.barrier();
    FP8MOE_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    FP8MOE_CUDA_CHECK(cudaEventRecord(b, s));
    FP8MOE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return std::ranges::max(all_ranks(c, 1e3 * double(ms)));
  }
  double median_us(const EpBenchOptions& opt, cudaStream_t s, const std::function<void()>& fn) {
    std::vector<double> us;
    for (int i = 0; i < opt.warmup + opt.iters; ++i) {
      const double t = once(s, fn);
      if (i >= opt.warmup) us.push_back(t);
    }
    return median(us);
  }
};

// A rank's tokens as bytes (exchange), and back.
template <class T>
void put(std::string& b, const std::vector<T>& v) {
  const uint64_t n = v.size();
  b.append(reinterpret_cast<const char*>(&n), sizeof n);
  b.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
template <class T>
void take(const std::string& b, size_t& at, std::vector<T>& v) {
  uint64_t n = 0;
  FP8MOE_CHECK(at + sizeof n <= b.size(), "bench ep: a rank's tokens end early");
  std::memcpy(&n, b.data() + at, sizeof n);
  at += sizeof n;
  FP8MOE_CHECK(at + n * sizeof(T) <= b.size(), "bench ep: a rank's tokens end early");
  v.resize(n);
  std::memcpy(v.data(), b.data() + at, n * sizeof(T));
  at += n * sizeof(T);
}

// This rank's received rows and slot_row byte for byte against the host reference of every
// rank's tokens (exchanged); true on every rank when all ranks match.
bool dispatch_exact(Comm& comm, EpRank& r, const RankData& rd, int64_t T, int64_t k, int64_t E, int64_t D) {
  const int P = comm.size(), me = comm.rank();
  std::string mine;
  put(mine, rd.tok.idx);
  put(mine, rd.tok.w);
  put(mine, rd.tok.x);
  put(mine, rd.tok.scales);
  std::vector<::fp8moe::ep::RankTokens> src(static_cast<size_t>(P));
  std::vector<::fp8moe::ep::DispatchLayout> layouts;
  const std::vector<std::string> all = comm.exchange(mine);
  for (int p = 0; p < P; ++p) {
    size_t at = 0;
    ::fp8moe::ep::RankTokens& t = src[size_t(p)];
    t.tokens = T;
    take(all[size_t(p)], at, t.idx);
    take(all[size_t(p)], at, t.w);
    take(all[size_t(p)], at, t.x);
    take(all[size_t(p)], at, t.scales);
    layouts.push_back(::fp8moe::ep::dispatch_layout(t.idx.data(), T, k, P, E / P));
  }
  const auto want = ::fp8moe::ep::reference_dispatch(src, layouts, D, D / 128);
  const auto rv = r.received();
  std::vector<uint8_t> gx(size_t(rv.rows * D));
  FP8MOE_CUDA_CHECK(cudaMemcpy(gx.data(), rv.x.values.data, gx.size(), cudaMemcpyDeviceToHost));
  std::vector<int32_t> sr(size_t(T * k));
  FP8MOE_CUDA_CHECK(cudaMemcpy(sr.data(), rd.slot_row->p, sr.size() * 4, cudaMemcpyDeviceToHost));
  const bool ok = gx == want[size_t(me)].x && sr == layouts[size_t(me)].slot_row;
  const std::vector<double> oks = all_ranks(comm, ok ? 1.0 : 0.0);
  return std::all_of(oks.begin(), oks.end(), [](double v) { return v == 1.0; });
}

// The low-latency mode under mpirun: dispatch and combine of T tokens per rank (no notify, no
// host read), each timed as above; bytes leaving a rank per (token, expert) slot on another rank.
void low_latency_ranks(const EpBenchOptions& opt, Comm& comm, EpRank& r, RankData& rd, std::mt19937_64& rng,
                       RankTimer& timer) {
  const int P = comm.size(), me = comm.rank();
  const int64_t T = opt.tokens, D = opt.hidden, k = opt.topk, E = opt.experts, G = D / 128, epr = E / P;
  const int64_t M = P * T;  // rows per local expert
  double disp = 0, comb = 0;
  for (const int32_t e : rd.tok.idx)
    if (e / epr != me) disp += double(D + G * 4 + 4), comb += double(D) * 2;
  const std::vector<uint16_t> v = bf16_pool(rng, size_t(epr * M * D));
  rd.rows = std::make_unique<DeviceBuffer>(v.size() * 2);
  upload(rd.rows->p, v);
  const QuantizedView q{dview(rd.x->p, DType::e4m3, T, D), dview(rd.scales->p, DType::f32, G, scale_ld(T)),
                        ScaleKind::tile_1x128};
  const TensorView idx = dview(rd.idx->p, DType::i32, T, k), w = dview(rd.w->p, DType::f32, T, k);
  const TensorView rows = dview(rd.rows->p, DType::bf16, epr * M, D), out = dview(rd.out->p, DType::f32, T, D);
  std::vector<double> td, tc;
  for (int i = 0; i < opt.warmup + opt.iters; ++i) {
    const double a = timer.once(r.stream(), [&] { r.low_latency_dispatch(q, idx); });
    const double b = timer.once(r.stream(), [&] { r.low_latency_combine(rows, w, out, false); });
    r.check();
    if (i >= opt.warmup) td.push_back(a), tc.push_back(b);
  }
  double disp_all = 0, comb_all = 0;
  for (const double x : all_ranks(comm, disp)) disp_all += x;
  for (const double x : all_ranks(comm, comb)) comb_all += x;
  if (me == 0) {
    const double us_d = median(td), us_c = median(tc);
    std::printf("| ranks | step | us | MiB leaving a rank | GB/s per rank | DeepEP H800 EP 8 us |\n"
                "|---|---|---|---|---|---|\n");
    std::printf("| %d | dispatch | %.1f | %.2f | %.0f | 77 |\n", P, us_d, disp_all / P / (1 << 20),
                disp_all / P / (us_d * 1e3));
    std::printf("| %d | combine | %.1f | %.2f | %.0f | 114 |\n", P, us_c, comb_all / P / (1 << 20),
                comb_all / P / (us_c * 1e3));
    std::fflush(stdout);
  }
}

int run_ep_bench_ranks(const EpBenchOptions& opt) {
  FP8MOE_CHECK(!opt.gemm, "bench ep under mpirun: --gemm runs with the ranks as buffers on one GPU (without mpirun)");
  std::unique_ptr<Comm> comm = make_comm("auto");
  const int P = comm->size(), me = comm->rank();
  const int64_t T = opt.tokens, D = opt.hidden, k = opt.topk, E = opt.experts, G = D / 128;
  // One seed for the run (rank 0's), each rank's tokens from its own stream of it.
  uint64_t seed = opt.seed ? opt.seed : std::random_device{}();
  seed = all_ranks(*comm, seed)[0];
  std::mt19937_64 rng(seed + 0x9E3779B97F4A7C15ull * uint64_t(me + 1));
  int dev = 0;
  cudaDeviceProp prop;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  FP8MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  char bus[32] = {};
  FP8MOE_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, dev));
  const std::vector<std::string> buses = comm->exchange(std::string(bus) + "@" + [] {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    return std::string(host);
  }());
  const int gpus = int(std::set<std::string>(buses.begin(), buses.end()).size());
  // The device copy, one rank at a time (ranks may share a GPU).
  double copy = 0;
  for (int q = 0; q < P; ++q) {
    comm->barrier();
    if (q == me) copy = copy_gbs(size_t(1) << 30, opt.warmup, opt.iters);
  }
  const double copy_min = std::ranges::min(all_ranks(*comm, copy));

  const Stream stream = make_stream();
  const cudaStream_t s = native(stream);
  ep::EpConfig cfg = ep_config(P, T, D, k, E, opt.num_sms);
  cfg.pull_combine = opt.pull;
  cfg.low_latency = opt.low_latency;
  const int R = opt.ranks_per_node > 0 && opt.ranks_per_node < P ? opt.ranks_per_node : P;
  cfg.ranks_per_node = R;
  // Processes sharing a GPU take turns on it (without MPS), so a wait lasts until the peer's turn:
  // the communicator's timeout, as the training's transport takes.
  cfg.timeout_s = comm_detail::timeout_s();
  auto g = EpGroup::ipc(cfg, *comm, s);
  EpRank& r = g->rank(0);
  RankData rd;
  make_tokens(rng, T, k, E, D, rd, 16);
  RankTimer timer(*comm);
  const std::string shared =
      gpus < P ? "; ranks share GPUs: their bytes cross no link, and their kernels take turns on the GPU (without "
                 "MPS), so the times are not the kernels'"
               : "";
  if (opt.low_latency) {
    if (me == 0)
      std::printf("# fp8moe bench ep --low-latency under mpirun on %s: %d ranks (processes) on %d GPU%s, CUDA IPC "
                  "buffers; T = N = %lld tokens per rank, top-%lld of %lld experts (uniform), D = %lld, num_sms %d "
                  "per rank, seed %llu, median of %d, L2 flushed, each step timed on every rank from a barrier (the "
                  "slowest rank's); device copy of the slowest GPU %.0f GB/s; DeepEP (README, H800, EP 8 = 8 GPUs): "
                  "dispatch 77 us, combine 114 us%s\n",
                  prop.name, P, gpus, gpus == 1 ? "" : "s", (long long)T, (long long)k, (long long)E, (long long)D,
                  opt.num_sms, (unsigned long long)seed, opt.iters, copy_min, shared.c_str());
    low_latency_ranks(opt, *comm, r, rd, rng, timer);
    return 0;
  }
  rd.slot_row = std::make_unique<DeviceBuffer>(size_t(T * k) * 4);
  const TensorView idx = dview(rd.idx->p, DType::i32, T, k);
  r.notify(idx);
  const ep::EpCounts& n = r.counts();
  const double row_bytes = double(D + G * 4 + k * 8);
  double disp_out = 0, comb_out = 0;  // over all ranks
  for (int p = 0; p < P; ++p)
    for (int d = 0; d < P; ++d)
      if (p != d) {
        disp_out += double(n.tokens_to(p, d)) * row_bytes;
        comb_out += double(n.slots_to(p, d)) * double(D) * 2;
      }
  const int64_t back = n.returned(me);
  const std::vector<uint16_t> pool = bf16_pool(rng, size_t(back * D));
  rd.rows = std::make_unique<DeviceBuffer>(pool.size() * 2 + 16);
  upload(rd.rows->p, pool);
  if (opt.pull) upload(r.combine_input().data, pool);
  const QuantizedView q{dview(rd.x->p, DType::e4m3, T, D), dview(rd.scales->p, DType::f32, G, scale_ld(T)),
                        ScaleKind::tile_1x128};
  const TensorView w = dview(rd.w->p, DType::f32, T, k), slot_row = dview(rd.slot_row->p, DType::i32, T, k);
  const TensorView rows = opt.pull ? r.combine_input() : dview(rd.rows->p, DType::bf16, back, D);
  const TensorView out = dview(rd.out->p, DType::f32, T, D);

  std::vector<double> tn, td, tc;
  for (int i = 0; i < opt.warmup + opt.iters; ++i) {
    const double a = timer.once(s, [&] { r.notify(idx); });
    r.counts();
    const double b = timer.once(s, [&] { r.dispatch(q, w, idx, slot_row); });
    const double c = timer.once(s, [&] { r.combine(rows, slot_row, w, out, false); });
    r.check();
    if (i >= opt.warmup) tn.push_back(a), td.push_back(b), tc.push_back(c);
  }
  // The last dispatch against the host reference (the combine is checked by the one-process bench
  // and the transport's tests: its rows would be hundreds of MiB per rank to exchange).
  const std::string exact = !opt.check ? "-" : dispatch_exact(*comm, r, rd, T, k, E, D) ? "yes" : "NO";

  // The communicator's all-to-all of the same bytes: the dispatch's rows (FP8 row, scales, weights
  // and ids as bytes) to the ranks holding their experts, and the combine's BF16 rows back; the
  // rows a rank keeps are not sent.
  auto a2a_us = [&](int64_t width, const std::function<int64_t(int, int)>& rows_from_to) {
    std::vector<int64_t> sc(static_cast<size_t>(P), 0), rc(static_cast<size_t>(P), 0);
    int64_t ns = 0, nr = 0;
    for (int d = 0; d < P; ++d) {
      sc[size_t(d)] = d == me ? 0 : rows_from_to(me, d);
      rc[size_t(d)] = d == me ? 0 : rows_from_to(d, me);
      ns += sc[size_t(d)];
      nr += rc[size_t(d)];
    }
    DeviceBuffer sb(size_t(std::max<int64_t>(ns, 1) * width)), rb(size_t(std::max<int64_t>(nr, 1) * width));
    const TensorView sv = dview(sb.p, DType::e4m3, ns, width), rv = dview(rb.p, DType::e4m3, nr, width);
    return timer.median_us(opt, s, [&] { comm->all_to_all_v(sv, sc, rv, rc, stream); });
  };
  const double a2a_d = a2a_us(int64_t(row_bytes), [&](int p, int d) { return n.tokens_to(p, d); });
  const double a2a_c = a2a_us(2 * D, [&](int p, int d) { return n.slots_to(d, p); });

  // The peer copy: this rank's leaving dispatch bytes into the next rank's memory (a ring), by
  // cudaMemcpyAsync through CUDA IPC.
  size_t mine = 0;
  for (int d = 0; d < P; ++d)
    if (d != me) mine += size_t(n.tokens_to(me, d)) * size_t(row_bytes);
  const size_t peer_bytes = std::max<size_t>(16, size_t(std::ranges::max(all_ranks(*comm, double(mine)))));
  DeviceBuffer src(peer_bytes), dst(peer_bytes);
  cudaIpcMemHandle_t h;
  FP8MOE_CUDA_CHECK(cudaIpcGetMemHandle(&h, dst.p));
  const std::vector<std::string> handles = comm->exchange(std::string(reinterpret_cast<const char*>(&h), sizeof h));
  cudaIpcMemHandle_t next_h;
  std::memcpy(&next_h, handles[size_t((me + 1) % P)].data(), sizeof next_h);
  void* next = nullptr;
  FP8MOE_CUDA_CHECK(cudaIpcOpenMemHandle(&next, next_h, cudaIpcMemLazyEnablePeerAccess));
  const double peer_us =
      timer.median_us(opt, s, [&] { FP8MOE_CUDA_CHECK(cudaMemcpyAsync(next, src.p, peer_bytes, cudaMemcpyDefault, s)); });
  comm->barrier();  // every rank's copies into its memory are over before it goes
  FP8MOE_CUDA_CHECK(cudaIpcCloseMemHandle(next));

  if (me == 0) {
    const double us_n = median(tn), us_d = median(td), us_c = median(tc);
    const double d_rank = disp_out / P, c_rank = comb_out / P;  // bytes leaving a rank, on average
    auto gbs = [](double bytes, double us) { return bytes / (us * 1e3); };
    const double peer = gbs(double(peer_bytes), peer_us);
    std::printf("# fp8moe bench ep under mpirun on %s: %d ranks (processes) on %d GPU%s, CUDA IPC buffers; T = %lld "
                "tokens per rank, top-%lld of %lld experts (uniform), D = %lld, num_sms %d per rank%s, seed %llu, "
                "median of %d, L2 flushed, each step timed on every rank from a barrier (the slowest rank's)\n",
                prop.name, P, gpus, gpus == 1 ? "" : "s", (long long)T, (long long)k, (long long)E, (long long)D,
                opt.num_sms, R < P ? (", nodes of " + std::to_string(R) + " ranks (two-hop dispatch)").c_str() : "",
                (unsigned long long)seed, opt.iters);
    std::printf("# bytes: only those that leave a rank, per rank on average (dispatch: FP8 row + scales + weights + "
                "ids per (token, other rank); combine: BF16 row per slot computed elsewhere); the all-to-all "
                "(%s communicator) moves the same bytes; peer copy: %.1f MiB into the next rank's memory; device "
                "copy of the slowest GPU %.0f GB/s (1 GiB D2D, bytes copied)%s\n",
                comm->name().c_str(), double(peer_bytes) / (1 << 20), copy_min, shared.c_str());
    std::printf("| ranks | step | us | MiB leaving a rank | GB/s per rank | all-to-all us | x all-to-all | of peer copy "
                "(%.0f GB/s) | bit-exact |\n|---|---|---|---|---|---|---|---|---|\n",
                peer);
    std::printf("| %d | notify | %.1f | - | - | - | - | - | - |\n", P, us_n);
    std::printf("| %d | dispatch | %.1f | %.1f | %.0f | %.1f | %.2fx | %.0f%% | %s |\n", P, us_d, d_rank / (1 << 20),
                gbs(d_rank, us_d), a2a_d, a2a_d / us_d, 100 * gbs(d_rank, us_d) / peer, exact.c_str());
    std::printf("| %d | combine%s | %.1f | %.1f | %.0f | %.1f | %.2fx | %.0f%% | - |\n", P, opt.pull ? " (pull)" : "",
                us_c, c_rank / (1 << 20), gbs(c_rank, us_c), a2a_c, a2a_c / us_c, 100 * gbs(c_rank, us_c) / peer);
    std::fflush(stdout);
  }
  return exact == "NO" ? 1 : 0;
}

}  // namespace

int run_ep_bench(const EpBenchOptions& opt) {
  const LaunchInfo launch = launch_info();
  if (launch.under_mpirun && launch.size > 1) return run_ep_bench_ranks(opt);
  const int64_t T = opt.tokens, D = opt.hidden, k = opt.topk, E = opt.experts, G = D / 128;
  const uint64_t seed = opt.seed ? opt.seed : std::random_device{}();
  std::mt19937_64 rng(seed);
  cudaDeviceProp prop;
  int dev = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  FP8MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  const double copy = copy_gbs(size_t(1) << 30, opt.warmup, opt.iters);
  if (opt.low_latency) {
    std::printf("# fp8moe bench ep --low-latency on %s (%d SMs): P ranks as P buffers on this GPU, one stream each\n",
                prop.name, prop.multiProcessorCount);
    return run_ep_low_latency_bench(opt, copy);
  }
  std::printf("# fp8moe bench ep on %s (%d SMs): P ranks as P buffers on this GPU, one stream each; T = %lld tokens "
              "per rank, top-%lld of %lld experts (uniform), D = %lld, num_sms %d per rank, seed %llu, median of %d, "
              "L2 flushed\n",
              prop.name, prop.multiProcessorCount, (long long)T, (long long)k, (long long)E, (long long)D, opt.num_sms,
              (unsigned long long)seed, opt.iters);
  std::printf("# bytes: only those that leave a rank, counted once (dispatch: FP8 row + scales + weights + ids per "
              "(token, other rank); combine: BF16 row per slot computed elsewhere); device copy: %.0f GB/s (1 GiB "
              "cudaMemcpyAsync D2D, bytes copied counted once)\n",
              copy);
  std::printf("# same-SM copy: the same 1 GiB copied by a plain kernel on the step's blocks (P x num_sms, its "
              "threads per block): what the SM budget allows, so that the last column is the kernels' own overhead\n");
  std::printf("| ranks | step | us | MiB leaving | GB/s leaving | %% of copy | GB/s all rows | %% of copy | same-SM copy "
              "GB/s | %% of same-SM copy | bit-exact |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  int failures = 0;
  auto cpu = make_cpu_backend();
  for (int P : parse_ranks(opt.ranks)) {
    ep::EpConfig cfg = ep_config(P, T, D, k, E, opt.num_sms);
    cfg.pull_combine = opt.pull;
    const int R = opt.ranks_per_node > 0 && opt.ranks_per_node < P ? opt.ranks_per_node : P;
    cfg.ranks_per_node = R;
    auto g = EpGroup::local(cfg);
    const int64_t epr = E / P;
    std::vector<RankData> rd(static_cast<size_t>(P));
    std::vector<::fp8moe::ep::DispatchLayout> layouts;
    for (int p = 0; p < P; ++p) {
      RankData& r = rd[size_t(p)];
      make_tokens(rng, T, k, E, D, r);
      r.slot_row = std::make_unique<DeviceBuffer>(size_t(T * k) * 4);
      layouts.push_back(::fp8moe::ep::dispatch_layout(r.tok.idx.data(), T, k, P, epr));
    }
    auto notify = [&](int p) { g->rank(p).notify(dview(rd[size_t(p)].idx->p, DType::i32, T, k)); };
    for (int p = 0; p < P; ++p) notify(p);
    for (int p = 0; p < P; ++p) g->rank(p).counts();
    const ep::EpCounts& n0 = g->rank(0).counts();
    double disp_out = 0, disp_all = 0, comb_out = 0, comb_all = 0;
    const double row_bytes = double(D + G * 4 + k * 8);
    for (int p = 0; p < P; ++p)
      for (int d = 0; d < P; ++d) {
        disp_all += double(n0.tokens_to(p, d)) * row_bytes;
        comb_all += double(n0.slots_to(p, d)) * double(D) * 2;
        if (p == d) continue;
        disp_out += double(n0.tokens_to(p, d)) * row_bytes;
        comb_out += double(n0.slots_to(p, d)) * double(D) * 2;
      }
    if (R < P) {
      // Bytes crossing a node boundary: the two-hop dispatch's first hop (a row, and the rows it
      // lands at on that node's R ranks, once per other node holding one of its experts) against
      // the single-hop layout (a row per other-node rank holding one).
      double hop1 = 0, direct = 0;
      for (int p = 0; p < P; ++p) {
        const std::vector<int32_t>& idx = rd[size_t(p)].tok.idx;
        for (int64_t t = 0; t < T; ++t) {
          uint32_t nodes = 0;
          for (int64_t j = 0; j < k; ++j) nodes |= 1u << (idx[size_t(t * k + j)] / epr / R);
          nodes &= ~(1u << (p / R));
          hop1 += double(__builtin_popcount(nodes)) * (row_bytes + 4.0 * R);
        }
        for (int d = 0; d < P; ++d)
          if (d / R != p / R) direct += double(n0.tokens_to(p, d)) * row_bytes;
      }
      std::printf("# %d ranks as %d nodes of %d: the dispatch's bytes crossing nodes %.1f MiB in two hops (first "
                  "hop), %.1f MiB in one (%.2fx)\n",
                  P, P / R, R, hop1 / (1 << 20), direct / (1 << 20), direct / hop1);
    }
    // The experts' rows: BF16 values of a random pool, each row from a random place in it.
    const std::vector<uint16_t> pool = bf16_pool(rng, size_t(1) << 20);
    std::uniform_int_distribution<size_t> at(0, pool.size() - size_t(D));
    for (int d = 0; d < P; ++d) {
      RankData& r = rd[size_t(d)];
      const int64_t n = g->rank(d).counts().returned(d);
      r.rows_h.resize(size_t(n * D));
      for (int64_t i = 0; i < n; ++i) std::memcpy(&r.rows_h[size_t(i * D)], &pool[at(rng)], size_t(D) * 2);
      r.rows = std::make_unique<DeviceBuffer>(r.rows_h.size() * 2 + 16);
      upload(r.rows->p, r.rows_h);
      if (opt.pull) upload(g->rank(d).combine_input().data, r.rows_h);  // where the experts would write them
    }
    auto dispatch = [&](int p) {
      RankData& r = rd[size_t(p)];
      QuantizedView q{dview(r.x->p, DType::e4m3, T, D), dview(r.scales->p, DType::f32, G, scale_ld(T)),
                      ScaleKind::tile_1x128};
      g->rank(p).dispatch(q, dview(r.w->p, DType::f32, T, k), dview(r.idx->p, DType::i32, T, k),
                          dview(r.slot_row->p, DType::i32, T, k));
    };
    auto combine = [&](int p) {
      RankData& r = rd[size_t(p)];
      const int64_t n = g->rank(p).counts().returned(p);
      g->rank(p).combine(opt.pull ? g->rank(p).combine_input() : dview(r.rows->p, DType::bf16, n, D),
                         dview(r.slot_row->p, DType::i32, T, k),
                         dview(r.w->p, DType::f32, T, k), dview(r.out->p, DType::f32, T, D), false);
    };
    MultiTimer mt(*g);
    std::vector<double> tn, td, tc;
    for (int i = 0; i < opt.warmup + opt.iters; ++i) {
      const double a = mt.once(notify);
      for (int p = 0; p < P; ++p) g->rank(p).counts();
      const double b = mt.once(dispatch);
      const double c = mt.once(combine);
      if (i >= opt.warmup) tn.push_back(a), td.push_back(b), tc.push_back(c);
    }
    // Bit-exactness against the host reference (the last iteration's results).
    std::string exact_d = "-", exact_c = "-";
    if (opt.check) {
      const auto want = ::fp8moe::ep::reference_dispatch([&] {
        std::vector<::fp8moe::ep::RankTokens> s;
        for (auto& r : rd) s.push_back(r.tok);
        return s;
      }(), layouts, D, G);
      bool ok_d = true, ok_c = true;
      for (int d = 0; d < P; ++d) {
        const auto rv = g->rank(d).received();
        std::vector<uint8_t> gx(size_t(rv.rows * D));
        FP8MOE_CUDA_CHECK(cudaMemcpy(gx.data(), rv.x.values.data, gx.size(), cudaMemcpyDeviceToHost));
        ok_d &= gx == want[size_t(d)].x;
        std::vector<int32_t> sr(size_t(T * k));
        FP8MOE_CUDA_CHECK(cudaMemcpy(sr.data(), rd[size_t(d)].slot_row->p, sr.size() * 4, cudaMemcpyDeviceToHost));
        ok_d &= sr == layouts[size_t(d)].slot_row;
      }
      std::vector<std::vector<uint16_t>> rows;
      for (auto& r : rd) rows.push_back(r.rows_h);
      for (int p = 0; p < P && ok_c; ++p) {
        std::vector<uint16_t> back = ::fp8moe::ep::reference_combine_rows(rows, layouts, p, D);
        std::vector<float> ref(size_t(T * D)), got(size_t(T * D));
        cpu->moe_combine(TensorView(back.data(), DType::bf16, {int64_t(back.size()) / D, D}),
                         TensorView(layouts[size_t(p)].slot_row.data(), DType::i32, {T, k}),
                         TensorView(rd[size_t(p)].tok.w.data(), DType::f32, {T, k}),
                         TensorView(ref.data(), DType::f32, {T, D}), false);
        FP8MOE_CUDA_CHECK(cudaMemcpy(got.data(), rd[size_t(p)].out->p, got.size() * 4, cudaMemcpyDeviceToHost));
        ok_c &= std::memcmp(got.data(), ref.data(), ref.size() * 4) == 0;
      }
      exact_d = ok_d ? "yes (FP8 rows, slot_row)" : "NO";
      exact_c = ok_c ? "yes" : "NO";
      failures += !ok_d + !ok_c;
    }
    const double us_n = median(tn), us_d = median(td), us_c = median(tc);
    const int blocks = P * opt.num_sms;
    const double copy_d = copy_gbs(size_t(1) << 30, opt.warmup, opt.iters, blocks, ep::dispatch_threads());
    const double copy_c = copy_gbs(size_t(1) << 30, opt.warmup, opt.iters, blocks, ep::combine_threads());
    std::printf("| %d | notify | %.1f | - | - | - | - | - | - | - | - |\n", P, us_n);
    std::printf("| %d | dispatch | %.1f | %.1f | %.0f | %.0f%% | %.0f | %.0f%% | %.0f | %.0f%% | %s |\n", P, us_d,
                disp_out / (1 << 20), disp_out / (us_d * 1e3), 100 * disp_out / (us_d * 1e3) / copy,
                disp_all / (us_d * 1e3), 100 * disp_all / (us_d * 1e3) / copy, copy_d,
                100 * disp_all / (us_d * 1e3) / copy_d, exact_d.c_str());
    std::printf("| %d | combine%s | %.1f | %.1f | %.0f | %.0f%% | %.0f | %.0f%% | %.0f | %.0f%% | %s |\n", P,
                opt.pull ? " (pull)" : "", us_c, comb_out / (1 << 20), comb_out / (us_c * 1e3),
                100 * comb_out / (us_c * 1e3) / copy, comb_all / (us_c * 1e3), 100 * comb_all / (us_c * 1e3) / copy,
                copy_c, 100 * comb_all / (us_c * 1e3) / copy_c, exact_c.c_str());
    std::fflush(stdout);

    if (opt.gemm) {
      // The GEMM on its own stream, alone and while the ranks loop over dispatch and combine.
      const int64_t M = 4096, N = 7168, K = 7168;
      DeviceQuantized aq(M, K, ScaleKind::tile_1x128), bq(N, K, ScaleKind::block_128x128);
      std::vector<uint8_t> ab(size_t(M * K)), bb(size_t(N * K));
      for (auto* v : {&ab, &bb})
        for (size_t i = 0; i < v->size(); i += 8) {
          const uint64_t r = rng() & 0x7777777777777777ull;
          std::memcpy(&(*v)[i], &r, 8);
        }
      upload(aq.values.p, ab);
      upload(bq.values.p, bb);
      std::vector<float> ones(aq.scales.bytes / 4, 1.0f);
      upload(aq.scales.p, ones);
      upload(bq.scales.p, std::vector<float>(bq.scales.bytes / 4, 1.0f));
      DeviceBuffer dd(size_t(M * N) * 2);
      cudaStream_t gs;
      FP8MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking));
      cudaEvent_t e0, e1;
      FP8MOE_CUDA_CHECK(cudaEventCreate(&e0));
      FP8MOE_CUDA_CHECK(cudaEventCreate(&e1));
      auto gemm_once = [&] {  // microseconds of one GEMM on gs
        FP8MOE_CUDA_CHECK(cudaEventRecord(e0, gs));
        gemm_fp8_sm90(aq.view, bq.view, dview(dd.p, DType::bf16, M, N), false, gs);
        FP8MOE_CUDA_CHECK(cudaEventRecord(e1, gs));
        FP8MOE_CUDA_CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        FP8MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        return 1e3 * double(ms);
      };
      auto gemm_us = [&](int reps) {
        std::vector<double> v;
        for (int i = 0; i < reps; ++i) v.push_back(gemm_once());
        return median(v);
      };
      gemm_us(3);
      const double alone = gemm_us(opt.iters);
      // Enough EP steps queued to outlast the GEMMs timed beside them.
      // NOTES: on one GPU this can fail: once the GEMM's pending blocks are ahead of a rank's in the
      // block scheduler and every SM holds a spinning block of another rank, neither can start;
      // the ranks' waits then time out (an fp8moe::Error, reported here), which a GPU per rank
      // cannot meet (the GEMM there never waits for the ranks).
      std::vector<double> v;
      std::string failed;
      for (int i = 0; i < opt.iters && failed.empty(); ++i) try {
        for (int rep = 0; rep < 4; ++rep) {
          for (int p = 0; p < P; ++p) dispatch(p);
          for (int p = 0; p < P; ++p) combine(p);
        }
        v.push_back(gemm_once());
        for (int p = 0; p < P; ++p) g->rank(p).check();
      } catch (const Error& e) {
        failed = e.what();
      }
      const double beside = median(v);
      if (!failed.empty())
        std::printf("# %d ranks: the GEMM beside dispatch + combine did not complete: %s\n", P, failed.c_str());
      else
        std::printf("# %d ranks: FP8 GEMM %lldx%lldx%lld alone %.1f us (%.0f TFLOP/s), beside dispatch + combine "
                  "(%d x %d SMs) %.1f us: %.0f%% slower\n",
                  P, (long long)M, (long long)N, (long long)K, alone, 2.0 * M * N * K / (alone * 1e6), P, opt.num_sms,
                  beside, 100 * (beside / alone - 1));
      std::fflush(stdout);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      cudaStreamDestroy(gs);
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace fp8moe::cuda
