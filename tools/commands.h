// tools/commands.h — the subcommands of the `mha` command-line tool.
//
// Each add_*_command registers one subcommand on the app; its callback throws on bad input and
// main() turns any exception into one line on stderr and exit status 1.
#pragma once

#include <CLI/CLI.hpp>

namespace mha::cli {

void add_forward_command(CLI::App& app);
void add_params_command(CLI::App& app);
void add_demo_command(CLI::App& app);

}  // namespace mha::cli
