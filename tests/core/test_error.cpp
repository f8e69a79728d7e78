// k3::error and the message helpers every entry point uses.
#include <cmath>
#include <limits>
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/core/error.hpp"

static_assert(std::is_base_of_v<std::invalid_argument, k3::error>);

TEST_CASE("k3::error is an invalid_argument with a k3 prefix") {
  try {
    throw k3::error("argument 'q': bad");
  } catch (std::invalid_argument const& e) {
    CHECK(std::string(e.what()) == "k3: argument 'q': bad");
  }
}

TEST_CASE("format_number prints the shortest text that reads back, in the value's own type") {
  using k3::detail::format_number;
  double const below = std::nextafter(-5.0, -6.0);  // one ulp below a bound must not print as the bound
  CHECK(format_number(below) != "-5");
  CHECK(std::stod(format_number(below)) == below);
  CHECK(format_number(-5.0) == "-5");
  CHECK(format_number(1e-9f) == "1e-09");  // float: not the double 9.99999971718e-10
  CHECK(format_number(0.1) == "0.1");
  CHECK(format_number(std::numeric_limits<double>::infinity()) == "inf");
}

TEST_CASE("format_shape prints any range of extents") {
  CHECK(k3::detail::format_shape({2, 3, 4}) == "[2, 3, 4]");
  CHECK(k3::detail::format_shape(std::vector<long>{}) == "[]");
  CHECK(k3::detail::format_shape(std::vector<long>{-1}) == "[-1]");
}

TEST_CASE("require builds its message only on failure") {
  int built = 0;
  auto make = [&] {
    ++built;
    return std::string("argument 'x': expected 1, got 2");
  };
  CHECK_NOTHROW(k3::detail::require(true, make));
  CHECK(built == 0);
  CHECK_THROWS_WITH_AS(k3::detail::require(false, make), "k3: argument 'x': expected 1, got 2", k3::error);
  CHECK(built == 1);
  CHECK_THROWS_WITH_AS(k3::detail::require(false, "plain message"), "k3: plain message", k3::error);
  CHECK_NOTHROW(k3::detail::require(true, "plain message"));
}
