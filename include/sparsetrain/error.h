// sparsetrain::Error and the checks that raise it. A bad argument raises an Error whose message
// names the argument, what was expected and what came; operations validate everything before they
// write any output, so a raised Error leaves every output as it was.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace sparsetrain {

class Error : public std::runtime_error {
 public:
  enum class Kind { kInvalidArgument, kRuntime };
  Error(Kind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

namespace detail {
inline void stream_all(std::ostream&) {}
template <typename T, typename... Rest>
void stream_all(std::ostream& os, const T& v, const Rest&... rest) {
  os << v;
  stream_all(os, rest...);
}
template <typename... Args>
[[noreturn]] void throw_arg_error(const char* arg, const std::string& expected, const Args&... got) {
  std::ostringstream os;
  os << arg << ": expected " << expected << ", got ";
  stream_all(os, got...);
  throw Error(Error::Kind::kInvalidArgument, os.str());
}
template <typename... Args>
[[noreturn]] void throw_runtime_error(const Args&... what) {
  std::ostringstream os;
  stream_all(os, what...);
  throw Error(Error::Kind::kRuntime, os.str());
}
}  // namespace detail

}  // namespace sparsetrain

// ST_CHECK_ARG(cond, "x", "dtype bf16 or fp16", "fp32") -> Error "x: expected dtype bf16 or fp16, got fp32".
#define ST_CHECK_ARG(cond, arg, expected, ...)                                        \
  do {                                                                                \
    if (!(cond)) ::sparsetrain::detail::throw_arg_error((arg), (expected), __VA_ARGS__); \
  } while (0)

#define ST_FAIL(...) ::sparsetrain::detail::throw_runtime_error(__VA_ARGS__)
