// Adversarial checks of the MoE API the CLI cannot reach: the placement checkers on
// malformed plans, EPLB / MoonEP on adversarial loads, SiTU-GLU gradients at extreme inputs
// against a long-double reference written from spec C.1, group-limited routing corner cases.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/error_of.hpp"
#include "k3/moe.hpp"
#include "moe/moe_test_util.hpp"

namespace moe = k3::moe;
using k3::index_t;

namespace {

// ---- EPLB / MoonEP properties written from the spec, not from placement.hpp -----------------
void check_eplb_properties(moe::eplb_plan const& p, std::vector<double> const& load, index_t nodes, index_t gpus, bool hierarchical) {
  REQUIRE(moe::check_eplb(p).empty());
  index_t const E = p.experts, P = p.physical, per_node = P / nodes, per_gpu = P / gpus;
  (void)per_gpu;
  for (index_t l = 0; l < p.layers; ++l) {
    std::int64_t total = 0;
    for (index_t e = 0; e < E; ++e) {
      total += p.logcnt[l * E + e];
      CHECK(p.logcnt[l * E + e] >= 1);
    }
    CHECK(total == P);
    if (hierarchical) {  // every replica of an expert lives on the node of its group
      std::vector<index_t> node_of(static_cast<std::size_t>(E), -1);
      for (index_t s = 0; s < P; ++s) {
        auto e = p.phy2log[l * P + s];
        index_t nd = s / per_node;
        if (node_of[e] < 0) node_of[e] = nd;
        CHECK(node_of[e] == nd);
      }
    }
    // replication: no expert with a replica to spare is heavier per replica than the lightest
    // replicated expert would be with one replica fewer (greedy argmax w / cnt)
    if (!hierarchical) {
      for (index_t a = 0; a < E; ++a) {
        auto ca = p.logcnt[l * E + a];
        if (ca < 2) continue;
        for (index_t b = 0; b < E; ++b)
          CHECK(load[l * E + b] / double(p.logcnt[l * E + b]) <= load[l * E + a] / double(ca - 1) + 1e-9);
      }
    }
  }
}

}  // namespace

TEST_CASE("EPLB on adversarial loads (zero, one hot expert, P >> E, one slot per GPU)") {
  struct cs {
    index_t L, E, P, groups, nodes, gpus;
    int kind;  // 0 random, 1 all zero, 2 one hot, 3 ties
  };
  for (cs c : {cs{2, 8, 8, 1, 1, 8, 0}, cs{1, 8, 64, 1, 1, 8, 2}, cs{1, 5, 15, 1, 1, 3, 1}, cs{3, 12, 24, 4, 2, 8, 2},
               cs{2, 12, 24, 4, 2, 8, 3}, cs{1, 7, 49, 1, 1, 7, 0}, cs{2, 16, 32, 8, 4, 16, 1}, cs{1, 6, 6, 3, 3, 3, 2},
               cs{1, 9, 12, 3, 2, 4, 0}}) {
    CAPTURE(c.E);
    CAPTURE(c.P);
    CAPTURE(c.kind);
    std::mt19937_64 g(std::uint64_t(c.E * 131 + c.P));
    std::vector<double> load(static_cast<std::size_t>(c.L * c.E), 0.0);
    for (auto& x : load) {
      if (c.kind == 0) x = double(g() % 1000);
      if (c.kind == 3) x = 7.0;
    }
    if (c.kind == 2)
      for (index_t l = 0; l < c.L; ++l) load[l * c.E + (l * 5) % c.E] = 1e6;
    auto plan = moe_test::eplb_plan_of({load.data(), {c.L, c.E}}, {.physical = c.P, .groups = c.groups, .nodes = c.nodes, .gpus = c.gpus});
    bool const hier = c.groups % c.nodes == 0 && c.nodes > 1;
    check_eplb_properties(plan, load, hier ? c.nodes : 1, c.gpus, hier);
    if (c.kind == 2 && !hier)
      for (index_t l = 0; l < c.L; ++l) CHECK(plan.logcnt[l * c.E + (l * 5) % c.E] == c.P - c.E + 1);
  }
}

