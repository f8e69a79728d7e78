#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "k3/moe/placement.hpp"
#include "moe/moe_test_util.hpp"

namespace moe = k3::moe;
using k3::index_t;

TEST_CASE("EPLB reproduces the published hierarchical example") {
  std::vector<double> w = {90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86, 20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27};
  auto plan = moe_test::eplb_plan_of({w.data(), {2, 12}}, {.physical = 16, .groups = 4, .nodes = 2, .gpus = 8});
  std::vector<std::int64_t> expect = {5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1, 7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1};
  CHECK(plan.phy2log == expect);
  CHECK(moe::check_eplb(plan).empty());
  // logcnt sums to the slot count per layer
  for (index_t l = 0; l < 2; ++l) {
    std::int64_t c = 0;
    for (index_t e = 0; e < 12; ++e) c += plan.logcnt[l * 12 + e];
    CHECK(c == 16);
  }
}

TEST_CASE("EPLB global mode: consistent plans and no GPU worse than greedy bound") {
  std::mt19937_64 g(4);
  for (int t = 0; t < 50; ++t) {
    index_t E = 8 * (1 + t % 4), gpus = 4 << (t % 2), P = E + gpus * (t % 3);
    P += (gpus - P % gpus) % gpus;
    std::gamma_distribution<double> gd(0.5, 1.0);
    std::vector<double> w(static_cast<std::size_t>(E));
    for (auto& x : w) x = 1000 * gd(g);
    auto plan = moe_test::eplb_plan_of({w.data(), {1, E}}, {.physical = P, .groups = 3, .nodes = 2, .gpus = gpus});  // 3 % 2 != 0 -> global
    INFO("E " << E << " P " << P << " gpus " << gpus);
    CHECK(moe::check_eplb(plan).empty());
    // per-GPU load: each replica carries w / cnt
    std::vector<double> gl(static_cast<std::size_t>(gpus), 0);
    double total = 0, heaviest_replica = 0;
    for (index_t s = 0; s < P; ++s) {
      auto e = plan.phy2log[s];
      double r = w[e] / double(plan.logcnt[e]);
      gl[s / (P / gpus)] += r;
      total += r;
      heaviest_replica = std::max(heaviest_replica, r);
    }
    CHECK(*std::max_element(gl.begin(), gl.end()) <= total / double(gpus) + heaviest_replica + 1e-9);
  }
  std::vector<double> w(6, 1.0);
  CHECK_THROWS_AS(moe_test::eplb_plan_of({w.data(), {1, 6}}, {.physical = 7, .groups = 1, .nodes = 1, .gpus = 2}), k3::error);
}

TEST_CASE("MoonEP: every rank holds exactly S*K pairs with at most E/R redundant experts") {
  std::mt19937_64 g(9);
  index_t worst = 0;
  int instances = 0;
  for (index_t R : {4, 8, 16})
    for (index_t per : {2, 4, 7, 8})
      for (double a : {0.1, 0.3, 1.0})
        for (int rep = 0; rep < 8; ++rep) {
          index_t const E = R * per, S = 64, K = 4, total = R * S * K;
          std::gamma_distribution<double> gd(a, 1.0);
          std::vector<double> pop(static_cast<std::size_t>(E));
          for (auto& x : pop) x = gd(g) + 1e-12;
          std::discrete_distribution<index_t> pick(pop.begin(), pop.end());
          std::vector<std::int64_t> counts(static_cast<std::size_t>(E), 0);
          // routed pairs: S*K per rank, expert popularity from a Dirichlet(a)
          std::vector<std::int32_t> idx(static_cast<std::size_t>(total));
          for (auto& x : idx) {
            x = static_cast<std::int32_t>(pick(g));
            ++counts[x];
          }
          k3::const_view<std::int64_t, 1> cv(counts.data(), {E});
          auto plan = moe::moonep_rebalance(cv, R);
          auto rep_ = moe::check_moonep(cv, plan);
          INFO("R " << R << " E " << E << " alpha " << a);
          CHECK(rep_.balanced);
          CHECK(rep_.conserved);
          CHECK(rep_.max_redundant <= E / R);
          CHECK(rep_.ok());
          worst = std::max(worst, rep_.max_redundant * 100 / (E / R));
          ++instances;
          // dispatch: a bijection onto R x S*K slots
          std::vector<std::int64_t> rk(idx.size()), sl(idx.size());
          moe::moonep_dispatch({idx.data(), {total, 1}}, plan, k3::host_view(rk.data(), total, 1), k3::host_view(sl.data(), total, 1));
          std::vector<char> hit(static_cast<std::size_t>(total), 0);
          bool bij = true;
          for (index_t i = 0; i < total; ++i) {
            if (rk[i] < 0 || rk[i] >= R || sl[i] < 0 || sl[i] >= S * K) {
              bij = false;
              continue;
            }
            char& h = hit[static_cast<std::size_t>(rk[i] * S * K + sl[i])];
            bij &= h == 0;
            h = 1;
          }
          CHECK(bij);
          CHECK(std::count(hit.begin(), hit.end(), 1) == total);
        }
  MESSAGE(instances << " instances, worst redundant experts per rank = " << worst << "% of E/R");
}

TEST_CASE("MoonEP: the near-tight instance (all tokens on R-1 ranks' experts) stays within E/R") {
  index_t const R = 4, per = 4, E = R * per;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(E), 0);
  for (index_t e = per; e < E; ++e) counts[e] = 100;  // rank 0's experts get nothing
  k3::const_view<std::int64_t, 1> cv(counts.data(), {E});
  auto plan = moe::moonep_rebalance(cv, R);
  auto rep = moe::check_moonep(cv, plan);
  CHECK(rep.ok());
  CHECK(rep.max_redundant >= 1);
}

TEST_CASE("MoonEP checker catches broken plans and bad input") {
  std::vector<std::int64_t> counts = {5, 3, 2, 6};
  k3::const_view<std::int64_t, 1> cv(counts.data(), {4});
  auto plan = moe::moonep_rebalance(cv, 2);
  CHECK(moe::check_moonep(cv, plan).ok());
  auto broken = plan;
  broken.parts.back().count += 1;
  CHECK_FALSE(moe::check_moonep(cv, broken).balanced);
  CHECK_FALSE(moe::check_moonep(cv, broken).conserved);
  std::vector<std::int64_t> odd = {5, 3, 2, 5};
  CHECK_THROWS_AS(moe::moonep_rebalance({odd.data(), {4}}, 2), k3::error);
  CHECK_THROWS_AS(moe::moonep_rebalance(cv, 3), k3::error);
}
