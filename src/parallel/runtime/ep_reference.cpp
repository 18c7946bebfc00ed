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

}  // namespace fp8moe::ep
