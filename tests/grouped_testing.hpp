// Inputs of the grouped GEMM tests (CPU backend ops and CUDA kernels): expert loads drawn between
// 0.7x and 1.3x of a mean with chosen experts empty, the contiguous layout they give (segments
// padded to 128 rows, as moe_layout writes it), and i32 tensors of the group tables.
#pragma once
#include <cmath>
#include <random>
#include <vector>

#include "fp8moe/quantize.hpp"
#include "testing.hpp"

namespace fp8moe::testing {

// Rows (tokens) per expert: round(mean * U(0.7, 1.3)), 0 for the experts listed in `empty`.
inline std::vector<int64_t> random_expert_counts(std::mt19937_64& rng, int64_t groups, int64_t mean,
                                                 const std::vector<int64_t>& empty = {}) {
  std::uniform_real_distribution<double> u(0.7, 1.3);
  std::vector<int64_t> counts(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) counts[size_t(g)] = std::llround(double(mean) * u(rng));
  for (int64_t g : empty) counts[size_t(g)] = 0;
  return counts;
}

// The contiguous layout of `counts`: expert g owns rows [offsets[g], offsets[g + 1]), its first
// counts[g] rows with row_group g, the rest (up to a multiple of 128) padding (-1); `extra`
// padding rows follow the last segment (R = offsets[G] + extra).
struct ExpertRows {
  std::vector<int32_t> row_group;
  std::vector<int64_t> offsets;
  int64_t rows() const { return int64_t(row_group.size()); }
};

inline ExpertRows expert_rows(const std::vector<int64_t>& counts, int64_t extra = 0) {
  ExpertRows L;
  L.offsets.push_back(0);
  for (int64_t c : counts) L.offsets.push_back(L.offsets.back() + round_up(c, kQuantGroup));
  L.row_group.assign(size_t(L.offsets.back() + extra), -1);
  for (size_t g = 0; g < counts.size(); ++g)
    for (int64_t r = 0; r < counts[g]; ++r) L.row_group[size_t(L.offsets[g] + r)] = int32_t(g);
  return L;
}

// A host i32 tensor [n] holding v.
template <class T>
Tensor i32_tensor(const std::vector<T>& v) {
  Tensor t = Tensor::host(DType::i32, {int64_t(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.ptr<int32_t>()[i] = int32_t(v[i]);
  return t;
}

}  // namespace fp8moe::testing
