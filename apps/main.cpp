// fp8moe: train and serve DeepSeek-V3-style MoE models with the FP8 recipe.
// Run `fp8moe --help` for the subcommands.
#include <cstdio>
#include <exception>

#include "commands.hpp"
#include "fp8moe/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"fp8moe: FP8 mixed-precision training of DeepSeek-V3-style MoE models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "fp8moe 0.1");
  for (auto add : fp8moe::cli::command_adders()) add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const fp8moe::Error& e) {
    std::fprintf(stderr, "fp8moe: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
