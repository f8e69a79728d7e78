// Subnormal handling (k3/core/float_env.hpp): DPLR's chunk forms flush subnormal operands and
// results on every backend, the recurrent reference keeps IEEE gradual underflow, and neither
// changes the caller's floating-point state. One subnormal entry of h0 is the only non-zero
// input, so flushed and unflushed runs differ exactly there.
#include <doctest/doctest.h>

#include <cfloat>
#include <vector>

#include "k3/core/float_env.hpp"
#include "k3/dplr.hpp"

namespace {

constexpr k3::index_t K = 16, V = 16;
constexpr float tiny = FLT_MIN / 8;

struct problem {
  std::vector<float> q = std::vector<float>(K, 0.f), zk = std::vector<float>(K, 0.f), zv = std::vector<float>(V, 0.f);
  std::vector<float> h0 = std::vector<float>(K * V, 0.f), o = std::vector<float>(V, 7.f), ht = std::vector<float>(K * V, 7.f);
  problem() {
    q[0] = 1.f;
    h0[0] = tiny;
  }
  k3::dplr::forward_args<float> args() {
    auto k4 = [](std::vector<float> const& x, k3::index_t D) { return k3::host_view(x.data(), 1, 1, 1, D); };
    return {k4(q, K),  k4(zk, K), k4(zv, V), k4(zk, K), k4(zk, K), k4(zk, K), k3::host_view(h0.data(), 1, 1, K, V),
            k3::host_view(o.data(), 1, 1, 1, V), k3::host_view(ht.data(), 1, 1, K, V)};
  }
};

}  // namespace

TEST_CASE("DPLR: chunk forms flush subnormals on every backend, the recurrent reference keeps them") {
  using k3::detail::float_env;
  float_env const before = float_env::current();
  {
    problem p;
    k3::dplr::forward(k3::cpu::serial{}, p.args(), {.mode = k3::dplr::algorithm::recurrent});
    CHECK(p.o[0] == tiny / 4);  // scale = 1/sqrt(16)
    CHECK(p.ht[0] == tiny);
  }
  auto chunked = [&](auto const& be) {
    CAPTURE(be.name());
    problem p;
    k3::dplr::forward(be, p.args());
    CHECK(float_env::current() == before);
    if (k3::detail::can_flush_subnormals) {
      CHECK(p.o[0] == 0.f);
      CHECK(p.ht[0] == 0.f);
    } else {
      CHECK(p.o[0] == tiny / 4);
    }
  };
  chunked(k3::cpu::serial{});
  chunked(k3::cpu::simd<>{});
  chunked(k3::cpu::threads<>(2));
  CHECK(float_env::current() == before);
}