TEST_CASE("check_eplb rejects malformed plans without reading out of bounds") {
  std::vector<double> w = {90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86};
  auto const good = moe_test::eplb_plan_of({w.data(), {1, 12}}, {.physical = 16, .groups = 4, .nodes = 2, .gpus = 8});
  REQUIRE(moe::check_eplb(good).empty());
  REQUIRE(good.max_replicas >= 2);
  // an expert placed once, its only slot numbered replica 1 (< max_replicas): log2phy[e][0] is
  // -1, so a dispatcher reading replica 0 gets no slot; replica numbers must be 0..logcnt-1
  {
    auto p = good;
    index_t e = -1;
    for (index_t x = 0; x < p.experts; ++x)
      if (p.logcnt[x] == 1) e = x;
    REQUIRE(e >= 0);
    index_t s = p.log2phy[e * p.max_replicas];
    p.phyrank[s] = 1;
    p.log2phy[e * p.max_replicas] = -1;
    p.log2phy[e * p.max_replicas + 1] = s;
    CHECK_FALSE(moe::check_eplb(p).empty());
  }
  // a stray slot id in a padding entry of log2phy (beyond logcnt)
  {
    auto p = good;
    index_t e = -1;
    for (index_t x = 0; x < p.experts; ++x)
      if (p.logcnt[x] < p.max_replicas) e = x;
    REQUIRE(e >= 0);
    p.log2phy[e * p.max_replicas + p.max_replicas - 1] = 0;
    CHECK_FALSE(moe::check_eplb(p).empty());
  }
  // replica numbers out of range, vectors of the wrong size, bad headers
  {
    auto p = good;
    p.phyrank[3] = p.max_replicas;
    CHECK_FALSE(moe::check_eplb(p).empty());
    p = good;
    p.phyrank[3] = -1;
    CHECK_FALSE(moe::check_eplb(p).empty());
    p = good;
    p.log2phy.pop_back();
    CHECK_FALSE(moe::check_eplb(p).empty());
    p = good;
    p.logcnt.resize(3);
    CHECK_FALSE(moe::check_eplb(p).empty());
    p = good;
    p.phy2log.resize(5);
    CHECK_FALSE(moe::check_eplb(p).empty());
    p = good;
    p.phyrank.clear();
    CHECK_FALSE(moe::check_eplb(p).empty());
    p = good;
    p.layers = 2;
    CHECK_FALSE(moe::check_eplb(p).empty());
    p = good;
    p.max_replicas = 0;
    CHECK_FALSE(moe::check_eplb(p).empty());
    p = good;
    p.phy2log[0] = 12;
    CHECK_FALSE(moe::check_eplb(p).empty());
  }
}

