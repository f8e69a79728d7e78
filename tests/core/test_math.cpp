// sigmoid / softplus / silu against long double references, and at the extremes where the
// naive formulas overflow.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "k3/core/math.hpp"

namespace {
long double ref_sigmoid(long double x) { return 1.0L / (1.0L + std::exp(-x)); }
long double ref_softplus(long double x) { return x > 30 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

template <class T>
void check_grid(double rel) {
  for (int k = -4000; k <= 4000; ++k) {
    T x = static_cast<T>(k) / T(40);  // [-100, 100]
    CAPTURE(x);
    long double X = x;
    REQUIRE(double(k3::detail::sigmoid(x)) == doctest::Approx(double(ref_sigmoid(X))).epsilon(rel));
    REQUIRE(double(k3::detail::softplus(x)) == doctest::Approx(double(ref_softplus(X))).epsilon(rel));
    REQUIRE(double(k3::detail::silu(x)) == doctest::Approx(double(X * ref_sigmoid(X))).epsilon(rel));
  }
}
}  // namespace

TEST_CASE_TEMPLATE("math helpers match long double references on [-100, 100]", T, float, double) {
  check_grid<T>(std::is_same_v<T, float> ? 2e-6 : 1e-14);
}

TEST_CASE_TEMPLATE("math helpers stay finite where naive formulas overflow", T, float, double) {
  using k3::detail::sigmoid;
  using k3::detail::silu;
  using k3::detail::softplus;
  T const big = T(1000), inf = std::numeric_limits<T>::infinity();
  CHECK(sigmoid(big) == T(1));
  CHECK(sigmoid(-big) == T(0));
  CHECK(sigmoid(inf) == T(1));
  CHECK(sigmoid(-inf) == T(0));
  CHECK(softplus(big) == big);
  CHECK(softplus(-big) == T(0));
  CHECK(softplus(T(0)) == doctest::Approx(std::log(2.0)));
  CHECK(silu(big) == big);
  CHECK(silu(-big) == T(0));
  CHECK(std::isnan(sigmoid(std::numeric_limits<T>::quiet_NaN())));
  CHECK(std::isnan(softplus(std::numeric_limits<T>::quiet_NaN())));
  // symmetry sigmoid(x) + sigmoid(-x) = 1, and monotonicity
  T prev = T(-1);
  for (int k = -200; k <= 200; ++k) {
    T x = T(k) / T(10);
    REQUIRE(sigmoid(x) + sigmoid(-x) == doctest::Approx(1.0));
    REQUIRE(sigmoid(x) >= prev);
    prev = sigmoid(x);
  }
}
