// Next-token sampling from a row of logits: greedy (temperature 0), or temperature, then top-k,
// then top-p (nucleus) over the softmax, drawn from the request's own generator, so that one seed
// repeats the text whatever else runs in the batch.
//   serve::Sampler s({.temperature = 0.8, .top_k = 40, .top_p = 0.95, .seed = 7});
//   int32_t next = s.sample(logits_row, vocab);
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace fp8moe::serve {

struct SamplingParams {
  double temperature = 0;  // 0: greedy (argmax, the lowest id on ties)
  int64_t top_k = 0;       // 0: all tokens
  double top_p = 1;        // (0, 1]
  uint64_t seed = 0;
};
// Throws fp8moe::Error naming the parameter: temperature < 0 or not finite, top_k < 0, top_p
// outside (0, 1].
void validate(const SamplingParams& p);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  int32_t sample(const float* logits, int64_t vocab);
  // The distribution sample() draws from: [vocab] probabilities, zero outside the top-k and top-p
  // truncation (temperature 0: all mass on the argmax).
  std::vector<double> distribution(const float* logits, int64_t vocab) const;
  // A draw from `p` (nonnegative, any positive total), and one of U[0, 1), from the generator.
  int32_t draw(const std::vector<double>& p);
  double uniform();
  const SamplingParams& params() const { return p_; }
  // The generator's state as text (std::mt19937_64's stream form), so that another process goes
  // on with the same draws (disaggregation: the first token is drawn on the prefill rank).
  std::string state() const;
  void set_state(const std::string& s);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
};

}  // namespace fp8moe::serve
