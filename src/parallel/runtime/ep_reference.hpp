// The results of the expert-parallel exchanges of ep_exchange.cpp (all_to_all_v of the dispatch
// layout's rows), computed on the host for every rank at once: the reference the peer-memory
// kernels (src/cuda/ep/) are compared with byte for byte, and a statement of what they must
// produce. Rank d holds experts [d * epr, (d + 1) * epr).
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "dispatch_layout.hpp"

namespace fp8moe::ep {

// One rank's tokens: idx [T, k] global expert ids, w [T, k], x [T, row_bytes] (FP8 codes), scales
// [T, G] token-major.
struct RankTokens {
  int64_t tokens = 0;
  std::vector<int32_t> idx;
  std::vector<float> w;
  std::vector<uint8_t> x;
  std::vector<float> scales;
};

// What reaches one rank: source-major, tokens ascending (DispatchRoute's order).
struct RankReceived {
  std::vector<int64_t> recv_counts;  // [P] rows from each source
  std::vector<uint8_t> x;            // [n, row_bytes]
  std::vector<float> scales;         // [n, G]
  std::vector<float> w;              // [n, k]
  std::vector<int32_t> idx;          // [n, k] global ids
};

// The dispatch of every rank's tokens (ranks = src.size()); layouts[p] = dispatch_layout of rank p.
std::vector<RankReceived> reference_dispatch(const std::vector<RankTokens>& src, const std::vector<DispatchLayout>& layouts,
                                             int64_t row_bytes, int64_t groups);

// The combine's rows as source p receives them ([T_p * k, cols], rank-major: what moe_combine reads
// with layouts[p].slot_row), from each rank's returned rows expert_rows[d] ([sum_q slots of q on d,
// cols], source-major, each source's slots in order).
std::vector<uint16_t> reference_combine_rows(const std::vector<std::vector<uint16_t>>& expert_rows,
                                             const std::vector<DispatchLayout>& layouts, int p, int64_t cols);

// The low-latency mode (src/cuda/ep/ep_low_latency.cu): what reaches rank d for its local expert e,
// one row per (token, expert) slot of any source whose expert is d * epr + e, source-major, each
// source's slots t * k + j ascending (the order of the masked layout's rows e * M + [0, n)).
struct LowLatencyExpert {
  std::vector<int64_t> src_counts;  // [P] rows from each source
  std::vector<uint8_t> x;           // [n, row_bytes]
  std::vector<float> scales;        // [n, G]
  std::vector<int32_t> src_slot;    // [n] the slot t * k + j on its source
};

// [P][epr]: every rank's experts for the tokens of every rank (ranks = src.size()).
std::vector<std::vector<LowLatencyExpert>> reference_low_latency_dispatch(const std::vector<RankTokens>& src,
                                                                          int64_t topk, int64_t experts_per_rank,
                                                                          int64_t row_bytes, int64_t groups);

// The combine's rows as source p receives them, [T_p * k, cols] in slot order (what moe_combine
// reads with slot_row t * k + j): slot (t, j)'s row from the rank d holding idx[t, j] = d * epr + e,
// expert_rows[d] being d's rows in the masked layout ([epr * rows_per_expert, cols], expert e's at
// e * rows_per_expert + i in the order above).
std::vector<uint16_t> reference_low_latency_combine_rows(const std::vector<RankTokens>& src,
                                                         const std::vector<std::vector<uint16_t>>& expert_rows, int p,
                                                         int64_t topk, int64_t experts_per_rank,
                                                         int64_t rows_per_expert, int64_t cols);

// Routing drawn from rng: each of T tokens picks k distinct experts of E uniformly, with weights in
// [0.01, 1), appended to idx and w [T, k].
template <class Rng>
void route_uniformly(Rng& rng, int64_t T, int64_t k, int64_t E, std::vector<int32_t>& idx, std::vector<float>& w) {
  std::uniform_int_distribution<int32_t> pick(0, int32_t(E) - 1);
  std::uniform_real_distribution<float> weight(0.01f, 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      int32_t e;
      do e = pick(rng);
      while (std::find(idx.end() - j, idx.end(), e) != idx.end());
      idx.push_back(e);
      w.push_back(weight(rng));
    }
}

}  // namespace fp8moe::ep
