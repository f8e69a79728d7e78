// The serial recurrence (the reference): gradients against central finite differences in
// double, on small awkward shapes (T = 1, grouped value heads, packed sequences with an empty
// one, resets), plus a hand-checked single step.
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "kda/kda_fixture.hpp"

using namespace k3;
using namespace k3::test;

namespace {

// loss = sum(o * do) + sum(ht * dht)
double loss(kda_data64 const& d) {
  typed_data<double> td(d);
  auto r = run_forward(td, kda::algorithm::recurrent);
  double l = 0;
  for (std::size_t i = 0; i < r.o.size(); ++i) l += r.o[i] * d.d_o[i];
  if (!d.dht.empty())
    for (std::size_t i = 0; i < r.ht.size(); ++i) l += r.ht[i] * d.dht[i];
  return l;
}

void check_fd(kda_case c) {
  kda_data64 d = make_data(c);
  typed_data<double> td(d);
  auto gr = run_backward(td, kda::algorithm::recurrent);
  std::mt19937_64 rng(c.seed + 100);
  double const eps = 1e-6;
  auto probe = [&](char const* name, std::vector<double> kda_data64::*field, std::vector<double> const& grad) {
    std::vector<double>& x = d.*field;
    if (x.empty()) return;
    int const probes = std::min<int>(12, int(x.size()));
    for (int p = 0; p < probes; ++p) {
      std::size_t i = std::uniform_int_distribution<std::size_t>(0, x.size() - 1)(rng);
      if (d.c.gate == gate_kind::resets && field == &kda_data64::g && x[i] < -100) continue;
      double const x0 = x[i];
      x[i] = x0 + eps;
      double lp = loss(d);
      x[i] = x0 - eps;
      double lm = loss(d);
      x[i] = x0;
      double fd = (lp - lm) / (2 * eps);
      INFO(name << "[" << i << "] analytic " << grad[i] << " fd " << fd);
      CHECK(std::abs(fd - grad[i]) <= 1e-6 * (1 + std::abs(fd)));
    }
  };
  probe("q", &kda_data64::q, gr.dq);
  probe("k", &kda_data64::k, gr.dk);
  probe("v", &kda_data64::v, gr.dv);
  probe("g", &kda_data64::g, gr.dg);
  probe("beta", &kda_data64::beta, gr.dbeta);
  probe("h0", &kda_data64::h0, gr.dh0);
}

}  // namespace

TEST_CASE("recurrent backward matches finite differences (double)") {
  SUBCASE("T=1") { check_fd({.B = 2, .T = 1, .H = 1, .HV = 2, .K = 5, .V = 3, .seed = 3}); }
  SUBCASE("T=9 GVA") { check_fd({.B = 1, .T = 9, .H = 2, .HV = 4, .K = 6, .V = 5, .seed = 4}); }
  SUBCASE("checkpoint segments") { check_fd({.B = 1, .T = 70, .H = 1, .HV = 1, .K = 4, .V = 3, .seed = 5}); }
  SUBCASE("varlen with empty sequence, no dht") {
    check_fd({.B = 1, .T = 11, .H = 1, .HV = 2, .K = 4, .V = 4, .cu = {0, 3, 3, 11}, .dht = false, .seed = 6});
  }
  SUBCASE("no h0, resets") {
    check_fd({.B = 1, .T = 12, .H = 1, .HV = 1, .K = 5, .V = 4, .h0 = false, .gate = gate_kind::resets, .seed = 7});
  }
}

TEST_CASE("one recurrent step by hand") {
  // K = V = 1: S' = e^g S0, u = beta (v - S' k), S1 = S' + k u, o = S1 * scale * q.
  double q = 0.7, k = -0.4, v = 1.3, g = -0.2, beta = 0.6, s0 = 0.9, scale = 0.5;
  double sp = std::exp(g) * s0, u = beta * (v - sp * k), s1 = sp + k * u, o_ref = s1 * scale * q;
  double o = 0, ht = 0;
  kda::forward_args<double> a{.q = host_view(&q, 1, 1, 1, 1), .k = host_view(&k, 1, 1, 1, 1), .v = host_view(&v, 1, 1, 1, 1),
                              .g = host_view(&g, 1, 1, 1, 1), .beta = host_view(&beta, 1, 1, 1), .o = host_view(&o, 1, 1, 1, 1),
                              .h0 = host_view(&s0, 1, 1, 1, 1), .ht = host_view(&ht, 1, 1, 1, 1)};
  kda::options opt;
  opt.scale = scale;
  opt.mode = kda::algorithm::recurrent;
  kda::forward(cpu::serial{}, a, opt);
  CHECK(o == doctest::Approx(o_ref).epsilon(1e-15));
  CHECK(ht == doctest::Approx(s1).epsilon(1e-15));
  opt.mode = kda::algorithm::chunk;
  kda::forward(cpu::serial{}, a, opt);
  CHECK(o == doctest::Approx(o_ref).epsilon(1e-15));
  CHECK(ht == doctest::Approx(s1).epsilon(1e-15));
}
