// Aligned host allocation (run under ASan too: every byte of the request must be usable).
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <new>

#include "k3/core/host_memory.hpp"

using k3::detail::host_alignment;

static_assert(host_alignment >= alignof(std::max_align_t));
static_assert((host_alignment & (host_alignment - 1)) == 0, "a power of two");

TEST_CASE("host_allocate: aligned, usable, nullptr for zero") {
  for (std::size_t n : {1u, 3u, 15u, 16u, 17u, 1000u, 4097u}) {
    CAPTURE(n);
    double* p = k3::detail::host_allocate<double>(n);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % host_alignment == 0);
    std::memset(p, 0xab, n * sizeof(double));
    p[n - 1] = 1.0;
    CHECK(p[n - 1] == 1.0);
    k3::detail::host_deallocate(p, n);
  }
  CHECK(k3::detail::host_allocate<float>(0) == nullptr);
  k3::detail::host_deallocate<float>(nullptr, 0);  // no-op
  char* c = k3::detail::host_allocate<char>(1);
  CHECK(reinterpret_cast<std::uintptr_t>(c) % host_alignment == 0);
  k3::detail::host_deallocate(c, 1);
}

TEST_CASE("host_allocate: sizes that overflow throw bad_alloc instead of wrapping") {
  CHECK_THROWS_AS(k3::detail::host_allocate<double>(std::size_t(-1) / 4), std::bad_alloc);
  CHECK_THROWS_AS(k3::detail::host_allocate<char>(std::size_t(-1) - 10), std::bad_alloc);
}