TEST_CASE("MoonEP on adversarial counts (one hot expert, zero loads, E/R = 1, empty batch)") {
  std::mt19937_64 g(77);
  for (int t = 0; t < 300; ++t) {
    index_t const R = 1 + index_t(g() % 9), per = 1 + index_t(g() % 6), E = R * per;
    std::vector<std::int64_t> c(static_cast<std::size_t>(E), 0);
    int const kind = t % 4;
    for (auto& x : c) x = kind == 0 ? std::int64_t(g() % 50) : kind == 1 ? (g() % 4 == 0 ? std::int64_t(g() % 1000) : 0) : 0;
    if (kind == 2) c[g() % std::uint64_t(E)] = 1000;
    std::int64_t total = 0;
    for (auto x : c) total += x;
    c[0] += (R - total % R) % R;  // make the total a multiple of R
    k3::const_view<std::int64_t, 1> cv(c.data(), {E});
    auto plan = moe::moonep_rebalance(cv, R);
    auto rep = moe::check_moonep(cv, plan);
    CAPTURE(R);
    CAPTURE(per);
    CAPTURE(kind);
    CHECK(rep.ok());
    // dispatch: a bijection onto R x pairs_per_rank
    index_t const Tn = plan.pairs_per_rank * R;
    std::vector<std::int32_t> idx;
    for (index_t e = 0; e < E; ++e)
      for (std::int64_t i = 0; i < c[e]; ++i) idx.push_back(std::int32_t(e));
    std::shuffle(idx.begin(), idx.end(), g);
    std::vector<std::int64_t> rk(idx.size()), sl(idx.size());
    if (Tn > 0) {
      moe::moonep_dispatch({idx.data(), {Tn, 1}}, plan, {rk.data(), {Tn, 1}}, {sl.data(), {Tn, 1}});
      std::vector<char> seen(static_cast<std::size_t>(Tn), 0);
      bool bij = true;
      for (std::size_t i = 0; i < idx.size(); ++i) {
        if (rk[i] < 0 || rk[i] >= R || sl[i] < 0 || sl[i] >= plan.pairs_per_rank) {
          bij = false;
          continue;
        }
        auto& sref = seen[static_cast<std::size_t>(rk[i] * plan.pairs_per_rank + sl[i])];
        bij &= sref == 0;
        sref = 1;
      }
      CHECK(bij);
    }
  }
}

TEST_CASE("check_moonep and moonep_dispatch on malformed plans: a report or a k3::error, never a crash") {
  std::vector<std::int64_t> counts = {5, 3, 2, 6};
  k3::const_view<std::int64_t, 1> cv(counts.data(), {4});
  auto const good = moe::moonep_rebalance(cv, 2);
  REQUIRE(moe::check_moonep(cv, good).ok());
  for (int v = 0; v < 4; ++v) {
    auto p = good;
    if (v == 0) p.ranks = 0;       // was a division by zero (E / R, e / (E / R))
    if (v == 1) p.ranks = 8;       // more ranks than experts: E / R = 0, home() divided by zero
    if (v == 2) p.ranks = 3;       // experts not a multiple of ranks: home() meaningless
    if (v == 3) p.experts = -4;    // negative sizes
    CAPTURE(v);
    moe::moonep_report rep;
    CHECK_NOTHROW(rep = moe::check_moonep(cv, p));
    CHECK_FALSE(rep.ok());
  }
  std::vector<std::int32_t> idx = {0, 1, 2, 3, 3, 0, 1, 0};
  std::vector<std::int64_t> rk(8), sl(8);
  auto dispatch = [&](moe::moonep_plan const& p) {
    moe::moonep_dispatch({idx.data(), {4, 2}}, p, {rk.data(), {4, 2}}, {sl.data(), {4, 2}});
  };
  {
    auto p = good;
    p.parts.push_back({1, 7, 1});  // a part on a rank that does not exist (wrote next_slot[7])
    CHECK_THROWS_AS(dispatch(p), k3::error);
    p = good;
    p.parts.push_back({9, 0, 1});  // a part for an expert that does not exist (parts[9])
    CHECK_THROWS_AS(dispatch(p), k3::error);
    p = good;
    p.parts.push_back({1, -1, 1});
    CHECK_THROWS_AS(dispatch(p), k3::error);
    p = good;
    p.ranks = 0;
    CHECK_THROWS_AS(dispatch(p), k3::error);
  }
}

