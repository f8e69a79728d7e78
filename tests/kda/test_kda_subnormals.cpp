// Subnormal handling (k3/core/float_env.hpp): the simd and threads backends flush subnormal
// operands and results, cpu::serial keeps IEEE gradual underflow, and no backend changes the
// caller's floating-point state. One subnormal entry of h0 is the only non-zero input, so
// flushed and unflushed runs differ exactly there.
#include <doctest/doctest.h>

#include <cfloat>
#include <vector>

#include "k3/core/float_env.hpp"
#include "k3/kda.hpp"

namespace {

constexpr k3::index_t K = 16, V = 16;
constexpr float tiny = FLT_MIN / 8;  // subnormal; scale * tiny is too

struct run_result {
  float o, ht, decoded;
};

template <class B>
run_result run(B const& be, k3::kda::algorithm mode) {
  std::vector<float> q(K, 0.f), k(K, 0.f), v(V, 0.f), g(K, 0.f), beta(1, 0.f), o(V, 7.f);
  std::vector<float> h0(K * V, 0.f), ht(K * V, 7.f);
  q[0] = 1.f;
  h0[0] = tiny;  // S[0][0]
  k3::kda::forward_args<float> a;
  a.q = k3::host_view(static_cast<float const*>(q.data()), 1, 1, 1, K);
  a.k = k3::host_view(static_cast<float const*>(k.data()), 1, 1, 1, K);
  a.v = k3::host_view(static_cast<float const*>(v.data()), 1, 1, 1, V);
  a.g = k3::host_view(static_cast<float const*>(g.data()), 1, 1, 1, K);
  a.beta = k3::host_view(static_cast<float const*>(beta.data()), 1, 1, 1);
  a.o = k3::host_view(o.data(), 1, 1, 1, V);
  a.h0 = k3::host_view(static_cast<float const*>(h0.data()), 1, 1, K, V);
  a.ht = k3::host_view(ht.data(), 1, 1, K, V);
  k3::kda::options opt;
  opt.mode = mode;
  k3::kda::forward(be, a, opt);

  std::vector<float> pool = h0, od(V, 7.f);
  std::vector<std::int32_t> slot{0};
  k3::kda::decode_args<float> d;
  d.q = k3::host_view(static_cast<float const*>(q.data()), 1, 1, K);
  d.k = k3::host_view(static_cast<float const*>(k.data()), 1, 1, K);
  d.v = k3::host_view(static_cast<float const*>(v.data()), 1, 1, V);
  d.g = k3::host_view(static_cast<float const*>(g.data()), 1, 1, K);
  d.beta = k3::host_view(static_cast<float const*>(beta.data()), 1, 1);
  d.o = k3::host_view(od.data(), 1, 1, V);
  d.state_pool = k3::host_view(pool.data(), 1, 1, K, V);
  d.slots32 = k3::host_view(static_cast<std::int32_t const*>(slot.data()), 1);
  k3::kda::decode(be, d, opt);
  return {o[0], ht[0], od[0]};
}

template <class B>
void check_backend(B const& be, bool flushes) {
  using k3::detail::float_env;
  for (auto mode : {k3::kda::algorithm::chunk, k3::kda::algorithm::recurrent}) {
    CAPTURE(B::name());
    CAPTURE(int(mode));
    float_env const before = float_env::current();
    run_result const r = run(be, mode);
    CHECK(float_env::current() == before);  // the caller's state is left as it was
    if (flushes && k3::detail::can_flush_subnormals) {
      CHECK(r.o == 0.f);
      CHECK(r.ht == 0.f);
      CHECK(r.decoded == 0.f);
    } else {
      CHECK(r.o == tiny / 4);  // scale = 1/sqrt(16): exact, gradual underflow
      CHECK(r.ht == tiny);
      CHECK(r.decoded == tiny / 4);
    }
  }
}

}  // namespace

TEST_CASE("KDA: the vectorised backends flush subnormals, cpu::serial keeps them") {
  check_backend(k3::cpu::serial{}, false);
  check_backend(k3::cpu::simd<>{}, true);
  check_backend(k3::cpu::threads<>(3), true);
}

TEST_CASE("KDA: a caller that flushes subnormals itself gets them flushed on every backend") {
  k3::detail::subnormals_flushed const flush;
  if (!k3::detail::can_flush_subnormals) return;
  run_result const r = run(k3::cpu::serial{}, k3::kda::algorithm::recurrent);
  CHECK(r.o == 0.f);
  CHECK(r.ht == 0.f);
}
