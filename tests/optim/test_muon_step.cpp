// k3::optim::step: Moonlight's and Keller's Muon rules and AdamW against the formulas of spec
// C.3 written out in float64 (the NS5 inside is the one test_newton_schulz checks), Per-Head
// Muon, bfloat16 storage, and checks that run before anything is updated.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/optim/muon.hpp"
#include "support/error_of.hpp"
#include "support/random.hpp"

namespace optim = k3::optim;
using k3::test::gaussian;
using k3::index_t;

namespace {

std::vector<double> ns5(std::vector<double> const& u, index_t A, index_t B, index_t heads = 1) {
  std::vector<double> o(u.size());
  optim::newton_schulz(k3::cpu::serial{}, optim::newton_schulz_args<double>{{u.data(), {A, B}}, {o.data(), {A, B}}}, {.heads = heads});
  return o;
}

double max_abs(std::vector<double> const& a, std::vector<double> const& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::isfinite(a[i]) ? std::abs(a[i] - b[i]) : INFINITY);
  return m;
}

}  // namespace

TEST_CASE("Muon step (Moonlight and Keller, Nesterov on and off, per head) equals the formulas in float64") {
  index_t const A = 24, B = 40;
  for (auto variant : {optim::muon_variant::moonlight, optim::muon_variant::keller})
    for (bool nesterov : {true, false})
      for (index_t heads : {index_t(1), index_t(3)}) {
        CAPTURE(nesterov);
        CAPTURE(heads);
        auto p = gaussian(static_cast<std::size_t>(A * B), 1), g = gaussian(p.size(), 2), buf = gaussian(p.size(), 3, 0.1);
        auto p0 = p, buf0 = buf;
        optim::step_options o;
        o.muon = {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.1, .nesterov = nesterov, .variant = variant};
        optim::parameter<double> prm{{p.data(), {A, B}}, {g.data(), {A, B}}, {buf.data(), {A, B}}};
        prm.heads = heads;
        optim::step(k3::cpu::threads<>(2), optim::step_args<double>{{&prm, 1}}, o);
        // The rule, written out.
        bool const keller = variant == optim::muon_variant::keller;
        std::vector<double> u(p.size());
        for (std::size_t i = 0; i < p.size(); ++i) {
          buf0[i] = keller ? 0.9 * buf0[i] + 0.1 * g[i] : 0.9 * buf0[i] + g[i];
          u[i] = nesterov ? (keller ? 0.1 * g[i] + 0.9 * buf0[i] : g[i] + 0.9 * buf0[i]) : buf0[i];
        }
        auto const O = ns5(u, A, B, heads);
        double const scale = keller ? 1.0 : 0.2 * std::sqrt(40.0);  // Keller: sqrt(max(1, A/B)) = 1 here
        for (std::size_t i = 0; i < p.size(); ++i) p0[i] = p0[i] * (1 - 0.05 * 0.1) - 0.05 * scale * O[i];
        CHECK(max_abs(buf, buf0) < 1e-15);
        CHECK(max_abs(p, p0) < 1e-14);
      }
}

TEST_CASE("Keller's scale is sqrt(max(1, A / B)): a tall matrix gets sqrt(A / B)") {
  index_t const A = 50, B = 8;
  auto p = gaussian(static_cast<std::size_t>(A * B), 4), g = gaussian(p.size(), 5);
  std::vector<double> buf(p.size(), 0.0);
  auto const p0 = p;
  optim::step_options o;
  o.muon = {.lr = 0.01, .momentum = 0.95, .weight_decay = 0.0, .nesterov = false, .variant = optim::muon_variant::keller};
  optim::parameter<double> prm{{p.data(), {A, B}}, {g.data(), {A, B}}, {buf.data(), {A, B}}};
  optim::step(k3::cpu::serial{}, optim::step_args<double>{{&prm, 1}}, o);
  std::vector<double> m(p.size());
  for (std::size_t i = 0; i < m.size(); ++i) m[i] = 0.05 * g[i];
  auto const O = ns5(m, A, B);
  double worst = 0;
  for (std::size_t i = 0; i < p.size(); ++i) worst = std::max(worst, std::abs(p[i] - (p0[i] - 0.01 * std::sqrt(50.0 / 8.0) * O[i])));
  CHECK(worst < 1e-15);
}

