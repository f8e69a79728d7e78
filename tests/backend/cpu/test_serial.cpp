#include <doctest/doctest.h>

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
