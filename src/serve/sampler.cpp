// Sampling (sampler.hpp).
#include "serve/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <vector>

#include "fp8moe/error.hpp"

namespace fp8moe::serve {

void validate(const SamplingParams& p) {
  FP8MOE_CHECK(std::isfinite(p.temperature) && p.temperature >= 0,
               "temperature must be finite and >= 0, got " << p.temperature);
  FP8MOE_CHECK(p.top_k >= 0, "top_k must be >= 0 (0: all tokens), got " << p.top_k);
  FP8MOE_CHECK(std::isfinite(p.top_p) && p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got " << p.top_p);
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) { validate(p); }

std::string Sampler::state() const {
  std::ostringstream os;
  os << rng_;
  return os.str();
}

void Sampler::set_state(const std::string& s) {
  std::istringstream is(s);
  is >> rng_;
  FP8MOE_CHECK(!is.fail(), "Sampler::set_state: not a generator state (" << s.size() << " bytes)");
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (p_.temperature == 0) return int32_t(std::max_element(logits, logits + vocab) - logits);
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  // Descending logits, ties by id: the order (and so the draw) is deterministic.
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const size_t k = p_.top_k > 0 ? size_t(std::min<int64_t>(p_.top_k, vocab)) : size_t(vocab);
  std::vector<double> prob(k);
  const double mx = logits[ids[0]];
  double z = 0;
  for (size_t i = 0; i < k; ++i) z += prob[i] = std::exp((double(logits[ids[i]]) - mx) / p_.temperature);
  size_t n = 0;
  double cum = 0;
  while (n < k) {  // the smallest prefix whose mass reaches top_p
    cum += prob[n++] / z;
    if (cum >= p_.top_p) break;
  }
  double mass = 0;
  for (size_t i = 0; i < n; ++i) mass += prob[i];
  double u = std::uniform_real_distribution<double>(0, mass)(rng_);
  for (size_t i = 0; i < n; ++i) {
    u -= prob[i];
    if (u < 0) return ids[i];
  }
  return ids[n - 1];
}

}  // namespace fp8moe::serve
