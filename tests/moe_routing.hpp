// Random top-k routing for the MoE dispatch tests: expert_ids [T, k] i32 with k distinct experts
// per token, drawn with probability proportional to 1 / (g + 1)^skew (skew 0: uniform, 1.5: a few
// experts take most tokens), the experts in `empty` never chosen, and each slot dropped (-1) with
// probability `drop`.
#pragma once
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "fp8moe/tensor.hpp"

namespace fp8moe::testing {

struct RoutingSpec {
  int64_t tokens = 0, topk = 1, groups = 1;
  double skew = 0, drop = 0;
  std::vector<int64_t> empty;
};

inline Tensor random_routing(std::mt19937_64& rng, const RoutingSpec& s) {
  std::vector<double> p(size_t(s.groups));
  for (int64_t g = 0; g < s.groups; ++g) p[size_t(g)] = 1.0 / std::pow(double(g + 1), s.skew);
  for (int64_t g : s.empty) p[size_t(g)] = 0;
  std::discrete_distribution<int32_t> pick(p.begin(), p.end());
  std::bernoulli_distribution dropped(s.drop);
  Tensor ids = Tensor::host(DType::i32, {s.tokens, s.topk});
  int32_t* id = ids.ptr<int32_t>();
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t j = 0; j < s.topk; ++j) {
      int32_t g;
      do g = pick(rng);  // distinct experts per token: redraw repeats
      while (std::find(id + t * s.topk, id + t * s.topk + j, g) != id + t * s.topk + j);
      id[t * s.topk + j] = g;
    }
  // Drops after the draw, so a dropped slot does not free its expert for a later slot.
  for (int64_t i = 0; i < s.tokens * s.topk; ++i)
    if (dropped(rng)) id[i] = -1;
  return ids;
}

// T tokens' k distinct experts of E, uniform, as a flat [T * k] vector.
inline std::vector<int32_t> random_expert_ids(std::mt19937_64& rng, int64_t tokens, int64_t topk, int64_t experts) {
  RoutingSpec s;
  s.tokens = tokens;
  s.topk = topk;
  s.groups = experts;
  const Tensor ids = random_routing(rng, s);
  return std::vector<int32_t>(ids.ptr<int32_t>(), ids.ptr<int32_t>() + tokens * topk);
}

}  // namespace fp8moe::testing
