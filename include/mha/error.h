// mha/error.h — the one exception type the library throws, and helpers that name shapes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace mha {

/// Thrown for every bad argument, shape, mask or file. The message starts with the function
/// that rejected the input and names the argument and the shapes it got and expected.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

/// "(2, 3, 4)" for a shape; "()" for a scalar.
inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ')';
  return os.str();
}

namespace detail {
inline void append_all(std::ostringstream&) {}
template <class T, class... Rest>
void append_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append_all(os, rest...);
}
}  // namespace detail

/// Builds a message from its parts and throws mha::Error.
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  detail::append_all(os, parts...);
  throw Error(os.str());
}

/// a · b for sizes computed from untrusted input (file headers, metadata, tensor shapes): throws
/// mha::Error naming `what` when a factor is negative or the product does not fit in int64.
inline int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  if (a < 0 || b < 0) fail(what, ": negative size ", a < 0 ? a : b);
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) fail(what, ": size ", a, " × ", b, " does not fit in 64 bits");
  return out;
}

/// a + b, checked like checked_mul.
inline int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  if (a < 0 || b < 0) fail(what, ": negative size ", a < 0 ? a : b);
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) fail(what, ": size ", a, " + ", b, " does not fit in 64 bits");
  return out;
}

/// "1.16 TiB", "512 B": a byte count for messages.
inline std::string bytes_str(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) bytes /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

}  // namespace mha
