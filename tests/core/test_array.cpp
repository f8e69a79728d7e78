// k3::array: std::array's job with K3_HD accessors. Mostly compile-time.
#include <doctest/doctest.h>

#include <cstdint>
#include <type_traits>

#include "k3/core/array.hpp"

using k3::array;

static_assert(std::is_trivially_copyable_v<array<std::int64_t, 4>>);
static_assert(std::is_standard_layout_v<array<std::int64_t, 4>>);
static_assert(std::is_aggregate_v<array<int, 3>>);
static_assert(sizeof(array<std::int64_t, 4>) == 4 * sizeof(std::int64_t));
static_assert(array<int, 3>::size() == 3);
static_assert(array<int, 0>::size() == 0);

constexpr int sum_of(array<int, 4> a) {
  int s = 0;
  for (int v : a) s += v;
  return s;
}
static_assert(sum_of({1, 2, 3, 4}) == 10);

constexpr bool mutate_and_compare() {
  array<int, 3> a{1, 2, 3}, b{1, 2, 3};
  if (!(a == b)) return false;
  a[1] = 7;
  *a.data() = 5;
  return !(a == b) && a[0] == 5 && a[1] == 7 && a.end() - a.begin() == 3;
}
static_assert(mutate_and_compare());

constexpr bool empty_array() {
  array<int, 0> e{};
  array<int, 0> f{};
  return e.begin() == e.end() && e == f;  // rank-0 views rely on this
}
static_assert(empty_array());

TEST_CASE("array: value semantics and iteration at run time") {
  array<double, 3> a{0.5, 1.5, 2.5};
  array<double, 3> b = a;
  b[2] = -1;
  CHECK(a[2] == 2.5);
  CHECK_FALSE(a == b);
  double s = 0;
  for (double v : a) s += v;
  CHECK(s == 4.5);
  array<double, 3> const& c = a;
  CHECK(c.data() == &a[0]);
  CHECK(c.end() - c.begin() == 3);
}
