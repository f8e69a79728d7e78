// Adversarial API checks (round 4): empty contractions, every backend agreeing, in-place and
// aliasing arguments.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "k3/quant.hpp"

using namespace k3;
using namespace k3::quant;

TEST_CASE("fp8_block_gemm: K = 0 gives C = 0 on every backend (an empty sum)") {
  for (index_t m : {1, 5, 70})
    for (index_t n : {1, 17, 130}) {
      std::vector<std::uint8_t> qa(1), qb(1);
      std::vector<float> sa(1), sb(1);
      auto run = [&](auto const& be) {
        std::vector<float> c(std::size_t(m * n), -7.0f);
        fp8_block_gemm(be, host_view(qa.data(), m, index_t(0)), host_view(sa.data(), m, index_t(0)), host_view(qb.data(), n, index_t(0)),
                       host_view(sb.data(), (n + 127) / 128, index_t(0)), host_view(c.data(), m, n));
        for (float x : c) REQUIRE(x == 0.0f);
      };
      run(cpu::serial{});
      run(cpu::simd<>{});
      run(cpu::threads<>(3));
    }
}
