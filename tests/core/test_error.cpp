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
    throw k3::error(k3::error_kind::value, "argument 'q': bad");
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
  CHECK_NOTHROW(k3::detail::require(true, k3::error_kind::value, make));
  CHECK(built == 0);
  CHECK_THROWS_WITH_AS(k3::detail::require(false, k3::error_kind::value, make), "k3: argument 'x': expected 1, got 2", k3::error);
  CHECK(built == 1);
  CHECK_THROWS_WITH_AS(k3::detail::require(false, k3::error_kind::value, "plain message"), "k3: plain message", k3::error);
  CHECK_NOTHROW(k3::detail::require(true, k3::error_kind::value, "plain message"));
}

TEST_CASE("k3::error carries its kind, the argument its message opens with, and what it says about it") {
  k3::error const shape(k3::error_kind::shape, "argument 'q': expected shape [2], got [3]");
  CHECK(shape.kind() == k3::error_kind::shape);
  CHECK(shape.argument() == "q");
  CHECK(shape.subject() == "argument");
  CHECK(shape.detail() == ": expected shape [2], got [3]");
  CHECK(shape.message() == "argument 'q': expected shape [2], got [3]");

  k3::error const option(k3::error_kind::value, "option 'chunk_size' must be >= 1, got 0");
  CHECK(option.argument() == "chunk_size");
  CHECK(option.subject() == "option");
  CHECK(option.detail() == " must be >= 1, got 0");

  k3::error const output(k3::error_kind::shape, "output 'o': shape [1] has more elements than can be addressed");
  CHECK(output.argument() == "o");
  CHECK(output.subject() == "output");

  // Two arguments: the first is the subject; the detail keeps the whole message, which names the second.
  k3::error const overlap(k3::error_kind::aliasing, "arguments 'o' and 'q' overlap in memory");
  CHECK(overlap.argument() == "o");
  CHECK(overlap.detail() == "arguments 'o' and 'q' overlap in memory");
  k3::error const options(k3::error_kind::value, "options 'a', 'b', 'c': the coefficients must be finite");
  CHECK(options.argument() == "a");
  CHECK(options.subject() == "option");
  CHECK(options.detail() == options.message());

  // About no single argument, or naming one later: no argument, the detail is the message.
  for (char const* m : {"block_config: d must be >= 1, got 0", "recv from rank 1: expected 3 elements", "argument without a quote",
                        "malformed .npy file: bad magic string"}) {
    CAPTURE(m);
    k3::error const e(k3::error_kind::io, m);
    CHECK(e.argument().empty());
    CHECK(e.subject().empty());
    CHECK(e.detail() == m);
    CHECK(e.kind() == k3::error_kind::io);
  }
  // After an operation's name: the detail leaves the name out.
  k3::error const after_op(k3::error_kind::shape, "train_step: argument 'params': expected 3 tensors");
  CHECK(after_op.argument() == "params");
  CHECK(after_op.detail() == ": expected 3 tensors");
  k3::error const after_scoped_op(k3::error_kind::value, "cuda::launch: argument 'kernel' is null");
  CHECK(after_scoped_op.argument() == "kernel");
  CHECK(after_scoped_op.detail() == " is null");
  k3::error const two_words(k3::error_kind::value, "ambiguous input: argument 'x' twice");
  CHECK(two_words.argument().empty());
  k3::error const unclosed(k3::error_kind::value, "argument 'q: no closing quote");
  CHECK(unclosed.argument().empty());
  CHECK(unclosed.detail() == "argument 'q: no closing quote");
}

TEST_CASE("every error kind has a name") {
  using K = k3::error_kind;
  std::vector<std::string> names;
  for (K k : {K::shape, K::dtype, K::value, K::aliasing, K::io, K::unsupported}) names.emplace_back(k3::error_kind_name(k));
  CHECK(names == std::vector<std::string>{"shape", "dtype", "value", "aliasing", "io", "unsupported"});
  static_assert(std::string_view(k3::error_kind_name(K::aliasing)) == "aliasing");
}

TEST_CASE("require passes the kind on") {
  try {
    k3::detail::require(false, k3::error_kind::dtype, [] { return std::string("argument 'x': expected float32, got int8"); });
    FAIL("require(false, ...) did not throw");
  } catch (k3::error const& e) {
    CHECK(e.kind() == k3::error_kind::dtype);
    CHECK(e.argument() == "x");
  }
}
