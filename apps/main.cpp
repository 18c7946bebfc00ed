// fp8moe: train and serve DeepSeek-V3-style MoE models with the FP8 recipe.
// Run `fp8moe --help` for the subcommands. Every failure ends here as one line on stderr and one of
// the exit codes below (kExitCodes, also in --help and README.md).
#include <cstdio>
#include <exception>
#include <filesystem>
#include <ios>
#include <new>

#include "commands.hpp"
#include "fp8moe/error.hpp"

namespace {

// 130 for an interrupted run is 128 + SIGINT, what a shell reports for a command that Ctrl-C ended.
constexpr int kInternal = 1, kBadInput = 2, kIo = 3, kInterrupted = 130;
constexpr const char* kExitCodes =
    "Exit codes: 0 success, 1 internal error, 2 usage error or bad input (options, config, data, checkpoint, an "
    "output folder that already holds a run), 3 I/O failure (a file or folder that cannot be created or written), "
    "130 interrupted (Ctrl-C; the checkpoint is written first).";

int fail(int code, const char* kind, const char* what) {
  std::fprintf(stderr, "fp8moe: %s%s\n", kind, what);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fp8moe: FP8 mixed-precision training of DeepSeek-V3-style MoE models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "fp8moe 0.1");
  app.footer(kExitCodes);
  for (auto add : fp8moe::cli::command_adders()) add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(kBadInput, "usage error: ", (std::string(e.what()) + " (see --help)").c_str());
  } catch (const fp8moe::Interrupted& e) {
    return fail(kInterrupted, "", e.what());
  } catch (const fp8moe::IoError& e) {
    return fail(kIo, "I/O error: ", e.what());
  } catch (const std::filesystem::filesystem_error& e) {
    return fail(kIo, "I/O error: ", e.what());
  } catch (const std::ios_base::failure& e) {
    return fail(kIo, "I/O error: ", e.what());
  } catch (const fp8moe::Error& e) {
    return fail(kBadInput, "error: ", e.what());
  } catch (const std::bad_alloc&) {
    return fail(kInternal, "error: ", "out of memory");
  } catch (const std::exception& e) {
    return fail(kInternal, "internal error: ", e.what());
  }
  return 0;
}
