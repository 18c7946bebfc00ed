// `fp8moe train`: train DeepSeek-V3-mini on text (the default corpus when --data is not given), on
// the GPU when there is one and on the CPU otherwise. Ctrl-C writes a checkpoint and stops;
// --resume continues from out/checkpoint.safetensors with the same losses as an uninterrupted run.
#include <csignal>
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "fp8moe/model_recipe.hpp"
#include "train_options.hpp"

namespace fp8moe {
namespace {

void on_interrupt(int) { Trainer::stop_flag().store(true); }

void add_train(CLI::App& app) {
  static TrainOptions opt;
  auto* cmd = app.add_subcommand("train", "Train DeepSeek-V3-mini with the FP8 recipe");
  cli::add_train_options(cmd, opt);
  std::string recipes;
  for (const std::string& n : Recipe::names()) recipes += (recipes.empty() ? "" : " | ") + n;
  cmd->add_option("-r,--recipe", opt.recipe, recipes)->capture_default_str();
  cmd->add_flag("--resume", opt.resume, "continue from the checkpoint in --out");
  cmd->callback([] {
    std::signal(SIGINT, on_interrupt);
    TrainSummary s = Trainer(opt).run();
    if (!s.writer) return;
    std::printf("done: %lld steps, train loss %.4f, validation loss %.4f, %.0f tokens/s%s\n", (long long)s.steps,
                s.final_loss, s.final_val_loss, s.tokens_per_s, s.interrupted ? " (interrupted)" : "");
  });
}

const bool registered = cli::register_command(&add_train);

}  // namespace
}  // namespace fp8moe
