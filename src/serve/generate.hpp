// One prompt to text through the engine: the project's byte-level vocabulary (data.hpp: a token
// is a byte of UTF-8 text; ids >= 256 of a larger vocabulary decode to nothing), prefill in
// chunks, then sampled decode steps, each piece of text handed to a callback as it is made (the
// streaming of `fp8moe generate`), until max_tokens, a stop string or the EOS id.
//   serve::GenerateOptions o;  o.max_tokens = 64;
//   serve::generate(engine, "Hello", o, [](std::string_view s) { std::fwrite(s.data(), 1, s.size(), stdout); });
#pragma once
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "serve/engine.hpp"
#include "serve/sampler.hpp"

namespace fp8moe::serve {

std::vector<int32_t> encode_text(std::string_view text);
std::string decode_token(int32_t token);  // the byte, or "" for ids outside [0, 256)

struct GenerateOptions {
  int64_t max_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;  // the text ends before the first occurrence of any
  int32_t eos = -1;               // a token that ends the text (< 0: none; the byte vocabulary has none)
  int64_t prefill_chunk = 512;    // prompt tokens per prefill step
};

struct GenerateResult {
  std::string text;
  std::vector<int32_t> tokens;
  // ln p of each token under the logits it was chosen from (the softmax of the raw logits, before
  // temperature and truncation): equal bit for bit where the logits are.
  std::vector<float> logprobs;
  std::string finish_reason;  // "length" | "stop"
  double prefill_s = 0, decode_s = 0;
  int64_t drafted = 0, accepted = 0, main_steps = 0;  // speculative decoding
};

// Streams text (stop strings withheld until they can no longer match) to on_text. Throws
// fp8moe::Error when the prompt is empty or prompt + max_tokens exceeds the context or the cache.
GenerateResult generate(Engine& engine, std::string_view prompt, const GenerateOptions& opt,
                        const std::function<void(std::string_view)>& on_text = {});

// The next-token logits at every position of the prompt, [P, V] f32 on the host (one prefill
// step; the comparison with other implementations, tests/serve/hf_compare.py).
Tensor prompt_logits(Engine& engine, std::string_view prompt);

// MTP speculative decoding (EngineOptions::mtp and batch_invariant): each main step feeds the
// last token and the MTP module's draft of the one after as two decode rows of the sequence
// (SeqChunk::decode). A verified row's logits are the bits plain decoding computes at its
// position. Greedy (temperature 0): the main model's own choice at the draft's position accepts or
// replaces it, so the tokens are plain greedy decoding's on the same engine, in fewer main steps.
// Sampling: the draft is drawn from the MTP module's distribution and accepted or replaced by
// rejection sampling, so every token is distributed as plain sampling's (the same distribution,
// not the same draws as generate() with the seed). Returns the drafts made and accepted (the
// acceptance rate) besides the text.
GenerateResult generate_speculative(Engine& engine, std::string_view prompt, const GenerateOptions& opt,
                                    const std::function<void(std::string_view)>& on_text = {});

// The longest prefix of `text` that can be emitted without giving away a stop string: text
// itself cut before a complete stop string (*stopped = true), or before the longest suffix that
// begins one.
size_t emittable(std::string_view text, const std::vector<std::string>& stop, bool* stopped);

}  // namespace fp8moe::serve
