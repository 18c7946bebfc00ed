// `fp8moe generate`: text from a trained model, streamed to stdout as it is made.
//   fp8moe generate --checkpoint runs/tiny/checkpoint.safetensors "Once upon a time"
//   fp8moe generate --hf out/hf --prompt-file prompt.txt --temperature 0.8 --top-p 0.95 --seed 7
//   echo "Hello" | fp8moe generate --hf out/hf --max-tokens 64
//   fp8moe generate --checkpoint ckpt.safetensors --speculative "Hi"   (MTP drafts; greedy or sampled)
//   fp8moe generate --checkpoint ckpt.safetensors --temperature 0 --batch-invariant "Hi"   (its plain text)
//   fp8moe generate --hf out/hf --linear f32 --cache f32 --logits-out l.json "Hi"   (no generation)
// The prompt is the argument, else --prompt-file (- = stdin), else stdin. Runs on the GPU when
// there is one (--backend auto), else on the CPU. Timings go to stderr.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.hpp"
#include "fp8moe/backend.hpp"
#include "fp8moe/error.hpp"
#include "serve/generate.hpp"

namespace fp8moe {
namespace {

struct Args {
  std::string prompt, prompt_file, checkpoint, hf, backend = "auto", linear = "auto", cache = "bf16", logits_out;
  int64_t cache_blocks = 0;
  bool shared_as_routed = false, expanded_decode = false, speculative = false, batch_invariant = false;
  serve::GenerateOptions gen;
};

std::string read_all(std::istream& in) { return std::string(std::istreambuf_iterator<char>(in), {}); }

void run(const Args& a) {
  FP8MOE_CHECK(a.checkpoint.empty() != a.hf.empty(), "give exactly one of --checkpoint FILE and --hf FOLDER");
  std::string prompt = a.prompt;
  if (prompt.empty()) {
    if (a.prompt_file.empty() || a.prompt_file == "-") {
      prompt = read_all(std::cin);
    } else {
      std::ifstream f(a.prompt_file, std::ios::binary);
      FP8MOE_CHECK(f, "--prompt-file: cannot read '" << a.prompt_file << "'");
      prompt = read_all(f);
    }
  }
  const serve::WeightSet w = a.hf.empty() ? serve::load_checkpoint_weights(a.checkpoint) : serve::load_hf_weights(a.hf);
  auto be = make_backend(a.backend == "auto" ? default_backend_name() : a.backend);
  serve::EngineOptions eo;
  eo.linear = a.linear;
  eo.cache = serve::cache_dtype_from_name(a.cache);
  eo.cache_blocks = a.cache_blocks > 0 ? a.cache_blocks
                                       : serve::blocks_for(std::min<int64_t>(w.cfg.max_position_embeddings,
                                                                             int64_t(prompt.size()) + a.gen.max_tokens));
  eo.absorbed_decode = !a.expanded_decode;
  eo.shared_as_routed = a.shared_as_routed;
  eo.mtp = a.speculative;
  eo.batch_invariant = a.speculative || a.batch_invariant;
  if (a.speculative) eo.cache_blocks = std::max(eo.cache_blocks, serve::blocks_for(int64_t(prompt.size()) + a.gen.max_tokens + 1));
  serve::Engine engine(w, *be, eo);
  if (!a.logits_out.empty()) {
    const Tensor l = serve::prompt_logits(engine, prompt);  // [P, V]
    nlohmann::json j;
    j["tokens"] = serve::encode_text(prompt);
    j["logits"] = nlohmann::json::array();
    for (int64_t t = 0; t < l.size(0); ++t)
      j["logits"].push_back(std::vector<float>(l.ptr<float>() + t * l.size(1), l.ptr<float>() + (t + 1) * l.size(1)));
    std::ofstream(a.logits_out) << j.dump() << "\n";
    return;
  }
  const auto stream = [](std::string_view s) {
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  };
  const serve::GenerateResult r = a.speculative ? serve::generate_speculative(engine, prompt, a.gen, stream)
                                                : serve::generate(engine, prompt, a.gen, stream);
  std::printf("\n");
  const double n = double(r.tokens.size());
  std::fprintf(stderr, "fp8moe generate: %s on %s, %zu prompt tokens in %.3f s, %.0f tokens in %.3f s (%.1f tokens/s), finish %s\n",
               w.cfg.name.c_str(), be->name().c_str(), prompt.size(), r.prefill_s, n, r.decode_s,
               r.decode_s > 0 ? n / r.decode_s : 0.0, r.finish_reason.c_str());
  if (a.speculative)
    std::fprintf(stderr, "fp8moe generate: MTP drafts accepted %lld of %lld (%.1f%%), %lld main steps\n",
                 static_cast<long long>(r.accepted), static_cast<long long>(r.drafted),
                 r.drafted > 0 ? 100.0 * double(r.accepted) / double(r.drafted) : 0.0,
                 static_cast<long long>(r.main_steps));
}

void add_generate(CLI::App& app) {
  auto a = std::make_shared<Args>();
  CLI::App* c = app.add_subcommand("generate", "Generate text from a checkpoint or an exported Hugging Face folder");
  c->add_option("prompt", a->prompt, "Prompt text (else --prompt-file, else stdin)");
  c->add_option("--prompt-file", a->prompt_file, "File holding the prompt (- = stdin)");
  c->add_option("--checkpoint", a->checkpoint, "Training checkpoint (checkpoint.safetensors)");
  c->add_option("--hf", a->hf, "Folder written by fp8moe export (config.json + model.safetensors)");
  c->add_option("--max-tokens", a->gen.max_tokens, "Tokens to generate")->check(CLI::PositiveNumber);
  c->add_option("--temperature", a->gen.sampling.temperature, "0 = greedy")->check(CLI::NonNegativeNumber);
  c->add_option("--top-k", a->gen.sampling.top_k, "Sample among the k most likely tokens (0 = all)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--top-p", a->gen.sampling.top_p, "Nucleus mass in (0, 1]")->check(CLI::Range(1e-9, 1.0));
  c->add_option("--seed", a->gen.sampling.seed, "Sampling seed: the same seed repeats the text");
  c->add_option("--stop", a->gen.stop, "Stop string (repeatable)");
  c->add_option("--backend", a->backend, "auto | cpu | cuda | cublaslt");
  c->add_option("--linear", a->linear, "Linear precision: auto (the weights') | f32 | bf16 | fp8")
      ->check(CLI::IsMember({"auto", "f32", "bf16", "fp8"}));
  c->add_option("--cache", a->cache, "Latent cache dtype")->check(CLI::IsMember({"f32", "bf16", "fp8"}));
  c->add_option("--cache-blocks", a->cache_blocks, "Cache blocks of 64 tokens (0 = what the text needs)")
      ->check(CLI::NonNegativeNumber);
  c->add_flag("--shared-as-routed", a->shared_as_routed, "Run the shared expert as a routed expert every token picks");
  c->add_flag("--expanded-decode", a->expanded_decode, "Decode with the expanded MLA form instead of the absorbed one");
  c->add_option("--logits-out", a->logits_out, "Write the prompt's logits at every position (JSON) and stop");
  c->add_flag("--speculative", a->speculative,
              "MTP speculative decoding (implies --batch-invariant; rejection sampling at --temperature > 0)");
  c->add_flag("--batch-invariant", a->batch_invariant,
              "Decode rows' logits independent of what shares their step (the plain text --speculative equals)");
  c->callback([a] { run(*a); });
}

const bool registered = cli::register_command(&add_generate);

}  // namespace
}  // namespace fp8moe
