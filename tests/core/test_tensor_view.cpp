#include <doctest/doctest.h>

#include <numeric>
#include <type_traits>
#include <vector>

#include "k3/core/tensor_view.hpp"

using k3::index_t;
using k3::tensor_view;

// Views travel by value into kernels: they must stay trivially copyable and standard layout.
static_assert(std::is_trivially_copyable_v<tensor_view<float, 4>>);
static_assert(std::is_standard_layout_v<tensor_view<float, 4>>);
static_assert(std::is_trivially_copyable_v<tensor_view<double const, 1, k3::cuda_device_space>>);
static_assert(tensor_view<float, 3>::rank() == 3);
// const-correctness: T -> const T converts, the reverse does not.
static_assert(std::is_convertible_v<tensor_view<float, 2>, tensor_view<float const, 2>>);
static_assert(!std::is_convertible_v<tensor_view<float const, 2>, tensor_view<float, 2>>);
// spaces are part of the type: no silent host/device conversion.
static_assert(!std::is_convertible_v<tensor_view<float, 2, k3::cuda_device_space>, tensor_view<float, 2>>);

// constexpr use: index arithmetic of a row-major view.
constexpr index_t constexpr_offset() {
  double buf[24] = {};
  tensor_view<double, 3> v(buf, {2, 3, 4});
  return &v(1, 2, 3) - buf;
}
static_assert(constexpr_offset() == 23);

TEST_CASE("row-major strides, extents and element access") {
  std::vector<int> buf(2 * 3 * 5);
  std::iota(buf.begin(), buf.end(), 0);
  tensor_view<int, 3> v(buf.data(), {2, 3, 5});
  CHECK(v.extent(0) == 2);
  CHECK(v.extent(2) == 5);
  CHECK(v.stride(0) == 15);
  CHECK(v.stride(1) == 5);
  CHECK(v.stride(2) == 1);
  CHECK(v.size() == 30);
  CHECK(v.is_contiguous());
  CHECK(v(1, 2, 4) == 29);
  CHECK(v(0, 1, 0) == 5);
}

TEST_CASE("slice and sub keep strides") {
  std::vector<int> buf(4 * 6);
  std::iota(buf.begin(), buf.end(), 0);
  tensor_view<int, 2> m(buf.data(), {4, 6});
  auto col = m.slice(1, 2);  // column 2
  CHECK(col.rank() == 1);
  CHECK(col.extent(0) == 4);
  CHECK(col.stride(0) == 6);
  CHECK(col(3) == 3 * 6 + 2);
  auto rows = m.sub(0, 1, 2);
  CHECK(rows.extent(0) == 2);
  CHECK(rows(0, 0) == 6);
  CHECK(rows.is_contiguous());
  auto cols = m.sub(1, 1, 3);
  CHECK_FALSE(cols.is_contiguous());
  CHECK(cols(1, 0) == 7);
}

TEST_CASE("custom strides, broadcast and empty views") {
  float x = 3.f;
  tensor_view<float, 2> b(&x, {5, 7}, {0, 0});
  CHECK(b(4, 6) == 3.f);
  CHECK_FALSE(b.is_contiguous());
  tensor_view<float, 2> e(nullptr, {0, 7});
  CHECK(e.empty());
  CHECK(e.size() == 0);
  auto h = k3::host_view(&x, 1, 1);
  CHECK(h(0, 0) == 3.f);
}
