// The message of the k3::error that f() throws; "" when it throws nothing. For tests that
// check what an error names.
#pragma once
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

}  // namespace k3::test
