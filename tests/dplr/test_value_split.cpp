// The value split (one long sequence, the V state columns split across threads) against the
// single-thread run: 1..5 threads, V odd and not a multiple of the SIMD width, float and double.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "dplr/dplr_test_util.hpp"

using namespace dplr_test;

namespace {

template <class X>
bool same_bits(std::vector<X> const& x, std::vector<X> const& y) {
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(X)) == 0);
}

struct shape {
  index_t T, K, V, chunk;
};
// V: 1, odd, one past a float / double batch, primes across two batches; T = 1, T < chunk,
// T not a multiple of the chunk; K odd too.
shape const shapes[] = {{1, 5, 3, 16}, {45, 7, 1, 16}, {97, 12, 17, 16}, {130, 9, 33, 32}, {300, 24, 37, 64}, {200, 16, 9, 64}};

template <class T>
void check_threads(std::mt19937_64& rng) {
  for (auto const& s : shapes) {
    auto p = make<T>(rng, 1, s.T, 1, s.K, s.V);
    auto o = p.options(s.chunk);
    o.long_sequence = k3::dplr::sequence_split::value_split;
    auto dO = randn<T>(rng, p.nv());
    auto dht = randn<k3::dplr::state_t<T>>(rng, p.ns());
    auto f1 = run_fwd(p, chunked_fwd(k3::cpu::threads<>(1), o));
    auto g1 = run_bwd(p, dO, dht, chunked_bwd(k3::cpu::threads<>(1), o));
    CHECK(max_err(f1, run_fwd(p, recurrent_fwd(o))) < (sizeof(T) == 4 ? 1e-4 : 1e-11));
    // the serial backend runs the same per-chunk code on the whole width
    CHECK(same_bits(run_fwd(p, chunked_fwd(k3::cpu::serial{}, o)).o, f1.o));
    CHECK(same_bits(run_bwd(p, dO, dht, chunked_bwd(k3::cpu::serial{}, o)).dq, g1.dq));
    // the maps of the span split their K + V columns the same way
    using S = k3::dplr::state_t<T>;
    auto in = p.inputs();
    auto dOv = k3::host_view(static_cast<T const*>(dO.data()), index_t(1), s.T, index_t(1), s.V);
    auto maps = [&](auto const& bk, bool transposed) {
      std::vector<S> M(static_cast<std::size_t>(s.K * s.K)), N(static_cast<std::size_t>(s.K * s.V));
      auto Mv = k3::host_view(M.data(), 1, 1, s.K, s.K);
      auto Nv = k3::host_view(N.data(), 1, 1, s.K, s.V);
      if (transposed) k3::dplr::segment_maps_transposed(bk, transposed_maps_of(in, dOv, Mv, Nv), o);
      else k3::dplr::segment_maps(bk, maps_of(in, Mv, Nv), o);
      M.insert(M.end(), N.begin(), N.end());
      return M;
    };
    auto m1 = maps(k3::cpu::threads<>(1), false), mt1 = maps(k3::cpu::threads<>(1), true);
    for (int nt = 2; nt <= 5; ++nt) {
      INFO(sizeof(T) * 8 << "-bit, threads=" << nt << " T=" << s.T << " K=" << s.K << " V=" << s.V << " chunk=" << s.chunk);
      k3::cpu::threads<> th(nt);
      auto f = run_fwd(p, chunked_fwd(th, o));
      CHECK(same_bits(f.o, f1.o));
      CHECK(same_bits(f.ht, f1.ht));
      auto g = run_bwd(p, dO, dht, chunked_bwd(th, o));
      for (auto const& e : {std::tuple{"dq", &g.dq, &g1.dq}, {"dk", &g.dk, &g1.dk}, {"dv", &g.dv, &g1.dv}, {"da", &g.da, &g1.da},
                            {"db", &g.db, &g1.db}, {"dgk", &g.dgk, &g1.dgk}}) {
        INFO(std::get<0>(e));  // not a structured binding: clang 14 cannot capture one in INFO's lambda
        CHECK(same_bits(*std::get<1>(e), *std::get<2>(e)));
      }
      CHECK(same_bits(g.dh0, g1.dh0));
      CHECK(same_bits(maps(th, false), m1));
      CHECK(same_bits(maps(th, true), mt1));
    }
  }
}

}  // namespace

TEST_CASE("value split: 1..5 threads give the single-thread outputs and gradients") {
  std::mt19937_64 rng(71);
  check_threads<float>(rng);
  check_threads<double>(rng);
}
