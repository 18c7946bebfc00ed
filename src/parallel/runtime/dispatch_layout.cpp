// The dispatch layout of an expert-parallel group (dispatch_layout.hpp).
#include "dispatch_layout.hpp"

#include "fp8moe/error.hpp"

namespace fp8moe::ep {

int64_t DispatchLayout::sent_rows() const { return int64_t(send_token.size()); }

DispatchLayout dispatch_layout(const int32_t* idx, int64_t T, int64_t K, int64_t P, int64_t epr) {
  FP8MOE_CHECK(T >= 0 && K >= 1 && P >= 1 && epr >= 1,
               "dispatch_layout: tokens " << T << ", topk " << K << ", ranks " << P << ", experts per rank " << epr);
  DispatchLayout l;
  l.tokens = T;
  l.topk = K;
  l.ranks = P;
  l.experts_per_rank = epr;
  l.tokens_per_rank.assign(size_t(P), 0);
  l.tokens_per_expert.assign(size_t(P * epr), 0);
  l.token_in_rank.assign(size_t(T * P), 0);
  l.slots_per_rank.assign(size_t(P), 0);
  for (int64_t i = 0; i < T * K; ++i) {
    const int32_t e = idx[i];
    FP8MOE_CHECK(e >= 0 && e < P * epr, "dispatch_layout: idx[" << i / K << ", " << i % K << "] = " << e
                                                                << " outside [0, " << P * epr << ")");
    ++l.tokens_per_expert[size_t(e)];
    ++l.slots_per_rank[size_t(e / epr)];
    l.token_in_rank[size_t(i / K * P + e / epr)] = 1;
  }
  l.slot_row.assign(size_t(T * K), -1);
  int64_t slot_base = 0;
  for (int64_t d = 0; d < P; ++d) {
    int64_t slot = slot_base;
    for (int64_t t = 0; t < T; ++t) {
      if (!l.token_in_rank[size_t(t * P + d)]) continue;
      ++l.tokens_per_rank[size_t(d)];
      l.send_token.push_back(int32_t(t));
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = idx[t * K + j];
        const bool here = e / epr == d;
        l.send_expert.push_back(here ? int32_t(e - d * epr) : -1);
        if (here) l.slot_row[size_t(t * K + j)] = int32_t(slot++);
      }
    }
    slot_base = slot;
  }
  return l;
}

std::vector<int32_t> return_rows(const int32_t* expert, const int32_t* slot_row_local, int64_t n, int64_t K) {
  std::vector<int32_t> rows;
  for (int64_t i = 0; i < n * K; ++i)
    if (expert[i] >= 0) rows.push_back(slot_row_local[i]);
  return rows;
}

}  // namespace fp8moe::ep
