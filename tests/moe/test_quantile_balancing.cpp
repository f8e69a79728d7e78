#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "moe/moe_test_util.hpp"

using namespace moe_test;
namespace moe = k3::moe;

namespace {

std::vector<std::int64_t> loads_with(std::vector<float> const& s, std::vector<float> const& b, index_t m, index_t n, index_t k) {
  moe::router_options opt;
  opt.k = k;
  routed r(m, k, n);
  moe::route(k3::cpu::serial{}, r.args(cview(s, m, n), cview(b)), opt);
  return r.load;
}

double l1_error(std::vector<std::int64_t> const& load, index_t m, index_t k) {
  double q = double(m) * double(k) / double(load.size()), e = 0;
  for (auto l : load) e += std::fabs(double(l) - q);
  return e;
}

}  // namespace

TEST_CASE("A.6-1 histogram recovery: [0.25, -0.25] and new bounds [-1.25, 1.25]") {
  moe::qb_histogram h(2, 4, -1.f, 1.f);
  std::int64_t H[2][4] = {{0, 2, 2, 0}, {2, 2, 0, 0}};
  for (int j = 0; j < 2; ++j)
    for (int l = 0; l < 4; ++l) h(j, l) = H[j][l];
  std::vector<double> raw;
  REQUIRE(moe::detail::qb_histogram_quantile(h, 1, raw));
  CHECK(raw[0] == doctest::Approx(0.0));
  CHECK(raw[1] == doctest::Approx(-0.5));
  std::vector<float> b = {0.f, 0.f};
  CHECK(moe::qb_update(k3::cpu::serial{}, moe::qb_update_args<float>{.histogram = &h, .bias = mview(b)}, {.router = {.k = 1}}));
  CHECK(b[0] == doctest::Approx(0.25f));
  CHECK(b[1] == doctest::Approx(-0.25f));
  auto next = moe::qb_histogram::for_bias(cview(b), 4);
  CHECK(next.lo() == doctest::Approx(-1.25f));
  CHECK(next.hi() == doctest::Approx(1.25f));
  CHECK(next.tokens() == 0);
}

TEST_CASE("A.6-2 an empty histogram keeps the bias and bounds") {
  std::vector<float> b = {0.3f, -0.3f};
  auto h = moe::qb_histogram::for_bias(cview(b), 16);
  CHECK_FALSE(moe::qb_update(k3::cpu::serial{}, moe::qb_update_args<float>{.histogram = &h, .bias = mview(b)}, {.router = {.k = 1}}));
  CHECK(b == std::vector<float>{0.3f, -0.3f});
  auto h2 = moe::qb_histogram::for_bias(cview(b), 16);
  CHECK(h2.lo() == h.lo());
  CHECK(h2.hi() == h.hi());
  // a padding-only batch adds nothing
  moe::quantile_balancer qb(b, moe::router_options{1, 1.f, moe::score_kind::scores, 1, 1}, {moe::qb_mode::histogram, 16, 0.0});
  std::vector<float> s = {0.5f, 0.7f, 0.2f, 0.1f};
  std::vector<std::uint8_t> mask = {0, 0};
  routed r(2, 1, 2);
  qb.route(k3::cpu::serial{}, r.args(cview(s, 2, 2), {}, k3::const_view<std::uint8_t, 1>(mask.data(), {2})));
  CHECK(qb.pending_tokens() == 0);
  CHECK_FALSE(qb.step(k3::cpu::serial{}));
  CHECK(std::vector<float>(qb.bias().data_handle(), qb.bias().data_handle() + 2) == b);
}

