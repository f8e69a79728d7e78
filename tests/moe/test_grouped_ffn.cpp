// k3::moe::grouped_ffn_forward / grouped_ffn_backward on the host backends against the float64
// slot-by-slot reference (tests/support/grouped_ffn_reference.hpp), whose gradients are checked
// here against central finite differences: double to 1e-12, float and bfloat16 at their
// tolerances; T = 1, T = 0, k = n, k = 1, experts without slots, id -1 slots, weight-0 slots;
// the same bits on every thread count; NaN confined to its token; errors.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/moe/latent_moe.hpp"
#include "support/error_of.hpp"
#include "support/grouped_ffn_reference.hpp"
#include "support/metrics.hpp"

namespace moe = k3::moe;
using k3::index_t;
using vec = std::vector<double>;
using k3::test::grouped_ffn_problem;
using k3::test::grouped_ffn_result;
using k3::test::check_against;
using k3::test::rounded;
using k3::test::stored;
using k3::test::widened;

namespace {

template <class T, class Bk>
grouped_ffn_result run(Bk const& b, grouped_ffn_problem const& q) {
  using C = k3::accumulation_t<T>;
  auto z = stored<T>(q.z), p = stored<T>(q.p), wg = stored<T>(q.w_gate), wu = stored<T>(q.w_up), wd = stored<T>(q.w_down), du = stored<T>(q.du);
  std::vector<T> u(static_cast<std::size_t>(q.T * q.l)), dz(u.size()), dp(p.size()), dwg(wg.size()), dwu(wu.size()), dwd(wd.size());
  std::vector<C> hg(static_cast<std::size_t>(q.T * q.k * q.f), C(7)), hu(hg.size(), C(7));
  moe::grouped_ffn_args<T> a{{z.data(), {q.T, q.l}},
                             {q.idx.data(), {q.T, q.k}},
                             {p.data(), {q.T, q.k}},
                             {wg.data(), {q.n, q.f, q.l}},
                             {wu.data(), {q.n, q.f, q.l}},
                             {wd.data(), {q.n, q.l, q.f}},
                             {u.data(), {q.T, q.l}},
                             {hg.data(), {q.T, q.k, q.f}},
                             {hu.data(), {q.T, q.k, q.f}}};
  moe::grouped_ffn_options const o{q.beta_gate, q.beta_up};
  moe::grouped_ffn_forward(b, a, o);
  moe::grouped_ffn_backward(b, moe::grouped_ffn_backward_args<T>{a,
                            moe::grouped_ffn_gradients<T>{{du.data(), {q.T, q.l}},
                                                          {dz.data(), {q.T, q.l}},
                                                          {dp.data(), {q.T, q.k}},
                                                          {dwg.data(), {q.n, q.f, q.l}},
                                                          {dwu.data(), {q.n, q.f, q.l}},
                                                          {dwd.data(), {q.n, q.l, q.f}}}},
                            o);
  return {widened(u), widened(hg), widened(hu), widened(dz), widened(dp), widened(dwg), widened(dwu), widened(dwd)};
}

auto const rel_max = [](vec const& g, vec const& r) { return k3::test::rel_max(g, r); };
auto const rel_rms = [](vec const& g, vec const& r) { return k3::test::rel_rms(g, r); };

struct shape {
  index_t T, k, n, l, f, used, hole, zero;
};
shape const shapes[] = {
    {9, 3, 5, 7, 6, -1, 0, 0},    // odd everything
    {1, 2, 4, 5, 3, -1, 0, 0},    // T = 1
    {6, 4, 4, 3, 5, -1, 0, 0},    // k = n
    {7, 1, 3, 4, 4, -1, 0, 0},    // k = 1
    {11, 2, 8, 6, 7, 3, 5, 4},    // experts 3..7 without slots, id -1 slots, weight-0 slots
    {0, 3, 4, 5, 6, -1, 0, 0},    // an empty batch
    {40, 4, 6, 33, 19, -1, 0, 0}  // several tasks per expert's GEMMs
};

}  // namespace

