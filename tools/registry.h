// tools/registry.h — subcommands register themselves, so adding one is adding one file.
#pragma once

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
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

/// Whether `s` starts with a 0 followed by more (after an optional '-'): CLI11 converts with base
/// 0, so "010" would be 8 and "09" an error of its own; such numbers are refused.
inline bool leading_zero(std::string_view s) {
  if (!s.empty() && s[0] == '-') s.remove_prefix(1);
  return s.size() > 1 && s[0] == '0';
}

/// `s` as a whole decimal number (an optional '-' and digits, nothing else), if it is one.
inline std::optional<int64_t> whole_number(std::string_view s) {
  if (leading_zero(s)) return std::nullopt;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

/// A whole decimal number ≥ `least` (--threads ≥ 0; --kv-heads, --kdim, --vdim ≥ 1, where leaving
/// the option out means the default), refused in one short line otherwise. (CLI::NonNegativeNumber
/// checks a double: for "abc" it printed its range with a 300-digit bound, and took "1.5".)
inline CLI::Validator whole_number_at_least(int64_t least) {
  return CLI::Validator(
      [least](std::string& s) -> std::string {
        const std::optional<int64_t> v = whole_number(s);
        if (!v || *v < least)
          return "expected a whole number ≥ " + std::to_string(least) +
                 (leading_zero(s) ? " without leading zeros" : "") + ", got '" + s + "'";
        return {};
      },
      "");
}

/// A whole decimal number in [0, 2^64) (seeds), refused in one short line otherwise.
inline CLI::Validator unsigned_whole_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec != std::errc() || end != s.data() + s.size() || leading_zero(s))
          return "expected a whole number in [0, 2^64) without leading zeros, got '" + s + "'";
        return {};
      },
      "");
}

/// A path to write: refused when empty ("--image ''" was taken as no picture at all).
inline CLI::Validator path_to_write() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s.empty()) return "expected a path, got ''";
        // A directory cannot be replaced by the file (written beside it, then renamed over it):
        // said here, not as a failed rename of a temporary name the user never gave.
        std::error_code ec;
        if (std::filesystem::is_directory(s, ec)) return "'" + s + "' is a directory: give a file name";
        return {};
      },
      "");
}

/// At namespace scope in a tools/cmd_*.cpp:  static const CommandRegistrar reg{30, add_my_command};
struct CommandRegistrar {
  CommandRegistrar(int order, std::function<void(CLI::App&)> add) {
    command_registry().push_back({order, std::move(add)});
  }
};

}  // namespace mha::cli
