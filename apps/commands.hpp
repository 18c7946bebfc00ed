// Subcommand registry of the `fp8moe` command. Each apps/cmd_<name>.cpp adds its subcommand with
//   static const bool registered = fp8moe::cli::register_command(&add_<name>);
// where add_<name>(CLI::App& app) creates the subcommand, its options and its callback.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <vector>

namespace fp8moe::cli {

using CommandAdder = void (*)(CLI::App&);

inline std::vector<CommandAdder>& command_adders() {
  static std::vector<CommandAdder> adders;
  return adders;
}

inline bool register_command(CommandAdder add) {
  command_adders().push_back(add);
  return true;
}

}  // namespace fp8moe::cli