// ---- SiTU-GLU at extreme inputs ---------------------------------------------------------------
namespace {

using ld = long double;
// sech^2(z) and sigma(x) in forms that keep full relative precision in both tails.
ld sech2(ld z) {
  ld const e = std::exp(-2 * std::fabs(z));
  return 4 * e / ((1 + e) * (1 + e));
}
ld sig(ld x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }

struct ref_grad {
  ld v, dg, du, db1, db2;
};
ref_grad situ_ref(ld g, ld u, ld b1, ld b2) {
  ld const zg = g / b1, zu = u / b2;
  ld const tg = std::tanh(zg), tu = std::tanh(zu), s = sig(g), sm = sig(-g);
  ld const cg = b1 * tg, cu = b2 * tu;
  ref_grad r;
  r.v = cg * s * cu;
  r.dg = cu * (sech2(zg) * s + cg * s * sm);
  r.du = cg * s * sech2(zu);
  // d/dc [c tanh(x/c)] = tanh(z) - z sech^2(z) (long double: relative error ~1.5e-19 / z^2);
  // below |z| = 0.013 its Taylor series 2z^3/3 - 8z^5/15 + 34z^7/105 - 496z^9/2835 (the
  // integral of 2z tanh(z) sech^2(z)), truncation < 1e-16.
  auto dcap = [](ld z) {
    if (std::fabs(z) < 0.013L) {
      ld const z2 = z * z;
      return z * z2 * (ld(2) / 3 - z2 * (ld(8) / 15 - z2 * (ld(34) / 105 - z2 * ld(496) / 2835)));
    }
    return std::tanh(z) - z * sech2(z);
  };
  r.db1 = dcap(zg) * s * cu;
  r.db2 = cg * s * dcap(zu);
  return r;
}

double rel(ld got, ld want) {
  if (want == 0) return got == 0 ? 0.0 : double(std::fabs(got));
  if (std::fabs(want) < ld(std::numeric_limits<double>::min())) return double(std::fabs(got - want)) / double(std::numeric_limits<double>::min());
  return double(std::fabs(got - want) / std::fabs(want));
}

}  // namespace

TEST_CASE("SiTU-GLU value and gradients keep relative precision at extreme g and u (double)") {
  std::vector<double> const pts = {0.0,    -0.0,  5e-324, -5e-324, 1e-310, 1e-200, -1e-200, 1e-8, -1e-8, 1e-5,  -1e-5, 0.3,
                                   -0.3,   2.0,   -2.0,   9.0,     -9.0,   20.0,   -20.0,   40.0, -40.0, 60.0,  -60.0, 75.0,
                                   -75.0,  140.0, -140.0, 700.0,   -700.0, 1e4,    -1e4,    1e300, -1e300};
  moe::situ_params<double> const c{};
  double worst[5] = {0, 0, 0, 0, 0};
  double wg[5][2] = {};
  for (double gg : pts)
    for (double uu : pts) {
      auto k = moe::situ_glu_grad(gg, uu, c);
      auto r = situ_ref(gg, uu, c.beta1, c.beta2);
      double e[5] = {rel(k.value, r.v), rel(k.d_gate, r.dg), rel(k.d_up, r.du), rel(k.d_beta1, r.db1), rel(k.d_beta2, r.db2)};
      for (int i = 0; i < 5; ++i)
        if (e[i] > worst[i]) worst[i] = e[i], wg[i][0] = gg, wg[i][1] = uu;
      CHECK(rel(k.value, moe::situ_glu(gg, uu, c)) <= 4e-16);
    }
  char const* names[5] = {"value", "d_gate", "d_up", "d_beta1", "d_beta2"};
  for (int i = 0; i < 5; ++i) {
    CAPTURE(names[i]);
    CAPTURE(wg[i][0]);
    CAPTURE(wg[i][1]);
    CHECK(worst[i] <= 1e-13);
  }
}

// ---- error quality ---------------------------------------------------------------------------
namespace {
using k3::test::error_of;
bool has(std::string const& s, std::string const& sub) { return s.find(sub) != std::string::npos; }
}  // namespace

