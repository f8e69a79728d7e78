#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "k3/backend/cpu/simd.hpp"

TEST_CASE("the reduce_add shim sums every lane") {
  using batch = xsimd::batch<float>;
  std::vector<float> v(batch::size);
  std::iota(v.begin(), v.end(), 1.f);
  auto b = batch::load_unaligned(v.data());
  float n = float(batch::size);
  CHECK(k3::simd::reduce_add(b) == doctest::Approx(n * (n + 1) / 2));
  using dbatch = xsimd::batch<double>;
  std::vector<double> d(dbatch::size, 0.25);
  CHECK(k3::simd::reduce_add(dbatch::load_unaligned(d.data())) == doctest::Approx(0.25 * dbatch::size));
}

TEST_CASE("the ISA name is reported") {
  CHECK(std::strlen(k3::simd::isa_name<xsimd::default_arch>()) > 0);
}

TEST_CASE("threads backend covers the range exactly once") {
  for (int nt : {1, 2, 3, 8}) {
    k3::cpu::threads<> b(nt);
    CHECK(b.concurrency() == nt);
    for (std::int64_t n : {0, 1, 2, 7, 1000}) {
      std::vector<int> hits(static_cast<std::size_t>(n), 0);
      b.for_each(0, n, [&](std::int64_t i) { ++hits[static_cast<std::size_t>(i)]; });
      for (int h : hits) REQUIRE(h == 1);
    }
  }
}
