// `fp8moe train`: train DeepSeek-V3-mini on text (the default corpus when --data is not given), on
// the GPU when there is one and on the CPU otherwise. Ctrl-C writes a checkpoint and stops;
// --resume continues from out/checkpoint.safetensors with the same losses as an uninterrupted run.
#include <csignal>
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/model_recipe.hpp"
#include "train_options.hpp"

namespace fp8moe {
namespace {

// A second Ctrl-C ends the process at once (the default action), for a step that takes too long.
void on_interrupt(int) {
  Trainer::stop_flag().store(true);
  std::signal(SIGINT, SIG_DFL);
}

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
    const TrainSummary s = Trainer(opt).run();
    if (!s.writer) {  // another rank prints the summary; an interrupt still ends this one
      if (s.interrupted) throw Interrupted(interrupted_message(s));
      return;
    }
    std::printf("%s\n", format_summary(s).c_str());
    if (s.interrupted) throw Interrupted(interrupted_message(s));
  });
}

const bool registered = cli::register_command(&add_train);

}  // namespace
}  // namespace fp8moe
