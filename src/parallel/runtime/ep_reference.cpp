// The host reference of the expert-parallel exchanges (ep_reference.hpp).
#include "ep_reference.hpp"

#include "fp8moe/error.hpp"

namespace fp8moe::ep {

std::vector<RankReceived> reference_dispatch(const std::vector<RankTokens>& src, const std::vector<DispatchLayout>& layouts,
                                             int64_t row_bytes, int64_t G) {
  const int64_t P = int64_t(src.size());
  FP8MOE_CHECK(int64_t(layouts.size()) == P, "reference_dispatch: " << layouts.size() << " layouts for " << P << " ranks");
  std::vector<RankReceived> out(static_cast<size_t>(P));
  for (int64_t d = 0; d < P; ++d) {
    RankReceived& r = out[size_t(d)];
    r.recv_counts.assign(size_t(P), 0);
    for (int64_t p = 0; p < P; ++p) {
      const DispatchLayout& l = layouts[size_t(p)];
      const RankTokens& s = src[size_t(p)];
      const int64_t k = l.topk;
      // p's rows are rank-major in send_token: skip those of ranks before d.
      int64_t first = 0;
      for (int64_t q = 0; q < d; ++q) first += l.tokens_per_rank[size_t(q)];
      for (int64_t i = first; i < first + l.tokens_per_rank[size_t(d)]; ++i) {
        const int64_t t = l.send_token[size_t(i)];
        r.x.insert(r.x.end(), s.x.begin() + t * row_bytes, s.x.begin() + (t + 1) * row_bytes);
        r.scales.insert(r.scales.end(), s.scales.begin() + t * G, s.scales.begin() + (t + 1) * G);
        r.w.insert(r.w.end(), s.w.begin() + t * k, s.w.begin() + (t + 1) * k);
        r.idx.insert(r.idx.end(), s.idx.begin() + t * k, s.idx.begin() + (t + 1) * k);
      }
      r.recv_counts[size_t(p)] = l.tokens_per_rank[size_t(d)];
    }
  }
  return out;
}

std::vector<uint16_t> reference_combine_rows(const std::vector<std::vector<uint16_t>>& expert_rows,
                                             const std::vector<DispatchLayout>& layouts, int p, int64_t cols) {
  const int64_t P = int64_t(layouts.size());
  std::vector<uint16_t> back;
  for (int64_t d = 0; d < P; ++d) {
    int64_t first = 0;  // d's rows for sources before p
    for (int64_t q = 0; q < p; ++q) first += layouts[size_t(q)].slots_per_rank[size_t(d)];
    const int64_t n = layouts[size_t(p)].slots_per_rank[size_t(d)];
    const std::vector<uint16_t>& rows = expert_rows[size_t(d)];
    FP8MOE_CHECK(int64_t(rows.size()) >= (first + n) * cols, "reference_combine_rows: rank " << d << " returns "
                                                                  << rows.size() / cols << " rows, " << first + n << " needed");
    back.insert(back.end(), rows.begin() + first * cols, rows.begin() + (first + n) * cols);
  }
  return back;
}

std::vector<std::vector<LowLatencyExpert>> reference_low_latency_dispatch(const std::vector<RankTokens>& src,
                                                                          int64_t k, int64_t epr, int64_t row_bytes,
                                                                          int64_t G) {
  const int64_t P = int64_t(src.size());
  std::vector<std::vector<LowLatencyExpert>> out(static_cast<size_t>(P), std::vector<LowLatencyExpert>(static_cast<size_t>(epr)));
  for (auto& rank : out)
    for (auto& e : rank) e.src_counts.assign(size_t(P), 0);
  for (int64_t p = 0; p < P; ++p) {  // source-major: sources in order, each one's slots in order
    const RankTokens& s = src[size_t(p)];
    FP8MOE_CHECK(int64_t(s.idx.size()) == s.tokens * k, "reference_low_latency_dispatch: rank " << p << " has "
                                                            << s.idx.size() << " ids for " << s.tokens << " x " << k);
    for (int64_t sl = 0; sl < s.tokens * k; ++sl) {
      const int64_t x = s.idx[size_t(sl)], t = sl / k;
      FP8MOE_CHECK(x >= 0 && x < P * epr, "reference_low_latency_dispatch: expert " << x << " out of range");
      LowLatencyExpert& e = out[size_t(x / epr)][size_t(x % epr)];
      e.x.insert(e.x.end(), s.x.begin() + t * row_bytes, s.x.begin() + (t + 1) * row_bytes);
      e.scales.insert(e.scales.end(), s.scales.begin() + t * G, s.scales.begin() + (t + 1) * G);
      e.src_slot.push_back(int32_t(sl));
      ++e.src_counts[size_t(p)];
    }
  }
  return out;
}

std::vector<uint16_t> reference_low_latency_combine_rows(const std::vector<RankTokens>& src,
                                                         const std::vector<std::vector<uint16_t>>& expert_rows, int p,
                                                         int64_t k, int64_t epr, int64_t M, int64_t cols) {
  const int64_t P = int64_t(src.size()), E = P * epr;
  // fill[x]: the rows expert x holds before source p's (sources before p), then p's so far.
  std::vector<int64_t> fill(size_t(E), 0);
  for (int64_t q = 0; q < p; ++q)
    for (int32_t x : src[size_t(q)].idx) ++fill[size_t(x)];
  const RankTokens& s = src[size_t(p)];
  std::vector<uint16_t> back;
  back.reserve(size_t(s.tokens * k * cols));
  for (int64_t sl = 0; sl < s.tokens * k; ++sl) {
    const int64_t x = s.idx[size_t(sl)], d = x / epr, e = x % epr, r = e * M + fill[size_t(x)]++;
    const std::vector<uint16_t>& rows = expert_rows[size_t(d)];
    FP8MOE_CHECK(int64_t(rows.size()) >= (r + 1) * cols,
                 "reference_low_latency_combine_rows: rank " << d << " holds " << rows.size() / cols << " rows, row "
                                                             << r << " needed");
    back.insert(back.end(), rows.begin() + r * cols, rows.begin() + (r + 1) * cols);
  }
  return back;
}

}  // namespace fp8moe::ep
