// The message of the k3::error that f() throws; "" when it throws nothing. For tests that
// check what an error names.
#pragma once
#include <optional>
#include <string>

#include "k3/core/error.hpp"

namespace k3::test {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (k3::error const& e) {
    return e.what();
  }
  return "";
}

// The kind of the k3::error that f() throws; empty when it throws nothing.
template <class F>
std::optional<error_kind> error_kind_of(F&& f) {
  try {
    f();
  } catch (k3::error const& e) {
    return e.kind();
  }
  return std::nullopt;
}

// The argument the k3::error that f() throws names (k3::error::argument()); "" when it throws
// nothing.
template <class F>
std::string argument_of(F&& f) {
  try {
    f();
  } catch (k3::error const& e) {
    return e.argument();
  }
  return "";
}

// Whether an error message reports arguments `a` and `b` (quoted, as k3 names them) overlapping.
inline bool names_overlap(std::string const& e, char const* a, char const* b) {
  return e.find(std::string("'") + a + "'") != std::string::npos && e.find(std::string("'") + b + "'") != std::string::npos &&
         e.find("overlap") != std::string::npos;
}

}  // namespace k3::test