TEST_CASE("A.6-3 the pooled quantile is not the mean of micro-batch quantiles") {
  auto make = [] { return moe::qb_histogram(2, 10, 0.f, 10.f); };
  auto mb1 = make(), mb2 = make();
  mb1(0, 0) = 3, mb1(0, 9) = 1, mb1(1, 0) = 4;
  mb2(0, 9) = 4, mb2(1, 0) = 4;
  auto pooled = mb1;
  pooled.merge(mb2);
  std::vector<float> bp(2, 0.f), b1(2, 0.f), b2(2, 0.f);
  REQUIRE(moe::qb_update(k3::cpu::serial{}, moe::qb_update_args<float>{.histogram = &pooled, .bias = mview(bp)}, {.router = {.k = 1}}));
  REQUIRE(moe::qb_update(k3::cpu::serial{}, moe::qb_update_args<float>{.histogram = &mb1, .bias = mview(b1)}, {.router = {.k = 1}}));
  REQUIRE(moe::qb_update(k3::cpu::serial{}, moe::qb_update_args<float>{.histogram = &mb2, .bias = mview(b2)}, {.router = {.k = 1}}));
  CHECK(bp[0] == doctest::Approx(4.35f));
  CHECK(bp[1] == doctest::Approx(-4.35f));
  CHECK(b1[0] == doctest::Approx(0.083333f));
  CHECK(b2[0] == doctest::Approx(4.5f));
  CHECK(std::fabs(0.5 * (b1[0] + b2[0]) - bp[0]) > 0.1);
  auto bad = moe::qb_histogram(2, 10, 0.f, 11.f);
  CHECK_THROWS_AS(pooled.merge(bad), k3::error);
}

TEST_CASE("A.6-4 histogram estimate within one bin width of the exact quantile, splits sum bit-exactly") {
  index_t const m = 4096, n = 8, k = 2, B = 1000;
  auto s = uniform(m * n, 0, 1, 99);
  std::vector<float> b(n);
  for (index_t j = 0; j < n; ++j) b[j] = static_cast<float>(-0.1 + 0.2 * double(j) / double(n - 1));
  moe::router_options opt;
  opt.k = k;
  routed r(m, k, n);
  auto whole = moe::qb_histogram::for_bias(cview(b), B);
  moe::route(k3::cpu::serial{}, r.args(cview(s, m, n), cview(b), {}, &whole), opt);
  CHECK(whole.tokens() == m);
  std::vector<double> est, exact;
  REQUIRE(moe::detail::qb_histogram_quantile(whole, k, est));
  REQUIRE(moe::detail::qb_exact_quantile(cview(s, m, n), cview(r.cut), opt, exact));
  for (index_t j = 0; j < n; ++j) CHECK(std::fabs(est[j] - exact[j]) <= whole.width() * (1 + 1e-6));
  // any split of the tokens, on any backend, sums to the whole batch's counts
  for (std::vector<index_t> cuts : {std::vector<index_t>{0, 1, 4096}, {0, 1000, 1001, 3000, 4096}, {0, 2048, 4096}}) {
    auto sum = moe::qb_histogram::for_bias(cview(b), B);
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
      index_t a = cuts[c], len = cuts[c + 1] - cuts[c];
      auto part = moe::qb_histogram::for_bias(cview(b), B);
      routed rp(len, k, n);
      k3::const_view<float, 2> sv(s.data() + a * n, {len, n});
      if (c % 2) moe::route(k3::cpu::threads<>(2), rp.args(sv, cview(b), {}, &part), opt);
      else moe::route(k3::cpu::serial{}, rp.args(sv, cview(b), {}, &part), opt);
      sum.merge(part);
    }
    CHECK(sum == whole);
  }
}

