#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/backend/cpu/serial.hpp"

TEST_CASE("serial backend allocates aligned memory and runs in order") {
  k3::cpu::serial b;
  float* p = b.allocate<float>(100);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
  std::vector<std::int64_t> order;
  b.for_each(3, 8, [&](std::int64_t i) { order.push_back(i); });
  CHECK(order == std::vector<std::int64_t>{3, 4, 5, 6, 7});
  b.for_each(5, 5, [&](std::int64_t) { FAIL("empty range ran"); });
  b.deallocate(p, 100);
  CHECK(b.allocate<float>(0) == nullptr);
}

static_assert(k3::HostBackend<k3::cpu::serial>);
static_assert(k3::cpu::serial::concurrency() == 1);
static_assert(std::is_trivially_copyable_v<k3::cpu::serial> && std::is_empty_v<k3::cpu::serial>);

TEST_CASE("serial backend: negative offsets, reversed ranges, exceptions propagate") {
  k3::cpu::serial b;
  std::int64_t sum = 0;
  b.for_each(-3, 2, [&](std::int64_t i) { sum += i; });
  CHECK(sum == -5);
  b.for_each(4, 1, [&](std::int64_t) { FAIL("reversed range ran"); });
  int ran = 0;
  CHECK_THROWS_AS(b.for_each(0, 10,
                             [&](std::int64_t i) {
                               ++ran;
                               if (i == 2) throw std::runtime_error("stop");
                             }),
                  std::runtime_error);
  CHECK(ran == 3);  // serial stops at the throw
  CHECK_THROWS_AS(b.allocate<double>(std::size_t(-1) / 2), std::bad_alloc);
  CHECK(std::string(k3::cpu::serial::name()) == "cpu::serial");
}