TEST_CASE("grouped_ffn reference: its gradients are central finite differences of <du, u>") {
  auto q = k3::test::random_grouped_ffn(4, 2, 3, 5, 4, 11, -1, 0, 7);
  auto const r = k3::test::grouped_ffn_reference(q);
  auto fd = [&](vec grouped_ffn_problem::*member, std::size_t i) {
    double const h = 1e-5, keep = (q.*member)[i];
    (q.*member)[i] = keep + h;
    double const up = k3::test::grouped_ffn_loss(q);
    (q.*member)[i] = keep - h;
    double const dn = k3::test::grouped_ffn_loss(q);
    (q.*member)[i] = keep;
    return (up - dn) / (2 * h);
  };
  auto check = [&](vec grouped_ffn_problem::*member, vec const& grad) {
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < grad.size(); ++i) {
      worst = std::max(worst, std::abs(fd(member, i) - grad[i]));
      scale = std::max(scale, std::abs(grad[i]));
    }
    CHECK(scale > 0);
    CHECK(worst <= 1e-7 * std::max(1.0, scale));
  };
  check(&grouped_ffn_problem::z, r.dz);
  check(&grouped_ffn_problem::p, r.dp);
  check(&grouped_ffn_problem::w_gate, r.dw_gate);
  check(&grouped_ffn_problem::w_up, r.dw_up);
  check(&grouped_ffn_problem::w_down, r.dw_down);
}

TEST_CASE("grouped_ffn on the host: double to 1e-12 of the float64 reference, float 2e-5 / 1e-4, bfloat16 at fla's tolerances") {
  unsigned seed = 1;
  for (shape s : shapes) {
    CAPTURE(s.T);
    CAPTURE(s.k);
    CAPTURE(s.n);
    auto const q = k3::test::random_grouped_ffn(s.T, s.k, s.n, s.l, s.f, seed++, s.used, s.hole, s.zero);
    auto const ref = k3::test::grouped_ffn_reference(q);
    check_against(run<double>(k3::cpu::serial{}, q), ref, rel_max, 1e-12, 1e-12);
    check_against(run<double>(k3::cpu::threads<>(3), q), ref, rel_max, 1e-12, 1e-12);
    auto const qf = rounded<float>(q);
    check_against(run<float>(k3::cpu::threads<>(2), qf), k3::test::grouped_ffn_reference(qf), rel_max, 2e-5, 1e-4);
    auto const qb = rounded<k3::bfloat16>(q);
    check_against(run<k3::bfloat16>(k3::cpu::threads<>(2), qb), k3::test::grouped_ffn_reference(qb), rel_rms, 5e-3, 8e-3);
  }
}

TEST_CASE("grouped_ffn on the host: slot rules and the same bits on every thread count") {
  auto const q = k3::test::random_grouped_ffn(13, 3, 6, 9, 8, 5, 4, 4, 3);
  auto const a = run<float>(k3::cpu::serial{}, q), b = run<float>(k3::cpu::threads<>(2), q), c = run<float>(k3::cpu::threads<>(3), q);
  for (auto const* r : {&b, &c}) {
    CHECK(r->u == a.u);
    CHECK(r->dz == a.dz);
    CHECK(r->dp == a.dp);
    CHECK(r->dw_gate == a.dw_gate);
    CHECK(r->dw_down == a.dw_down);
  }
  for (std::size_t s = 0; s < q.idx.size(); ++s) {
    if (q.idx[s] < 0) {
      CHECK(a.dp[s] == 0.0);  // an empty slot: no gradient, zero pre-activations
      for (index_t c2 = 0; c2 < q.f; ++c2) CHECK(a.h_gate[s * static_cast<std::size_t>(q.f) + static_cast<std::size_t>(c2)] == 0.0);
    } else if (q.p[s] == 0.0) {
      CHECK(a.dp[s] != 0.0);  // weight 0 keeps its expert and its gradient
    }
  }
  for (index_t e = 4; e < q.n; ++e)  // experts without slots: zero gradients
    for (index_t i = 0; i < q.f * q.l; ++i) CHECK(a.dw_gate[static_cast<std::size_t>(e * q.f * q.l + i)] == 0.0);
}

