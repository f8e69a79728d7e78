#include <doctest/doctest.h>

#include <utility>

#include "k3/backend/cpu/simd.hpp"
#include "k3/core/tensor.hpp"

TEST_CASE("owning tensor allocates zeroed, aligned storage and hands out views") {
  k3::tensor<float, 3> t({2, 3, 4});
  CHECK(t.size() == 24);
  CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
  for (std::size_t i = 0; i < t.size(); ++i) CHECK(t.data()[i] == 0.f);
  t(1, 2, 3) = 5.f;
  k3::tensor_view<float const, 3> v = t;
  CHECK(v(1, 2, 3) == 5.f);
  CHECK(v.is_contiguous());
}

TEST_CASE("tensor is move-only and moves its storage") {
  k3::tensor<double, 1, k3::cpu::threads<>> a({7}, k3::cpu::threads<>(2));
  double* p = a.data();
  k3::tensor<double, 1, k3::cpu::threads<>> b(std::move(a));
  CHECK(b.data() == p);
  CHECK(a.data() == nullptr);
  static_assert(!std::is_copy_constructible_v<k3::tensor<float, 1>>);
}

TEST_CASE("empty tensors and bad shapes") {
  k3::tensor<float, 2> e({0, 5});
  CHECK(e.size() == 0);
  CHECK(e.view().empty());
  CHECK_THROWS_AS((k3::tensor<float, 2>({-1, 5})), k3::error);
}
