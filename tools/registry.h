// tools/registry.h — subcommands register themselves, so adding one is adding one file.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace mha::cli {

struct CommandEntry {
  int order;  ///< position in `mha --help`
  std::function<void(CLI::App&)> add;
};

inline std::vector<CommandEntry>& command_registry() {
  static std::vector<CommandEntry> entries;
  return entries;
}

/// Thrown by a subcommand that has already printed its one-line error (e.g. every MPI rank of
/// `bench --parallel`, which must print before MPI_Finalize lets any rank exit): main exits 1 quietly.
struct AlreadyReported {};

/// At namespace scope in a tools/cmd_*.cpp:  static const CommandRegistrar reg{30, add_my_command};
struct CommandRegistrar {
  CommandRegistrar(int order, std::function<void(CLI::App&)> add) {
    command_registry().push_back({order, std::move(add)});
  }
};

}  // namespace mha::cli