TEST_CASE("A.6-5 exact column-quantile contract: b_j = -sort_desc(s - alpha)[floor(mk/n)]") {
  for (auto [m, n, k] : {std::tuple<index_t, index_t, index_t>{64, 8, 2}, {40, 8, 1}, {12, 4, 1}, {1, 3, 2}, {33, 7, 3}}) {
    auto s = uniform(m * n, 0, 1, std::uint64_t(m + n + k));
    auto b = uniform(n, -0.2, 0.2, std::uint64_t(m));
    moe::router_options opt;
    opt.k = k;
    routed r(m, k, n);
    moe::route(k3::cpu::serial{}, r.args(cview(s, m, n), cview(b)), opt);
    std::vector<double> raw;
    REQUIRE(moe::detail::qb_exact_quantile(cview(s, m, n), cview(r.cut), opt, raw));
    index_t const q = m * k / n;
    double mean = 0;
    for (index_t j = 0; j < n; ++j) {
      std::vector<float> col(static_cast<std::size_t>(m));
      for (index_t i = 0; i < m; ++i) col[i] = s[i * n + j] - r.cut[i];
      std::sort(col.begin(), col.end(), std::greater<>());
      CHECK(raw[j] == double(-col[q]));
      mean += raw[j];
    }
    mean /= double(n);
    auto b2 = b;
    REQUIRE(moe::qb_exact_update(k3::cpu::serial{}, moe::qb_exact_update_args<float>{.scores = cview(s, m, n), .cutoff = cview(r.cut), .bias = mview(b2)}, {.router = opt}));
    for (index_t j = 0; j < n; ++j) CHECK(b2[j] == static_cast<float>(raw[j] - mean));
  }
}

TEST_CASE("A.6-6 one step reduces imbalance (exact and histogram)") {
  index_t const m = 512, n = 8, k = 2;
  std::mt19937_64 g(5);
  std::normal_distribution<double> nd;
  std::vector<float> s(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) s[i * n + j] = float(1 / (1 + std::exp(-(nd(g) + (j == 0 ? 4 : j == 1 ? 2 : 0)))));
  std::vector<float> b0(n, 0.f);
  double e0 = l1_error(loads_with(s, b0, m, n, k), m, k);
  moe::router_options opt;
  opt.k = k;
  for (auto mode : {moe::qb_mode::exact, moe::qb_mode::histogram}) {
    moe::quantile_balancer qb(n, opt, {mode, 1000, 0.0});
    routed r(m, k, n);
    qb.route(k3::cpu::serial{}, r.args(cview(s, m, n)));
    CHECK(qb.step(k3::cpu::serial{}));
    std::vector<float> b1(qb.bias().data_handle(), qb.bias().data_handle() + n);
    double mean = std::accumulate(b1.begin(), b1.end(), 0.0) / double(n);
    CHECK(std::fabs(mean) < 1e-6);
    CHECK(b1[0] < b1[2]);  // the overloaded expert is pushed down
    double e1 = l1_error(loads_with(s, b1, m, n, k), m, k);
    CHECK(e1 < 0.5 * e0);
  }
}

TEST_CASE("A.6-8 causality: batch t is routed identically whether or not its update is computed") {
  index_t const m = 300, n = 16, k = 3;
  moe::router_options opt;
  opt.k = k;
  auto s0 = skewed_scores(m, n, 5.0, 1), s1 = skewed_scores(m, n, 5.0, 2);
  for (auto mode : {moe::qb_mode::exact, moe::qb_mode::histogram}) {
    moe::quantile_balancer a(n, opt, {mode, 1000, 0.0}), b(n, opt, {mode, 1000, 0.0});
    // step 0 on both, so the bias in use is not trivially zero
    routed w1(m, k, n), w2(m, k, n);
    a.route(k3::cpu::serial{}, w1.args(cview(s0, m, n)));
    b.route(k3::cpu::threads<>(2), w2.args(cview(s0, m, n)));
    a.step(k3::cpu::serial{});
    b.step(k3::cpu::serial{});
    std::vector<float> bias_t(a.bias().data_handle(), a.bias().data_handle() + n);
    routed ra(m, k, n), rb(m, k, n), rref(m, k, n);
    a.route(k3::cpu::serial{}, ra.args(cview(s1, m, n)));           // training: its update follows
    b.route(k3::cpu::serial{}, rb.args(cview(s1, m, n), {}, {}), {.training = false});  // no update computed
    CHECK(a.step(k3::cpu::serial{}));
    moe::route(k3::cpu::serial{}, rref.args(cview(s1, m, n), cview(bias_t)), opt);
    CHECK(ra.idx == rb.idx);
    CHECK(ra.w == rb.w);
    CHECK(ra.idx == rref.idx);
    // and the update did change the bias, so the check above is not vacuous
    std::vector<float> bias_next(a.bias().data_handle(), a.bias().data_handle() + n);
    CHECK(bias_next != bias_t);
    routed rn(m, k, n);
    moe::route(k3::cpu::serial{}, rn.args(cview(s1, m, n), cview(bias_next)), opt);
    CHECK(rn.idx != ra.idx);
  }
}