TEST_CASE("grouped_ffn on the host: a NaN in one token stays in that token and its experts") {
  auto q = k3::test::random_grouped_ffn(8, 2, 6, 5, 4, 9);
  index_t const bad = 3;
  q.z[static_cast<std::size_t>(bad * q.l + 2)] = std::numeric_limits<double>::quiet_NaN();
  auto const r = run<float>(k3::cpu::threads<>(2), q);
  k3::test::check_nan_confined(q, bad, r);
}

TEST_CASE("grouped_ffn on the host: errors name the argument") {
  auto q = k3::test::random_grouped_ffn(4, 2, 3, 5, 4, 2);
  std::vector<float> z(20), p(8), wg(60), wu(60), wd(60), u(20), du(20);
  std::vector<float> hg(32), hu(32);
  std::vector<std::int64_t> idx = q.idx;
  auto args = [&] {
    return moe::grouped_ffn_args<float>{{z.data(), {4, 5}},   {idx.data(), {4, 2}},    {p.data(), {4, 2}},  {wg.data(), {3, 4, 5}},
                                        {wu.data(), {3, 4, 5}}, {wd.data(), {3, 5, 4}}, {u.data(), {4, 5}}, {hg.data(), {4, 2, 4}},
                                        {hu.data(), {4, 2, 4}}};
  };
  k3::cpu::serial cpu;
  CHECK(k3::test::error_of([&] { moe::grouped_ffn_forward(cpu, args()); }).empty());
  idx[5] = 3;
  CHECK(k3::test::error_of([&] { moe::grouped_ffn_forward(cpu, args()); }).find("argument 'indices': expected expert ids in [-1, 3), got 3 at [2, 1]") !=
        std::string::npos);
  idx[5] = -2;
  CHECK(k3::test::error_of([&] { moe::grouped_ffn_backward(cpu, moe::grouped_ffn_backward_args<float>{args(), {{du.data(), {4, 5}}}}); }).find("got -2 at [2, 1]") != std::string::npos);
  idx = q.idx;
  auto a = args();
  a.w_down = {wd.data(), {3, 4, 5}};
  CHECK(k3::test::error_of([&] { moe::grouped_ffn_forward(cpu, a); }).find("argument 'w_down': expected shape [3, 5, 4]") != std::string::npos);
  a = args();
  a.u = {};
  CHECK(k3::test::error_of([&] { moe::grouped_ffn_forward(cpu, a); }).find("argument 'u'") != std::string::npos);
  a = args();
  a.u = {z.data(), {4, 5}};
  CHECK(k3::test::names_overlap(k3::test::error_of([&] { moe::grouped_ffn_forward(cpu, a); }), "u", "z"));
  a = args();
  a.h_gate = {};
  a.h_up = {};
  CHECK(k3::test::error_of([&] { moe::grouped_ffn_backward(cpu, moe::grouped_ffn_backward_args<float>{a, {{du.data(), {4, 5}}}}); }).find("'h_gate'") != std::string::npos);
  CHECK(k3::test::names_overlap(k3::test::error_of([&] {
                                  moe::grouped_ffn_backward(cpu, moe::grouped_ffn_backward_args<float>{args(), {{du.data(), {4, 5}}, {du.data(), {4, 5}}}});
                                }),
                                "dz", "du"));
  CHECK(k3::test::error_of([&] { moe::grouped_ffn_forward(cpu, args(), {.beta_gate = 0.0}); }).find("option 'beta_gate'") != std::string::npos);
}
