// What the k3::error that f() throws says: for tests that check what an error names.
#pragma once
#include <optional>
#include <string>

#include "k3/core/error.hpp"

namespace k3::test {

// The k3::error that f() throws; empty when it throws nothing. The three below read one
// field of it.
template <class F>
std::optional<k3::error> thrown_error(F&& f) {
  try {
    f();
  } catch (k3::error const& e) {
    return e;
  }
  return std::nullopt;
}

// The message of the error; "" when f() throws nothing.
template <class F>
std::string error_of(F&& f) {
  auto const e = thrown_error(f);
  return e ? std::string(e->what()) : std::string();
}

// The error's kind; empty when f() throws nothing.
template <class F>
std::optional<error_kind> error_kind_of(F&& f) {
  auto const e = thrown_error(f);
  return e ? std::optional<error_kind>(e->kind()) : std::nullopt;
}

// The argument the error names (k3::error::argument()); "" when f() throws nothing.
template <class F>
std::string argument_of(F&& f) {
  auto const e = thrown_error(f);
  return e ? std::string(e->argument()) : std::string();
}

// Whether an error message reports arguments `a` and `b` (quoted, as k3 names them) overlapping.
inline bool names_overlap(std::string const& e, char const* a, char const* b) {
  return e.find(std::string("'") + a + "'") != std::string::npos && e.find(std::string("'") + b + "'") != std::string::npos &&
         e.find("overlap") != std::string::npos;
}

}  // namespace k3::test