TEST_CASE("lifecycle: eval routing does not accumulate, discard drops a failed step, EMA is centred") {
  index_t const m = 128, n = 8, k = 2;
  moe::router_options opt;
  opt.k = k;
  auto s = skewed_scores(m, n, 3.0, 8);
  moe::quantile_balancer qb(n, opt);
  routed r(m, k, n);
  qb.route(k3::cpu::serial{}, r.args(cview(s, m, n), {}, {}), {.training = false});
  CHECK(qb.pending_tokens() == 0);
  qb.route(k3::cpu::serial{}, r.args(cview(s, m, n)));
  qb.route(k3::cpu::serial{}, r.args(cview(s, m, n)));
  CHECK(qb.pending_tokens() == 2 * m);  // exactly once per micro-batch
  qb.discard();
  CHECK(qb.pending_tokens() == 0);
  CHECK_FALSE(qb.step(k3::cpu::serial{}));
  // EMA: centred(ema * old + (1 - ema) * new)
  std::vector<float> old = {0.3f, -0.1f, -0.2f, 0.f, 0.f, 0.f, 0.f, 0.f};
  routed r2(m, k, n);
  moe::route(k3::cpu::serial{}, r2.args(cview(s, m, n), cview(old)), opt);
  std::vector<double> raw;
  REQUIRE(moe::detail::qb_exact_quantile(cview(s, m, n), cview(r2.cut), opt, raw));
  double mean = std::accumulate(raw.begin(), raw.end(), 0.0) / double(n);
  auto b = old;
  REQUIRE(moe::qb_exact_update(k3::cpu::serial{}, moe::qb_exact_update_args<float>{.scores = cview(s, m, n), .cutoff = cview(r2.cut), .bias = mview(b)}, {.router = opt, .ema = 0.75}));
  for (index_t j = 0; j < n; ++j) CHECK(b[j] == doctest::Approx(0.75 * old[j] + 0.25 * (raw[j] - mean)).epsilon(1e-5));
  CHECK_THROWS_AS(moe::qb_exact_update(k3::cpu::serial{}, moe::qb_exact_update_args<float>{.scores = cview(s, m, n), .cutoff = cview(r2.cut), .bias = mview(b)}, {.router = opt, .ema = 1.0}), k3::error);
}

TEST_CASE("property: offline solver reaches max|load - q| < 5% of q within 12 iterations (m=4096, n=64, k=4)") {
  index_t const m = 4096, n = 64, k = 4;
  double const q = double(m) * k / n;
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    auto s = skewed_scores(m, n, 6.0, seed);
    std::vector<float> b0(n, 0.f);
    double v0 = max_violation(loads_with(s, b0, m, n, k), m, k);
    CHECK(v0 > 1.0);  // strongly unbalanced to start with
    moe::router_options opt;
    opt.k = k;
    std::vector<float> b(n);
    moe::qb_offline_solve(k3::cpu::serial{}, moe::qb_offline_args<float>{.scores = cview(s, m, n), .bias = mview(b)}, {.router = opt, .iterations = 12});
    auto load = loads_with(s, b, m, n, k);
    double v = max_violation(load, m, k);
    MESSAGE("seed " << seed << ": initial max violation " << v0 << ", after 12 iterations " << v << " (q = " << q << ")");
    CHECK(v < 0.05);
    // 1 iteration is worse than 12
    moe::qb_offline_solve(k3::cpu::serial{}, moe::qb_offline_args<float>{.scores = cview(s, m, n), .bias = mview(b)}, {.router = opt, .iterations = 1});
    CHECK(max_violation(loads_with(s, b, m, n, k), m, k) >= v);
    // Algorithm 1's literal (k+1)-th / (q+1)-th convention converges too, more slowly
    moe::qb_offline_solve(k3::cpu::serial{}, moe::qb_offline_args<float>{.scores = cview(s, m, n), .bias = mview(b)}, {.router = opt, .iterations = 12, .cut = moe::qb_cut::next});
    double vn = max_violation(loads_with(s, b, m, n, k), m, k);
    MESSAGE("  (k+1)-th convention after 12 iterations: " << vn);
    CHECK(vn < 0.15);
  }
}