TEST_CASE("placement and QB errors name the argument and give the values") {
  std::vector<double> w(12, 1.0);
  k3::const_view<double, 2> lv(w.data(), {1, 12});
  auto e1 = error_of([&] { moe_test::eplb_plan_of(lv, {.physical = 16, .groups = 0, .nodes = 2, .gpus = 8}); });
  CHECK(has(e1, "'groups'"));
  CHECK(has(e1, "groups = 0"));
  auto e2 = error_of([&] { moe_test::eplb_plan_of(lv, {.physical = 15, .groups = 4, .nodes = 2, .gpus = 5}); });
  CHECK(has(e2, "'gpus' (5)"));
  CHECK(has(e2, "'nodes' (2)"));
  auto e3 = error_of([&] { moe_test::eplb_plan_of(lv, {.physical = 14, .groups = 4, .nodes = 4, .gpus = 4}); });  // 14 % 4 != 0 (also physical % gpus)
  CHECK(has(e3, "'physical'"));
  CHECK(has(e3, "14"));
  std::vector<std::int64_t> counts = {5, 3, 2, 6};
  auto plan = moe::moonep_rebalance({counts.data(), {4}}, 2);
  std::vector<std::int32_t> idx = {0, 7};
  std::vector<std::int64_t> rk(2), sl(2);
  auto e4 = error_of([&] { moe::moonep_dispatch({idx.data(), {1, 2}}, plan, {rk.data(), {1, 2}}, {sl.data(), {1, 2}}); });
  CHECK(has(e4, "'indices'"));
  CHECK(has(e4, "expert id 7 at (0, 1)"));
  moe::router_options ro;
  ro.k = 2;
  ro.n_groups = 2;
  auto e5 = error_of([&] { moe::quantile_balancer qb(8, ro); });
  CHECK(has(e5, "'n_groups'"));
  CHECK(has(e5, "got 2"));
  ro.n_groups = 1;
  ro.routed_scale = std::numeric_limits<float>::infinity();
  std::vector<float> s(8, 0.5f), b(8, 0.f), wt(2);
  std::vector<std::int32_t> ix(2);
  auto e6 = error_of([&] {
    moe::route(k3::cpu::serial{},
               moe::route_args<float>{.scores = {s.data(), {1, 8}},
                                      .bias = {b.data(), {8}},
                                      .indices = k3::host_view(ix.data(), 1, 2),
                                      .weights = k3::host_view(wt.data(), 1, 2)},
               ro);
  });
  CHECK(has(e6, "'routed_scale'"));
  CHECK(has(e6, "inf"));
}

TEST_CASE("group-limited routing: topk_groups = n_groups is plain top-k, k = 1, threads == serial with logits and masks") {
  k3::cpu::threads<> thr(3);
  std::mt19937_64 gen(5);
  for (index_t n : {6, 12, 30, 64}) {
    for (index_t G : {1, 2, 3, 6}) {
      if (n % G != 0) continue;
      for (index_t k : {1, 2, 5}) {
        if (k >= n) continue;
        index_t const m = 37;
        auto s = moe_test::uniform(m * n, 0.0, 1.0, gen());
        for (std::size_t i = 0; i < s.size(); i += 7) s[i] = s[i / 2];  // some ties
        auto b = moe_test::uniform(n, -0.1, 0.1, gen());
        std::vector<std::uint8_t> mask(static_cast<std::size_t>(m), 1);
        for (index_t i = 0; i < m; i += 5) mask[std::size_t(i)] = 0;
        CAPTURE(n);
        CAPTURE(G);
        CAPTURE(k);
        moe::router_options plain;
        plain.k = k;
        moe::router_options all = plain;
        all.n_groups = G;
        all.topk_groups = G;
        moe_test::routed r0(m, k, n), r1(m, k, n), r2(m, k, n);
        moe::route(k3::cpu::serial{}, r0.args(moe_test::cview(s, m, n), moe_test::cview(b), {mask.data(), {m}}), plain);
        moe::route(k3::cpu::serial{}, r1.args(moe_test::cview(s, m, n), moe_test::cview(b), {mask.data(), {m}}), all);
        moe::route(thr, r2.args(moe_test::cview(s, m, n), moe_test::cview(b), {mask.data(), {m}}), all);
        CHECK(r0.idx == r1.idx);
        CHECK(r0.w == r1.w);
        CHECK(r0.cut == r1.cut);
        CHECK(r0.load == r1.load);
        CHECK(r1.idx == r2.idx);
        CHECK(r1.w == r2.w);
        CHECK(r1.cut == r2.cut);
        CHECK(r1.load == r2.load);
        for (index_t tg = 1; tg < G; ++tg) {
          if (k > tg * (n / G)) continue;
          moe::router_options lim = plain;
          lim.n_groups = G;
          lim.topk_groups = tg;
          lim.input = moe::score_kind::logits;
          auto lg = moe_test::uniform(m * n, -6.0, 6.0, gen());
          moe_test::routed a(m, k, n), c(m, k, n);
          moe::route(k3::cpu::serial{}, a.args(moe_test::cview(lg, m, n), moe_test::cview(b), {mask.data(), {m}}), lim);
          moe::route(thr, c.args(moe_test::cview(lg, m, n), moe_test::cview(b), {mask.data(), {m}}), lim);
          CHECK(a.idx == c.idx);
          CHECK(a.w == c.w);
          CHECK(a.cut == c.cut);
          // every chosen expert lies in one of tg groups
          for (index_t i = 0; i < m; ++i) {
            if (!mask[std::size_t(i)]) continue;
            std::vector<int> used(static_cast<std::size_t>(G), 0);
            for (index_t r = 0; r < k; ++r) used[std::size_t(a.idx[std::size_t(i * k + r)] / (n / G))] = 1;
            int cnt = 0;
            for (int u : used) cnt += u;
            CHECK(cnt <= tg);
          }
        }
      }
    }
  }
}

