#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
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

TEST_CASE("simd backend: aligned allocation, in-order for_each, a vector loop over its memory") {
  k3::cpu::simd<> b;
  std::size_t const n = 1000;
  float* p = b.allocate<float>(n);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
  b.for_each(0, std::int64_t(n), [&](std::int64_t i) { p[i] = float(i % 7); });
  using batch = xsimd::batch<float>;
  std::size_t const vec = n - n % batch::size;
  batch acc(0.f);
  for (std::size_t i = 0; i < vec; i += batch::size) acc += batch::load_aligned(p + i);
  float s = k3::simd::reduce_add(acc);
  for (std::size_t i = vec; i < n; ++i) s += p[i];
  double ref = 0;
  for (std::size_t i = 0; i < n; ++i) ref += double(i % 7);
  CHECK(s == doctest::Approx(ref));
  b.deallocate(p, n);
  static_assert(k3::cpu::simd<>::concurrency() == 1);
  static_assert(std::is_same_v<k3::cpu::simd<>::arch_type, xsimd::default_arch>);
}

TEST_CASE("threads backend: shared pools, dynamic tasks, exceptions, bad pool") {
  auto pool = std::make_shared<k3::cpu::thread_pool>(3);
  k3::cpu::threads<> a(pool);
  k3::cpu::threads<> b = a;  // copies share the pool
  CHECK(&a.pool() == &b.pool());
  CHECK(a.concurrency() == 3);
  std::vector<std::atomic<int>> hits(50);
  b.for_each_task(50, [&](std::int64_t i) { hits[std::size_t(i)]++; });
  for (auto& h : hits) REQUIRE(h.load() == 1);
  std::atomic<std::int64_t> sum{0};
  a.for_each(-5, 5, [&](std::int64_t i) { sum += i; });
  CHECK(sum.load() == -5);
  CHECK_THROWS_AS(a.for_each(0, 100,
                             [&](std::int64_t i) {
                               if (i == 50) throw k3::error(k3::error_kind::value, "task failed");
                             }),
                  k3::error);
  CHECK_THROWS_AS(k3::cpu::threads<>(std::shared_ptr<k3::cpu::thread_pool>{}), k3::error);
  CHECK(k3::cpu::threads<>().concurrency() >= 1);  // default: one per hardware thread
}
