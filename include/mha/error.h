// mha/error.h — the one exception type the library throws, and helpers that name shapes.
#pragma once

#include <cstdint>
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

}  // namespace mha
