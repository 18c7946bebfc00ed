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

namespace {

// The tokens a draw at temperature > 0 chooses among: ids in descending logits (ties by id, so
// the order and the draw are deterministic), the unnormalized weights of the first n, their sum.
struct Nucleus {
  std::vector<int32_t> ids;
  std::vector<double> prob;
  size_t n = 0;
  double mass = 0;
};

Nucleus nucleus(const SamplingParams& sp, const float* logits, int64_t vocab) {
  Nucleus r;
  std::vector<int32_t>& ids = r.ids;
  std::vector<double>& prob = r.prob;
  ids.resize(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  // Descending logits, ties by id: the order (and so the draw) is deterministic.
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const size_t k = sp.top_k > 0 ? size_t(std::min<int64_t>(sp.top_k, vocab)) : size_t(vocab);
  prob.resize(k);
  const double mx = logits[ids[0]];
  double z = 0;
  for (size_t i = 0; i < k; ++i) z += prob[i] = std::exp((double(logits[ids[i]]) - mx) / sp.temperature);
  size_t& n = r.n;
  double cum = 0;
  while (n < k) {  // the smallest prefix whose mass reaches top_p
    cum += prob[n++] / z;
    if (cum >= sp.top_p) break;
  }
  for (size_t i = 0; i < n; ++i) r.mass += prob[i];
  return r;
}

int32_t argmax(const float* logits, int64_t vocab) { return int32_t(std::max_element(logits, logits + vocab) - logits); }

}  // namespace

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (p_.temperature == 0) return argmax(logits, vocab);
  const Nucleus c = nucleus(p_, logits, vocab);
  double u = std::uniform_real_distribution<double>(0, c.mass)(rng_);
  for (size_t i = 0; i < c.n; ++i) {
    u -= c.prob[i];
    if (u < 0) return c.ids[i];
  }
  return c.ids[c.n - 1];
}

std::vector<double> Sampler::distribution(const float* logits, int64_t vocab) const {
  std::vector<double> p(static_cast<size_t>(vocab), 0.0);
  if (p_.temperature == 0) {
    p[size_t(argmax(logits, vocab))] = 1;
    return p;
  }
  const Nucleus c = nucleus(p_, logits, vocab);
  for (size_t i = 0; i < c.n; ++i) p[size_t(c.ids[i])] = c.prob[i] / c.mass;
  return p;
}

int32_t Sampler::draw(const std::vector<double>& p) {
  double total = 0;
  int32_t last = -1;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] > 0) {
      total += p[i];
      last = int32_t(i);
    }
  FP8MOE_CHECK(last >= 0, "Sampler::draw: a distribution without mass");
  double u = std::uniform_real_distribution<double>(0, total)(rng_);
  for (size_t i = 0; i < p.size(); ++i) {
    u -= p[i];
    if (p[i] > 0 && u < 0) return int32_t(i);
  }
  return last;
}

double Sampler::uniform() { return std::uniform_real_distribution<double>(0, 1)(rng_); }

}  // namespace fp8moe::serve
