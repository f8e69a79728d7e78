// k3/core/error.hpp — the exception every host entry point throws on bad input, and the
// helpers that build messages naming the argument and the expected vs actual shape.
#pragma once
#include <charconv>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace k3 {

// Bad arguments: wrong shape, stride, dtype, aliasing, out-of-range index, malformed file.
class error : public std::invalid_argument {
 public:
  explicit error(std::string const& what) : std::invalid_argument("k3: " + what) {}
};

namespace detail {

// The exception f() throws, or null: for argument checks whose failure one process of a
// collective must report to the others before throwing it (every rank then throws instead of
// some of them waiting in the collective).
template <class F>
std::exception_ptr capture_error(F&& f) {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

template <class Range>
std::string format_shape(Range const& r) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (auto v : r) {
    if (!first) os << ", ";
    os << v;
    first = false;
  }
  os << ']';
  return os.str();
}

inline std::string format_shape(std::initializer_list<std::int64_t> r) {
  return format_shape<std::initializer_list<std::int64_t>>(r);
}

// The shortest text that reads back as x, in x's own type ("%g" wrote a gate one ulp below the
// bound -5 as "-5", std::to_string wrote 1e-9 as "0.000000").
template <class Real>
  requires std::is_floating_point_v<Real>
std::string format_number(Real x) {
  char buf[64];
  auto const r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

// Throws k3::error when `cond` is false; the message is built only on failure.
template <class MakeMessage>
  requires std::is_invocable_v<MakeMessage>
inline void require(bool cond, MakeMessage&& make) {
  if (!cond) throw ::k3::error(make());
}

inline void require(bool cond, std::string_view message) {
  if (!cond) throw ::k3::error(std::string(message));
}

}  // namespace detail
}  // namespace k3
