// Where the tokens of one micro-batch go in an expert-parallel group, computed on the host from
// the routing (as DeepEP's get_dispatch_layout): P ranks, rank d holding experts
// [d * epr, (d + 1) * epr). A token travels once to every rank that holds one of its top-k experts
// (not once per expert); each rank returns one row per (token, expert) slot it computed, which the
// source combines in slot order, so the sums are those of one rank holding every expert.
#pragma once
#include <cstdint>
#include <vector>

namespace fp8moe::ep {

struct DispatchLayout {
  int64_t tokens = 0, topk = 0, ranks = 0, experts_per_rank = 0;
  std::vector<int64_t> tokens_per_rank;    // [P] rows sent to each rank
  std::vector<int64_t> tokens_per_expert;  // [P * epr] slots routed to each expert
  std::vector<uint8_t> token_in_rank;      // [T, P] 1 where token t goes to rank d
  std::vector<int32_t> send_token;         // [sum tokens_per_rank] the token of each sent row,
                                           // rank-major, tokens ascending within a rank
  std::vector<int32_t> send_expert;        // [sum tokens_per_rank, k] the destination's local
                                           // expert of each slot of the row, -1 for slots elsewhere
  std::vector<int64_t> slots_per_rank;     // [P] (token, expert) rows each rank returns
  std::vector<int32_t> slot_row;           // [T, k] row of slot (t, j) among the returned rows
                                           // (rank-major, then (t, j) ascending)
  int64_t sent_rows() const;
};

// idx [T, k] i32 expert ids in [0, P * epr) (the routing's top-k).
DispatchLayout dispatch_layout(const int32_t* idx, int64_t tokens, int64_t topk, int64_t ranks,
                               int64_t experts_per_rank);

// On the expert side, the rows a rank returns to one source: for each received row i and slot j
// with expert[i, j] >= 0 in that order, the row of the slot in the local expert layout
// (slot_row_local [n, k]).
std::vector<int32_t> return_rows(const int32_t* expert, const int32_t* slot_row_local, int64_t n, int64_t topk);

}  // namespace fp8moe::ep
