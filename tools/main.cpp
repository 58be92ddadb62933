// tools/main.cpp — `mha`: multi-head attention from the command line.
#include <cstdio>
#include <exception>
#include <string>

#include <algorithm>

#include "registry.h"

int main(int argc, char** argv) {
  CLI::App app{"mha — exact, fast multi-head attention on the CPU.\nRun `mha demo` for a guided tour.", "mha"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "mha 0.1.0");
  auto& commands = mha::cli::command_registry();
  std::stable_sort(commands.begin(), commands.end(), [](const auto& a, const auto& b) { return a.order < b.order; });
  for (const auto& command : commands) command.add(app);
  // A first word that is neither an option nor a command: CLI11 said only "A subcommand is
  // required", without naming what it got.
  if (argc > 1 && argv[1][0] != '-') {
    const auto names = app.get_subcommands([&](const CLI::App* sub) { return sub->check_name(argv[1]); });
    if (names.empty()) {
      std::fprintf(stderr, "mha: unknown command '%s' (see mha --help)\n", argv[1]);
      return 1;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const mha::cli::AlreadyReported&) {
    return 1;
  } catch (const CLI::ParseError& e) {
    // One line, exit 1: the contract for every failure of the tool.
    std::fprintf(stderr, "mha: %s (see mha --help)\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    for (char& c : msg)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "mha: %s\n", msg.c_str());
    return 1;
  }
  return 0;
}