TEST_CASE("property: the per-step causal update stays within a few 1/sqrt(q) on a stream") {
  index_t const m = 4096, n = 64, k = 4;
  double const q = double(m) * k / n, floor_ = 1 / std::sqrt(q);
  moe::router_options opt;
  opt.k = k;
  k3::cpu::threads<> thr(2);
  for (auto mode : {moe::qb_mode::exact, moe::qb_mode::histogram}) {
    moe::quantile_balancer qb(n, opt, {mode, 1000, 0.0});
    double worst_late = 0, first = 0;
    for (int t = 0; t < 24; ++t) {
      auto s = skewed_scores(m, n, 6.0, 1000 + std::uint64_t(t));
      routed r(m, k, n);
      qb.route(thr, r.args(cview(s, m, n)));
      double v = max_violation(r.load, m, k);
      if (t == 0) first = v;
      if (t >= 6) worst_late = std::max(worst_late, v);
      qb.step(k3::cpu::serial{});
    }
    MESSAGE(std::string(mode == moe::qb_mode::exact ? "exact" : "histogram") << ": step 0 " << first << ", worst after step 6 " << worst_late
                                                                  << " = " << worst_late / floor_ << " x 1/sqrt(q)");
    CHECK(first > 1.0);
    CHECK(worst_late < 6 * floor_);
  }
}

TEST_CASE("QB inputs are validated") {
  std::vector<float> s(12, 0.5f), cut(3, 0.f), b(4, 0.f);
  moe::router_options opt;
  opt.k = 4;
  std::vector<double> out;
  CHECK_THROWS_AS(moe::detail::qb_exact_quantile(cview(s, 3, 4), cview(cut), opt, out), k3::error);
  opt.k = 1;
  std::vector<float> cut2(2, 0.f);
  CHECK_THROWS_AS(moe::detail::qb_exact_quantile(cview(s, 3, 4), cview(cut2), opt, out), k3::error);
  CHECK_THROWS_AS(moe::qb_histogram(4, 0, 0.f, 1.f), k3::error);
  CHECK_THROWS_AS(moe::qb_histogram(4, 10, 1.f, 1.f), k3::error);
  std::vector<float> b5(5, 0.f);
  CHECK_THROWS_AS(moe::qb_offline_solve(k3::cpu::serial{}, moe::qb_offline_args<float>{.scores = cview(s, 3, 4), .bias = mview(b5)}, {.router = opt, .iterations = 3}), k3::error);
  // regression: the offline solver ignored n_groups (k3 route --solve --groups 2 solved for
  // ungrouped routing, then routed group-limited with that bias)
  opt.n_groups = 2;
  opt.topk_groups = 1;
  CHECK_THROWS_WITH_AS(moe::qb_offline_solve(k3::cpu::serial{}, moe::qb_offline_args<float>{.scores = cview(s, 3, 4), .bias = mview(b)}, {.router = opt, .iterations = 3}), doctest::Contains("group-limited"), k3::error);
  opt.n_groups = 1;
  auto h = moe::qb_histogram::for_bias(cview(b5), 10);
  routed r(3, 1, 4);
  CHECK_THROWS_AS(moe::route(k3::cpu::serial{}, r.args(cview(s, 3, 4), cview(b), {}, &h), opt), k3::error);
}
