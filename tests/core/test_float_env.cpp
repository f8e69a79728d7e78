#include <doctest/doctest.h>

#include <cfloat>
#include <cfenv>

#include "k3/core/float_env.hpp"

namespace {
// volatile: the products must happen at run time, under the thread's control state.
float product(float a, float b) {
  volatile float x = a, y = b;
  return x * y;
}
float sum(float a, float b) {
  volatile float x = a, y = b;
  return x + y;
}
}  // namespace

TEST_CASE("subnormals_flushed: flushes inside the scope, restores the caller's state after") {
  using k3::detail::float_env;
  float const tiny = FLT_MIN / 4;  // subnormal
  REQUIRE(product(FLT_MIN, 0.25f) == tiny);
  REQUIRE(sum(tiny, 0.f) == tiny);
  float_env const before = float_env::current();
  {
    k3::detail::subnormals_flushed const flush;
    if constexpr (k3::detail::can_flush_subnormals) {
      CHECK(product(FLT_MIN, 0.25f) == 0.f);  // a subnormal result becomes 0
      CHECK(sum(tiny, 0.f) == 0.f);           // a subnormal operand reads as 0 (x86 DAZ, AArch64 FZ)
      CHECK(product(FLT_MIN, 2.f) == 2 * FLT_MIN);  // normal values are untouched
      CHECK_FALSE(float_env::current() == before);
    }
  }
  CHECK(float_env::current() == before);
  CHECK(product(FLT_MIN, 0.25f) == tiny);
  CHECK(sum(tiny, 0.f) == tiny);
}

TEST_CASE("subnormals_flushed keeps the caller's rounding mode") {
  REQUIRE(std::fesetround(FE_UPWARD) == 0);
  {
    k3::detail::subnormals_flushed const flush;
    CHECK(sum(1.f, FLT_EPSILON / 4) > 1.f);  // still rounding up
  }
  CHECK(sum(1.f, FLT_EPSILON / 4) > 1.f);
  REQUIRE(std::fesetround(FE_TONEAREST) == 0);
  CHECK(sum(1.f, FLT_EPSILON / 4) == 1.f);
}
