#include <doctest/doctest.h>

#include <string>
#include <type_traits>
#include <vector>

#include "k3/core/validate.hpp"

using k3::detail::any_extent;

TEST_CASE("check_shape names the argument and both shapes") {
  std::vector<float> buf(2 * 3 * 4);
  k3::tensor_view<float, 3> v(buf.data(), {2, 3, 4});
  CHECK_NOTHROW(k3::detail::check_shape("q", v, {2, 3, 4}));
  CHECK_NOTHROW(k3::detail::check_shape("q", v, {any_extent, 3, any_extent}));
  try {
    k3::detail::check_shape("q", v, {2, 3, 5});
    FAIL("no throw");
  } catch (k3::error const& e) {
    std::string m = e.what();
    CHECK(m.find("'q'") != std::string::npos);
    CHECK(m.find("[2, 3, 5]") != std::string::npos);
    CHECK(m.find("[2, 3, 4]") != std::string::npos);
  }
  CHECK_THROWS_AS(k3::detail::check_shape("q", v, {2, 3}), k3::error);
}

TEST_CASE("overlap, null data and stride checks") {
  std::vector<float> buf(100);
  k3::tensor_view<float, 1> a(buf.data(), {50});
  k3::tensor_view<float, 1> b(buf.data() + 49, {10});
  k3::tensor_view<float, 1> c(buf.data() + 50, {10});
  CHECK_THROWS_AS(k3::detail::check_no_overlap("a", a, "b", b), k3::error);
  CHECK_NOTHROW(k3::detail::check_no_overlap("a", a, "c", c));
  k3::tensor_view<float, 1> empty(buf.data(), {0});
  CHECK_NOTHROW(k3::detail::check_no_overlap("a", a, "empty", empty));
  k3::tensor_view<float, 1> null(nullptr, {3});
  CHECK_THROWS_AS(k3::detail::check_view("null", null), k3::error);
  k3::tensor_view<float, 2> strided(buf.data(), {5, 5}, {10, 2});
  CHECK_THROWS_AS(k3::detail::check_inner_contiguous("s", strided), k3::error);
  k3::tensor_view<float, 2> neg(buf.data() + 50, {5, 5}, {-5, 1});
  CHECK_THROWS_AS(k3::detail::check_view("neg", neg), k3::error);
}

TEST_CASE("flat_view: the n elements at a pointer, empty for null (raw-pointer launchers' overlap checks)") {
  std::vector<float> buf(100);
  auto a = k3::detail::flat_view(buf.data(), 50);
  CHECK(a.extent(0) == 50);
  CHECK(a.data_handle() == buf.data());
  CHECK_THROWS_AS(k3::detail::check_no_overlap("a", a, "b", k3::detail::flat_view(buf.data() + 49, 10)), k3::error);
  CHECK_NOTHROW(k3::detail::check_no_overlap("a", a, "c", k3::detail::flat_view(buf.data() + 50, 10)));
  float* none = nullptr;
  CHECK(k3::detail::flat_view(none, 10).size() == 0);  // an absent argument overlaps nothing
  CHECK_NOTHROW(k3::detail::check_no_overlap("none", k3::detail::flat_view(none, 10), "also none", k3::detail::flat_view(none, 20)));
  static_assert(std::is_same_v<decltype(k3::detail::flat_view<k3::cuda_device_space>(buf.data(), 1)),
                               k3::tensor_view<float, 1, k3::cuda_device_space>>);
}