TEST_CASE("AdamW step with bias correction equals the formula, Muon and AdamW parameters in one step") {
  index_t const n = 37;
  auto p = gaussian(n, 6), g = gaussian(n, 7), m = gaussian(n, 8, 0.1), v = gaussian(n, 9, 0.1);
  for (auto& x : v) x = x * x;
  auto pm = gaussian(64, 10), gm = gaussian(64, 11);
  std::vector<double> bm(64, 0.0);
  auto p0 = p, m0 = m, v0 = v;
  optim::step_options o;
  o.adamw = {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.9, .eps = 1e-6, .weight_decay = 0.01};
  o.step = 3;
  std::vector<optim::parameter<double>> params = {
      {{p.data(), {1, n}}, {g.data(), {1, n}}, {m.data(), {1, n}}, {v.data(), {1, n}}, optim::update_rule::adamw},
      {{pm.data(), {8, 8}}, {gm.data(), {8, 8}}, {bm.data(), {8, 8}}}};
  optim::step(k3::cpu::simd<>{}, optim::step_args<double>{params}, o);
  for (index_t i = 0; i < n; ++i) {
    m0[i] = 0.8 * m0[i] + 0.2 * g[i];
    v0[i] = 0.9 * v0[i] + 0.1 * g[i] * g[i];
    double const mh = m0[i] / (1 - std::pow(0.8, 3)), vh = v0[i] / (1 - std::pow(0.9, 3));
    p0[i] = p0[i] * (1 - 3e-3 * 0.01) - 3e-3 * mh / (std::sqrt(vh) + 1e-6);
  }
  CHECK(max_abs(p, p0) < 1e-15);
  CHECK(max_abs(m, m0) < 1e-15);
  CHECK(max_abs(v, v0) < 1e-15);
  CHECK(bm == gm);  // a zero momentum buffer plus g, and the Muon matrix moved
  CHECK(pm != gaussian(64, 10));
}

TEST_CASE("Muon step with bfloat16 parameters keeps float state and tracks the float64 step") {
  index_t const A = 32, B = 48;
  auto const pd = gaussian(static_cast<std::size_t>(A * B), 12), gd = gaussian(pd.size(), 13);
  std::vector<k3::bfloat16> p(pd.size()), g(pd.size());
  std::vector<double> p64(pd.size()), g64(pd.size()), b64(pd.size(), 0.0);
  for (std::size_t i = 0; i < pd.size(); ++i) {
    p[i] = k3::bfloat16(static_cast<float>(pd[i]));
    g[i] = k3::bfloat16(static_cast<float>(gd[i]));
    p64[i] = float(p[i]);
    g64[i] = float(g[i]);
  }
  std::vector<float> buf(pd.size(), 0.f);
  optim::parameter<k3::bfloat16> prm{{p.data(), {A, B}}, {g.data(), {A, B}}, {buf.data(), {A, B}}};
  optim::step_options o;
  o.muon.lr = 0.02;
  optim::step(k3::cpu::serial{}, optim::step_args<k3::bfloat16>{{&prm, 1}}, o);
  optim::parameter<double> ref{{p64.data(), {A, B}}, {g64.data(), {A, B}}, {b64.data(), {A, B}}};
  optim::step(k3::cpu::serial{}, optim::step_args<double>{{&ref, 1}}, o);
  double worst = 0;
  for (std::size_t i = 0; i < p.size(); ++i) worst = std::max(worst, std::abs(double(float(p[i])) - p64[i]) / (std::abs(p64[i]) + 1e-3));
  CHECK(worst < 1e-2);  // bfloat16 rounding of the stored result dominates
}

TEST_CASE("optim::step checks every parameter before updating any") {
  std::vector<float> p(12, 1.f), g(12, 1.f), b(12, 0.f), q(12, 1.f), h(12, 1.f), c(12, 0.f);
  std::vector<optim::parameter<float>> params = {{{p.data(), {3, 4}}, {g.data(), {3, 4}}, {b.data(), {3, 4}}},
                                                 {{q.data(), {3, 4}}, {h.data(), {4, 3}}, {c.data(), {3, 4}}}};
  auto const err = k3::test::error_of([&] { optim::step(k3::cpu::serial{}, optim::step_args<float>{params}); });
  CHECK(err.find("argument 'params[1].grad': expected shape [3, 4], got [4, 3]") != std::string::npos);
  CHECK(p == std::vector<float>(12, 1.f));
  params[1].grad = {h.data(), {3, 4}};
  params[1].heads = 2;
  CHECK(k3::test::error_of([&] { optim::step(k3::cpu::serial{}, optim::step_args<float>{params}); }).find("params[1].heads") != std::string::npos);
  params[1].heads = 1;
  params[1].rule = optim::update_rule::adamw;
  CHECK(k3::test::error_of([&] { optim::step(k3::cpu::serial{}, optim::step_args<float>{params}); }).find("params[1].second_moment") !=
        std::string::npos);
  params[1].rule = optim::update_rule::muon;
  params[1].momentum = {q.data(), {3, 4}};
  CHECK(k3::test::names_overlap(k3::test::error_of([&] { optim::step(k3::cpu::serial{}, optim::step_args<float>{params}); }), "params[1].value",
                                "params[1].momentum"));
  params[1].momentum = {c.data(), {3, 4}};
  optim::step_options o;
  o.step = 0;
  CHECK(k3::test::error_of([&] { optim::step(k3::cpu::serial{}, optim::step_args<float>{params}, o); }).find("option 'step'") != std::string::npos);
  o.step = 1;
  o.muon.momentum = 1.0;
  CHECK(k3::test::error_of([&] { optim::step(k3::cpu::serial{}, optim::step_args<float>{params}, o); }).find("option 'muon'") != std::string::npos);
  CHECK(p == std::vector<float>(12, 1.f));
}