TEST_CASE("MoonEP with a null or negative-stride counts view is a k3::error naming 'counts', not a crash") {
  k3::const_view<std::int64_t, 1> null_counts(nullptr, {4});  // was: read through a null pointer
  auto e1 = error_of([&] { moe::moonep_rebalance(null_counts, 2); });
  CHECK(has(e1, "'counts'"));
  std::vector<std::int64_t> counts = {5, 3, 2, 6};
  auto plan = moe::moonep_rebalance({counts.data(), {4}}, 2);
  auto e2 = error_of([&] { moe::check_moonep(null_counts, plan); });
  CHECK(has(e2, "'counts'"));
}

TEST_CASE("qb_histogram::for_bias with a null bias view is a k3::error naming 'bias', not a crash") {
  k3::const_view<float, 1> null_bias(nullptr, {6});  // was: read through a null pointer
  auto e = error_of([&] { moe::qb_histogram::for_bias(null_bias); });
  CHECK(has(e, "'bias'"));
  moe::qb_histogram h(6, 10, -1.f, 1.f);
  CHECK(has(error_of([&] { h.reset_for_bias(null_bias); }), "'bias'"));
}

TEST_CASE("SiTU-GLU gradients in float keep relative precision in the tails too") {
  std::vector<float> const pts = {0.0f, 1e-40f, -1e-40f, 1e-20f, 1e-4f, -1e-4f, 0.7f, -0.7f, 3.0f, -3.0f, 30.0f, -30.0f, 45.0f, -45.0f, 80.0f, -80.0f, 300.0f, -300.0f};
  moe::situ_params<float> const c{};
  double worst = 0;
  for (float gg : pts)
    for (float uu : pts) {
      auto k = moe::situ_glu_grad(gg, uu, c);
      auto r = situ_ref(gg, uu, 4.0L, 25.0L);
      // float: relative 1e-5, or absolute at the float normal floor
      auto rf = [](float got, ld want) {
        if (std::fabs(want) < ld(std::numeric_limits<float>::min()))
          return double(std::fabs(ld(got) - want)) / double(std::numeric_limits<float>::min());
        return double(std::fabs(ld(got) - want) / std::fabs(want));
      };
      worst = std::max({worst, rf(k.value, r.v), rf(k.d_gate, r.dg), rf(k.d_up, r.du), rf(k.d_beta1, r.db1), rf(k.d_beta2, r.db2)});
    }
  CHECK(worst <= 2e-5);
}
