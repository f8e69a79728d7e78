#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "moe/moe_test_util.hpp"

using namespace moe_test;
namespace moe = k3::moe;

namespace {

// Independent brute force: k+1 rounds of "best remaining expert" (highest z, lowest index
// first); weights in double.
void brute_route(std::vector<float> const& s, std::vector<float> const& b, index_t m, index_t n, index_t k, double scale,
                 std::vector<std::int32_t>& idx, std::vector<double>& w, std::vector<float>& cut) {
  idx.assign(static_cast<std::size_t>(m * k), 0);
  w.assign(static_cast<std::size_t>(m * k), 0);
  cut.assign(static_cast<std::size_t>(m), 0);
  for (index_t i = 0; i < m; ++i) {
    std::vector<char> taken(static_cast<std::size_t>(n), 0);
    double sum = 0;
    for (index_t r = 0; r <= k; ++r) {
      index_t best = -1;
      float bz = 0;
      for (index_t j = 0; j < n; ++j) {
        if (taken[j]) continue;
        float z = s[i * n + j] + b[j];
        if (best < 0 || z > bz) best = j, bz = z;
      }
      taken[best] = 1;
      if (r < k) {
        idx[i * k + r] = static_cast<std::int32_t>(best);
        sum += s[i * n + best];
      } else {
        cut[i] = bz;
      }
    }
    for (index_t r = 0; r < k; ++r) w[i * k + r] = s[i * n + idx[i * k + r]] / sum * scale;
  }
}

template <class B>
void check_against_brute(B const& backend, index_t m, index_t n, index_t k, std::uint64_t seed, bool ties) {
  auto s = uniform(m * n, 0.0, 1.0, seed);
  auto b = uniform(n, -0.2, 0.2, seed + 1);
  if (ties) {  // coarse grid: many exact ties in s + b
    for (auto& x : s) x = std::round(x * 8.f) / 8.f;
    for (auto& x : b) x = std::round(x * 8.f) / 8.f;
  }
  moe::router_options opt;
  opt.k = k;
  opt.routed_scale = 2.5f;
  routed r(m, k, n);
  moe::route(backend, r.args(cview(s, m, n), cview(b)), opt);
  std::vector<std::int32_t> idx;
  std::vector<double> w;
  std::vector<float> cut;
  brute_route(s, b, m, n, k, 2.5, idx, w, cut);
  CHECK(r.idx == idx);
  CHECK(r.cut == cut);
  double maxerr = 0;
  for (std::size_t x = 0; x < w.size(); ++x) maxerr = std::max(maxerr, std::fabs(r.w[x] - w[x]) / w[x]);
  CHECK(maxerr < 1e-5);
  std::vector<std::int64_t> load(static_cast<std::size_t>(n), 0);
  for (auto j : idx) ++load[j];
  CHECK(r.load == load);
}

// Every output of two routing runs, bit for bit: indices, weights, cut-offs, loads, histogram.
void check_bit_identical(routed const& got, moe::qb_histogram const& hgot, routed const& want, moe::qb_histogram const& hwant) {
  CHECK(got.idx == want.idx);
  CHECK(std::memcmp(got.w.data(), want.w.data(), want.w.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(got.cut.data(), want.cut.data(), want.cut.size() * sizeof(float)) == 0);
  CHECK(got.load == want.load);
  CHECK(hgot == hwant);
}

}  // namespace

// The args and options are aggregates (designated initialisers) that the ops take on every CPU backend.
template <class Be>
constexpr bool moe_ops_accept =
    requires(Be const& be, moe::route_args<float> const& r, moe::qb_accumulate_args<float> const& acc, moe::qb_update_args<float> const& up,
             moe::qb_exact_update_args<float> const& ex, moe::qb_offline_args<float> const& off, moe::expert_ffn_args<float> const& ff,
             moe::expert_ffn_backward_args<double> const& fb, moe::eplb_args<double> const& ep, moe::quantile_balancer& qb) {
      moe::route(be, r, moe::router_options{});
      moe::qb_accumulate(be, acc, moe::router_options{});
      moe::qb_update(be, up, moe::qb_update_options{});
      moe::qb_exact_update(be, ex, moe::qb_update_options{});
      moe::qb_offline_solve(be, off, moe::qb_offline_options{});
      moe::expert_ffn_forward(be, ff, moe::expert_ffn_options<float>{});
      moe::expert_ffn_backward(be, fb, moe::expert_ffn_options<double>{});
      moe::eplb(be, ep, moe::eplb_options{});
      qb.route(be, r, moe::qb_route_options{});
      qb.step(be, moe::qb_step_args<>{});
    };
static_assert(std::is_aggregate_v<moe::route_args<float>> && std::is_aggregate_v<moe::qb_accumulate_args<float>> &&
              std::is_aggregate_v<moe::qb_update_args<float>> && std::is_aggregate_v<moe::qb_exact_update_args<float>> &&
              std::is_aggregate_v<moe::qb_offline_args<float>> && std::is_aggregate_v<moe::expert_ffn_args<float>> &&
              std::is_aggregate_v<moe::expert_ffn_backward_args<float>> && std::is_aggregate_v<moe::eplb_args<double>> &&
              std::is_aggregate_v<moe::qb_step_args<>> && std::is_aggregate_v<moe::qb_update_options> &&
              std::is_aggregate_v<moe::qb_offline_options> && std::is_aggregate_v<moe::eplb_options> &&
              std::is_aggregate_v<moe::expert_ffn_options<float>> && std::is_aggregate_v<moe::qb_route_options>);
static_assert(moe_ops_accept<k3::cpu::serial> && moe_ops_accept<k3::cpu::simd<>> && moe_ops_accept<k3::cpu::threads<>>);

TEST_CASE("serial router matches a brute-force top-k with the documented tie-breaking") {
  k3::cpu::serial ser;
  check_against_brute(ser, 1, 2, 1, 1, false);
  check_against_brute(ser, 7, 13, 3, 2, false);
  check_against_brute(ser, 33, 64, 8, 3, true);
  check_against_brute(ser, 5, 896, 16, 4, false);
  check_against_brute(ser, 9, 40, 39, 5, true);  // k = n - 1
}

TEST_CASE("threads router matches the brute force (odd n, ties, k = n - 1)") {
  for (int nt : {1, 2, 3}) {
    k3::cpu::threads<> thr(nt);
    check_against_brute(thr, 1, 2, 1, 11, false);
    check_against_brute(thr, 17, 37, 5, 12, true);
    check_against_brute(thr, 31, 896, 16, 13, false);
    check_against_brute(thr, 8, 33, 32, 14, true);
    check_against_brute(thr, 64, 17, 16, 15, true);
  }
}

TEST_CASE("threads router and fused histogram are bit-identical to the serial reference") {
  for (auto [m, n, k] : {std::tuple<index_t, index_t, index_t>{1, 5, 2}, {100, 37, 4}, {257, 896, 16}, {64, 16, 15}}) {
    auto s = skewed_scores(m, n, 3.0, std::uint64_t(m * n));
    auto b = uniform(n, -0.3, 0.3, std::uint64_t(k));
    for (auto& x : s) x = std::round(x * 64.f) / 64.f;  // ties
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(m), 1);
    for (index_t i = 0; i < m; i += 3) mask[i] = 0;
    moe::router_options opt;
    opt.k = k;
    k3::const_view<std::uint8_t, 1> mv(mask.data(), {m});
    routed r1(m, k, n), r2(m, k, n);
    auto h1 = moe::qb_histogram::for_bias(cview(b), 97), h2 = h1;
    moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b), mv, &h1), opt);
    k3::cpu::threads<> thr(3);
    moe::route(thr, r2.args(cview(s, m, n), cview(b), mv, &h2), opt);
    CHECK(r1.idx == r2.idx);
    CHECK(std::memcmp(r1.w.data(), r2.w.data(), r1.w.size() * sizeof(float)) == 0);
    CHECK(r1.cut == r2.cut);
    CHECK(r1.load == r2.load);
    CHECK(h1 == h2);
    std::int64_t real = std::count(mask.begin(), mask.end(), 1);
    CHECK(h1.tokens() == real);
  }
}

TEST_CASE("padding tokens are never dispatched and not counted") {
  index_t const m = 6, n = 8, k = 2;
  auto s = uniform(m * n, 0, 1, 7);
  std::vector<float> b(n, 0.f);
  std::vector<std::uint8_t> mask = {1, 0, 1, 1, 0, 1};
  moe::router_options opt;
  opt.k = k;
  for (int backend = 0; backend < 2; ++backend) {
    routed r(m, k, n);
    k3::const_view<std::uint8_t, 1> mv(mask.data(), {m});
    if (backend == 0) moe::route(k3::cpu::serial{}, r.args(cview(s, m, n), cview(b), mv), opt);
    else moe::route(k3::cpu::threads<>(2), r.args(cview(s, m, n), cview(b), mv), opt);
    std::int64_t total = 0;
    for (auto l : r.load) total += l;
    CHECK(total == 4 * k);
    for (index_t i : {1, 4})
      for (index_t x = 0; x < k; ++x) {
        CHECK(r.idx[i * k + x] == -1);
        CHECK(r.w[i * k + x] == 0.f);
      }
  }
}

TEST_CASE("weights come from the unbiased scores, renormalised and scaled") {
  // Bias flips the choice to experts 2 and 3, but weights use s only.
  std::vector<float> s = {0.9f, 0.8f, 0.2f, 0.1f};
  std::vector<float> b = {-1.f, -1.f, 1.f, 1.f};
  moe::router_options opt;
  opt.k = 2;
  opt.routed_scale = 2.0f;
  routed r(1, 2, 4);
  moe::route(k3::cpu::serial{}, r.args(cview(s, 1, 4), cview(b)), opt);
  CHECK(r.idx == std::vector<std::int32_t>{2, 3});
  CHECK(r.w[0] == doctest::Approx(2.0 * 0.2 / 0.3));
  CHECK(r.w[1] == doctest::Approx(2.0 * 0.1 / 0.3));
  CHECK(r.cut[0] == doctest::Approx(0.9f - 1.f));
}

// Regression: the "+ 1e-20" of Megatron's renormalisation shrank every weight once the
// chosen scores summed below ~1e-13 (scores 1e-30 gave weights 1e-10 instead of 1/k; logits
// below -30 do that). The weights are scale-invariant: scaling all scores by a power of two
// changes neither the choice nor a single bit of the weights.
TEST_CASE("weights are scale-invariant for tiny scores, an all-zero choice gives zero weights") {
  index_t const m = 37, n = 40, k = 16;  // k = 16: the AVX-512 emit path
  auto s = uniform(m * n, 0.0, 1.0, 91);
  std::vector<float> b(static_cast<std::size_t>(n), 0.f);
  moe::router_options opt;
  opt.k = k;
  opt.routed_scale = 2.5f;
  routed r1(m, k, n);
  moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b)), opt);
  for (float sc : {0x1p-100f, 0x1p-60f}) {
    std::vector<float> t(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) t[i] = s[i] * sc;  // exact, all normal
    routed r2(m, k, n), r3(m, k, n);
    moe::route(k3::cpu::serial{}, r2.args(cview(t, m, n), cview(b)), opt);
    moe::route(k3::cpu::threads<>(2), r3.args(cview(t, m, n), cview(b)), opt);
    CHECK(r2.idx == r1.idx);
    CHECK(r2.w == r1.w);
    CHECK(r3.idx == r1.idx);
    CHECK(r3.w == r1.w);
  }
  std::vector<float> z = {0.f, 0.f, 0.5f, 0.f};  // bias picks experts 0 and 1, both score 0
  std::vector<float> bz = {1.f, 1.f, 0.f, 0.f};
  opt.k = 2;
  routed rz(1, 2, 4);
  moe::route(k3::cpu::serial{}, rz.args(cview(z, 1, 4), cview(bz)), opt);
  CHECK(rz.idx == std::vector<std::int32_t>{0, 1});
  CHECK(rz.w == std::vector<float>{0.f, 0.f});
}

TEST_CASE("logit input applies a FP32 sigmoid") {
  index_t const m = 5, n = 12, k = 3;
  auto x = uniform(m * n, -4, 4, 21);
  std::vector<float> s(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) s[i] = k3::detail::sigmoid(x[i]);
  auto b = uniform(n, -0.1, 0.1, 22);
  moe::router_options opt;
  opt.k = k;
  routed r1(m, k, n), r2(m, k, n), r3(m, k, n);
  moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b)), opt);
  opt.input = moe::score_kind::logits;
  moe::route(k3::cpu::serial{}, r2.args(cview(x, m, n), cview(b)), opt);
  moe::route(k3::cpu::threads<>(2), r3.args(cview(x, m, n), cview(b)), opt);
  CHECK(r1.idx == r2.idx);
  CHECK(r1.w == r2.w);
  CHECK(r2.idx == r3.idx);
  CHECK(r2.w == r3.w);
}

TEST_CASE("group-limited routing masks dropped groups with -inf, not 0") {
  // All biased scores negative: a multiplicative 0 mask would let the dropped group win.
  std::vector<float> s = {0.9f, 0.8f, 0.1f, 0.05f, 0.2f, 0.3f};
  std::vector<float> b(6, -5.f);
  moe::router_options opt;
  opt.k = 2;
  opt.n_groups = 3;
  opt.topk_groups = 1;
  for (int backend = 0; backend < 2; ++backend) {
    routed r(1, 2, 6);
    if (backend == 0) moe::route(k3::cpu::serial{}, r.args(cview(s, 1, 6), cview(b)), opt);
    else moe::route(k3::cpu::threads<>(2), r.args(cview(s, 1, 6), cview(b)), opt);
    CHECK(r.idx == std::vector<std::int32_t>{0, 1});
    CHECK(r.cut[0] == -std::numeric_limits<float>::infinity());
  }
  // Group score = sum of the two best biased scores: group 1 {0.6, 0.55} beats group 0 {0.9, 0.05}.
  std::vector<float> s2 = {0.9f, 0.05f, 0.6f, 0.55f};
  std::vector<float> b0(4, 0.f);
  opt.n_groups = 2;
  routed r(1, 2, 4);
  moe::route(k3::cpu::serial{}, r.args(cview(s2, 1, 4), cview(b0)), opt);
  CHECK(r.idx == std::vector<std::int32_t>{2, 3});
}

TEST_CASE("bad input gives a k3::error naming the argument") {
  index_t const m = 4, n = 8;
  auto s = uniform(m * n, 0, 1, 3);
  std::vector<float> b(n, 0.f);
  auto expect_error = [&](auto&& f, char const* needle) {
    bool thrown = false;
    try {
      f();
    } catch (k3::error const& e) {
      thrown = std::string(e.what()).find(needle) != std::string::npos;
      if (!thrown) MESSAGE(e.what());
    }
    CHECK_MESSAGE(thrown, needle);
  };
  k3::cpu::serial ser;
  k3::cpu::threads<> thr(2);
  moe::router_options opt;
  opt.k = 8;
  routed r8(m, 8, n);
  expect_error([&] { moe::route(ser, r8.args(cview(s, m, n), cview(b)), opt); }, "'k'");
  opt.k = 2;
  routed r(m, 2, n);
  std::vector<float> b7(7, 0.f);
  expect_error([&] { moe::route(ser, r.args(cview(s, m, n), cview(b7)), opt); }, "'bias': expected shape [8]");
  expect_error([&] { moe::route(thr, r.args(cview(s, m, n), cview(b7)), opt); }, "'bias'");
  routed r0(0, 2, n);
  expect_error([&] { moe::route(ser, r0.args(cview(s, 0, n), cview(b)), opt); }, "zero tokens");
  routed rbad(m, 3, n);
  expect_error([&] { moe::route(ser, rbad.args(cview(s, m, n), cview(b)), opt); }, "'indices'");
  for (float badv : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    auto s2 = s;
    s2[2 * n + 5] = badv;
    expect_error([&] { moe::route(ser, r.args(cview(s2, m, n), cview(b)), opt); }, "token 2, expert 5");
    expect_error([&] { moe::route(thr, r.args(cview(s2, m, n), cview(b)), opt); }, "token 2, expert 5");
    std::vector<float> sbig = uniform(3 * 64, 0, 1, 9), bb(64, 0.f);
    sbig[64 + 40] = badv;  // inside the SIMD body
    routed rb(3, 2, 64);
    expect_error([&] { moe::route(thr, rb.args(cview(sbig, 3, 64), cview(bb)), opt); }, "token 1, expert 40");
  }
  auto b2 = b;
  b2[3] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { moe::route(ser, r.args(cview(s, m, n), cview(b2)), opt); }, "'bias': non-finite");
  opt.n_groups = 3;
  expect_error([&] { moe::route(ser, r.args(cview(s, m, n), cview(b)), opt); }, "'n_groups'");
}

TEST_CASE("threads router stays exact when the carried threshold guess is poor") {
  // Rows alternate between very different score ranges (forces the lowered-guess retries and
  // the exact fallback), rows of all-equal scores (every expert is a candidate: the sort path),
  // and rows where the best experts sit at the end (ascending order).
  index_t const m = 240, n = 300, k = 16;
  auto base = uniform(m * n, 0, 1, 41);
  std::vector<float> s(base.size());
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      float x = base[i * n + j];
      switch (i % 6) {
        case 0: s[i * n + j] = x; break;
        case 1: s[i * n + j] = 0.01f * x; break;         // far below the previous guess
        case 2: s[i * n + j] = 0.5f; break;              // all tied
        case 3: s[i * n + j] = float(j) / float(n); break; // ascending
        case 4: s[i * n + j] = 0.99f + 0.01f * x; break; // far above
        default: s[i * n + j] = std::round(x * 4.f) / 4.f; break;  // heavy ties
      }
    }
  auto b = uniform(n, -0.01, 0.01, 42);
  for (index_t j = 0; j < n; j += 7) b[j] = 0.f;
  moe::router_options opt;
  opt.k = k;
  for (index_t kk : {1, 16, 40}) {
    opt.k = kk;
    routed r1(m, kk, n), r2(m, kk, n);
    auto h1 = moe::qb_histogram::for_bias(cview(b), 50), h2 = h1;
    moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b), {}, &h1), opt);
    moe::route(k3::cpu::threads<>(2), r2.args(cview(s, m, n), cview(b), {}, &h2), opt);
    CHECK(r1.idx == r2.idx);
    CHECK(std::memcmp(r1.w.data(), r2.w.data(), r1.w.size() * sizeof(float)) == 0);
    CHECK(r1.cut == r2.cut);
    CHECK(h1 == h2);
  }
}

namespace {

// Routes with cpu::threads (1..3 threads) and the serial reference; everything bit-identical.
void check_threads_vs_serial(std::vector<float> const& s, std::vector<float> const& b, index_t m, index_t n, index_t k,
                             index_t bins = 61) {
  moe::router_options opt;
  opt.k = k;
  opt.routed_scale = 1.5f;
  routed r1(m, k, n);
  auto h1 = moe::qb_histogram::for_bias(cview(b), bins);
  moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b), {}, &h1), opt);
  for (int nt : {1, 2, 3}) {
    routed r2(m, k, n);
    auto h2 = moe::qb_histogram::for_bias(cview(b), bins);
    moe::route(k3::cpu::threads<>(nt), r2.args(cview(s, m, n), cview(b), {}, &h2), opt);
    CHECK(r1.idx == r2.idx);
    CHECK(std::memcmp(r1.w.data(), r2.w.data(), r1.w.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(r1.cut.data(), r2.cut.data(), r1.cut.size() * sizeof(float)) == 0);
    CHECK(r1.load == r2.load);
    CHECK(h1 == h2);
  }
}

}  // namespace

TEST_CASE("threads router: the carried-guess SIMD selection is exact on awkward streams") {
  // A stationary stream primes the running cut-off statistics; the rows after it break them:
  // all-equal rows, exact ties around the cut-off, a row far below (too few candidates: the
  // lowered retries and the general path), far above, a flat high plateau (more candidates
  // than the register path holds), +-0 ties, and scores whose s + b overflows to +inf.
  for (auto nk : {std::pair<index_t, index_t>{17, 1}, {17, 15}, {33, 16}, {37, 32}, {100, 47}, {100, 48}, {897, 16}, {1024, 16},
                  {1025, 16}, {896, 2}}) {
    index_t const n = nk.first, k = nk.second;  // plain names: clang 14 cannot capture bindings
    CAPTURE(n);
    CAPTURE(k);
    index_t const m = 90;
    auto s = skewed_scores(m, n, 2.0, std::uint64_t(n * 31 + k));
    auto b = uniform(n, -0.05, 0.05, std::uint64_t(n + k));
    auto row = [&](index_t i) { return s.begin() + i * n; };
    std::fill(row(40), row(41), 0.5f);                                   // all equal
    for (index_t j = 0; j < n; ++j) s[41 * n + j] = std::round(s[41 * n + j] * 16.f) / 16.f;  // heavy ties
    for (index_t j = 0; j < n; ++j) s[42 * n + j] *= 1e-3f;             // far below the guess
    for (index_t j = 0; j < n; ++j) s[43 * n + j] = 0.999f + 1e-3f * s[43 * n + j];
    for (index_t j = 0; j < n; ++j) s[44 * n + j] = j % 3 == 0 ? 0.97f : s[44 * n + j];  // plateau: many tied candidates
    for (index_t j = 0; j < n; ++j) s[45 * n + j] = 0.9f + 0.05f * float(j % 7) / 7.f;  // many near-equal candidates
    s[46 * n + n - 1] = 3.4e38f;                                         // s + b overflows for b > 0
    s[46 * n + 0] = 3.4e38f;
    for (index_t j = 0; j < n; ++j) s[47 * n + j] = (j % 2) ? 0.f : -0.f;  // +-0 ties
    check_threads_vs_serial(s, b, m, n, k);
    // Bias ties too: equal biased scores from different (s, b) pairs.
    auto b2 = b;
    for (index_t j = 0; j < n; j += 2) b2[j] = 0.f;
    check_threads_vs_serial(s, b2, m, n, k, 1000);
  }
}

TEST_CASE("threads router: one token, and margins exactly on histogram bin edges") {
  for (index_t n : {2, 16, 19, 896}) {
    auto s = uniform(n, 0, 1, std::uint64_t(n));
    auto b = uniform(n, -0.1, 0.1, std::uint64_t(n + 1));
    check_threads_vs_serial(s, b, 1, n, 1);
  }
  // Scores on a grid of the bin width: margins fall on bin edges (and the cut-off itself).
  index_t const m = 70, n = 64, k = 4, bins = 40;
  std::vector<float> b(static_cast<std::size_t>(n), 0.f);
  b[0] = -0.5f;
  b[1] = 0.5f;  // range [-1.5, 1.5]: width 3 / 40 = 0.075
  auto s = uniform(m * n, 0, 1, 99);
  for (auto& x : s) x = std::round(x / 0.075f) * 0.075f;
  check_threads_vs_serial(s, b, m, n, k, bins);
}

TEST_CASE("threads router: margins far outside the histogram bounds clamp to the end bins like qb_bin") {
  // Finite scores outside (0, 1) put margins below lo and above hi, some so large that the
  // scaled margin overflows to +-inf or past INT_MIN: the SIMD binning (upper clamp in float,
  // floor in the conversion, lower clamp by saturation) must give qb_bin's end bins. Widths
  // with and without a whole 32 experts (the paired layout) and a partial tail.
  for (index_t n : {5, 32, 33, 37, 64, 96, 127, 896}) {
    for (index_t bins : {1, 7, 1000, 65536}) {
      CAPTURE(n);
      CAPTURE(bins);
      index_t const m = 40, k = std::min<index_t>(3, n - 1);
      auto s = uniform(m * n, -5, 6, std::uint64_t(n * 7 + bins));
      float const wild[] = {1e30f, -1e30f, 3e38f, -3e38f, 1e-45f, -1e-45f, 2.5e9f, -2.5e9f, 0.f, 1.f};
      for (index_t x = 0; x < m * n; x += 3) s[x] = wild[(x / 3) % 10];
      auto b = uniform(n, -0.1, 0.1, std::uint64_t(n + bins));
      check_threads_vs_serial(s, b, m, n, k, bins);
    }
  }
}

namespace {

// The one-thread router's error for skewed scores (m x n, seeds s_seed / b_seed) with v at
// (token, bad_j): late enough that the running guess is primed.
std::string nonfinite_route_error(index_t m, index_t n, index_t k, index_t token, index_t bad_j, float v, unsigned s_seed,
                                  unsigned b_seed) {
  moe::router_options opt;
  opt.k = k;
  auto s = skewed_scores(m, n, 1.0, s_seed);
  auto b = uniform(n, -0.05, 0.05, b_seed);
  s[std::size_t(token * n + bad_j)] = v;
  routed r(m, k, n);
  try {
    moe::route(k3::cpu::threads<>(1), r.args(cview(s, m, n), cview(b)), opt);
  } catch (k3::error const& e) {
    return e.what();
  }
  return {};
}

constexpr float nonfinite_values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                      -std::numeric_limits<float>::infinity()};

}  // namespace

TEST_CASE("threads router: a non-finite score after the running guess is primed is rejected by position") {
  for (index_t bad_j : {0, 15, 16, 31, 32, 36})
    for (float v : nonfinite_values)
      CHECK(nonfinite_route_error(50, 37, 4, 30, bad_j, v, 5, 6).find("'scores': non-finite value at token 30, expert " +
                                                                     std::to_string(bad_j)) != std::string::npos);
}

namespace {

// Serial reference vs cpu::threads (1..3 threads) with a padding mask, strided or contiguous
// outputs and a fused histogram: indices, weights, cut-offs, loads and counts bit-identical.
void check_threads_vs_serial_ex(std::vector<float> const& s, std::vector<float> const& b, index_t m, index_t n, index_t k,
                                std::vector<std::uint8_t> const& mask, bool strided) {
  moe::router_options opt;
  opt.k = k;
  opt.routed_scale = 2.5f;
  k3::const_view<std::uint8_t, 1> mv = mask.empty() ? k3::const_view<std::uint8_t, 1>{} : k3::const_view<std::uint8_t, 1>(mask.data(), {m});
  routed r1(m, k, n);
  auto h1 = moe::qb_histogram::for_bias(cview(b), 97);
  moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b), mv, &h1), opt);
  for (int nt : {1, 2, 3}) {
    CAPTURE(nt);
    index_t const ld = strided ? k + 3 : k;  // row stride of the outputs (padding columns)
    std::vector<std::int32_t> idx(static_cast<std::size_t>(m * ld), 77);
    std::vector<float> w(static_cast<std::size_t>(m * ld), 77.f), cut(static_cast<std::size_t>(m));
    std::vector<std::int64_t> load(static_cast<std::size_t>(n));
    auto h2 = moe::qb_histogram::for_bias(cview(b), 97);
    moe::route(k3::cpu::threads<>(nt),
               moe::route_args<float>{.scores = cview(s, m, n),
                                      .bias = cview(b),
                                      .mask = mv,
                                      .indices = k3::tensor_view<std::int32_t, 2>(idx.data(), {m, k}, {ld, 1}),
                                      .weights = k3::tensor_view<float, 2>(w.data(), {m, k}, {ld, 1}),
                                      .cutoff = k3::host_view(cut.data(), m),
                                      .load = k3::host_view(load.data(), n),
                                      .histogram = &h2},
               opt);
    bool same_idx = true, same_w = true, pad_kept = true;
    for (index_t i = 0; i < m; ++i) {
      for (index_t x = 0; x < k; ++x) {
        same_idx &= idx[i * ld + x] == r1.idx[i * k + x];
        same_w &= std::memcmp(&w[i * ld + x], &r1.w[i * k + x], sizeof(float)) == 0;
      }
      for (index_t x = k; x < ld; ++x) pad_kept &= idx[i * ld + x] == 77 && w[i * ld + x] == 77.f;
    }
    CHECK(same_idx);
    CHECK(same_w);
    CHECK(pad_kept);
    CHECK(std::memcmp(cut.data(), r1.cut.data(), cut.size() * sizeof(float)) == 0);
    CHECK(load == r1.load);
    CHECK(h1 == h2);
  }
}

}  // namespace

TEST_CASE("threads router: mask-pass selection on awkward widths, failed guesses, ties, padding and strided outputs") {
  // Widths around the 16-lane vectors and the 64-expert chunks of the candidate pass (tails of
  // 1..63 experts, rows shorter than one vector), k from 1 to n - 1 on both sides of the
  // AVX-512 path's k <= 48 limit. After a stationary stretch primes the running cut-off, rows
  // break the guesses: far below (both guesses fail: the lowered retries and the general
  // path), slightly below (the tight set fails, the generous one holds), a near-flat top with
  // more than 64 candidates, exact ties at and around the cut-off, +-0, and every
  // candidate in the tail chunk.
  for (index_t n : {2, 3, 15, 16, 17, 31, 48, 63, 64, 65, 80, 127, 129, 200, 1000, 1023, 1024, 1025}) {
    for (index_t k : {index_t(1), std::min<index_t>(n - 1, 16), std::min<index_t>(n - 1, 48), n - 1}) {
      CAPTURE(n);
      CAPTURE(k);
      index_t const m = 72;
      auto s = skewed_scores(m, n, 2.0, std::uint64_t(7 * n + k));
      auto b = uniform(n, -0.05, 0.05, std::uint64_t(n + 3 * k));
      auto row = [&](index_t i) { return s.begin() + i * n; };
      for (index_t j = 0; j < n; ++j) {
        s[50 * n + j] *= 1e-3f;                                 // far below
        s[51 * n + j] *= 0.97f;                                 // slightly below
        s[52 * n + j] = 0.95f + 1e-4f * float(j % 97) / 97.f;   // flat top: > 64 candidates
        s[53 * n + j] = std::round(s[53 * n + j] * 32.f) / 32.f;  // ties everywhere
        s[55 * n + j] = (j % 2) ? 0.f : -0.f;                   // +-0 ties
        s[56 * n + j] = j >= n - (n % 64 == 0 ? 64 : n % 64) ? 0.9f + 0.05f * float(j % 13) / 13.f : 0.01f;  // tail chunk only
      }
      std::copy(row(20), row(21), row(54));  // a repeated row, with one exact tie at its cut-off below
      if (k + 1 < n) {
        std::vector<std::pair<float, index_t>> z;
        for (index_t j = 0; j < n; ++j) z.push_back({s[54 * n + j] + b[j], j});
        std::sort(z.begin(), z.end(), [](auto const& x, auto const& y) { return x.first > y.first; });
        index_t const a = z[k].second, c = z[k + 1].second;  // make rank k+1 tie rank k exactly
        s[54 * n + c] = s[54 * n + a];
        b[c] = b[a];
      }
      std::vector<std::uint8_t> mask(static_cast<std::size_t>(m), 1);
      for (index_t i = 3; i < m; i += 7) mask[i] = 0;
      check_threads_vs_serial_ex(s, b, m, n, k, {}, false);
      check_threads_vs_serial_ex(s, b, m, n, k, mask, true);
    }
  }
}

TEST_CASE("threads router: non-finite scores in the candidate pass's tail chunk and last vector are rejected by position") {
  for (index_t n : {16, 64, 100, 1000}) {
    for (index_t bad_j : {index_t(0), index_t(15), n / 2, n - 17 < 0 ? index_t(1) : n - 17, n - 1}) {
      for (float v : nonfinite_values) {
        CAPTURE(n);
        CAPTURE(bad_j);
        CHECK(nonfinite_route_error(40, n, 4, 33, bad_j, v, 11, 12).find("'scores': non-finite value at token 33, expert " +
                                                                        std::to_string(bad_j)) != std::string::npos);
      }
    }
  }
}

TEST_CASE("threads router: 8-bit per-thread counts carry exactly (a bin past 255, 256 * 256 and 65535 counts)") {
  // Scores in (0.45, 0.55) put every margin into the middle one of 3 bins, so that bin's 8-bit
  // per-thread count wraps every 256 tokens: m = 140001 on one thread wraps it 546 times (and
  // passes 65535, where the old 16-bit counts spilled). n = 19: a 16-expert vector plus a tail,
  // on the mask-pass path.
  index_t const m = 140001, n = 19, k = 2;
  auto s = skewed_scores(m, n, 1.0, 77);
  for (auto& x : s) x = 0.45f + 0.1f * x;
  auto b = uniform(n, -0.02, 0.02, 78);
  moe::router_options opt;
  opt.k = k;
  routed r1(m, k, n);
  auto h1 = moe::qb_histogram::for_bias(cview(b), 3);
  moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b), {}, &h1), opt);
  std::int64_t maxc = 0;
  for (index_t j = 0; j < n; ++j)
    for (index_t x = 0; x < 3; ++x) maxc = std::max(maxc, h1(j, x));
  CHECK(maxc > 65535);
  for (int nt : {1, 2, 3, 5}) {  // threads take 64-token chunks: uneven shares, wraps at different tokens
    routed r2(m, k, n);
    auto h2 = moe::qb_histogram::for_bias(cview(b), 3);
    moe::route(k3::cpu::threads<>(nt), r2.args(cview(s, m, n), cview(b), {}, &h2), opt);
    CHECK(h1 == h2);
    CHECK(r1.idx == r2.idx);
  }
  // Token counts just around one and two wraps, on one thread, of identical tokens (every
  // count of an expert lands in one bin), for the blocked scatter (3 bins) and the per-token
  // one (70000 bins, more than the 16-bit bin buffer holds); added onto existing counts too.
  std::vector<float> same(static_cast<std::size_t>(513 * n));
  for (std::size_t x = 0; x < same.size(); ++x) same[x] = s[x % static_cast<std::size_t>(n)];
  for (index_t bins : {3, 70000}) {
    for (index_t mm : {255, 256, 257, 511, 512, 513}) {
      CAPTURE(bins);
      CAPTURE(mm);
      k3::const_view<float, 2> sv(same.data(), {mm, n});
      auto ref = moe::qb_histogram::for_bias(cview(b), bins);
      auto got = moe::qb_histogram::for_bias(cview(b), bins);
      routed ra(mm, k, n), rb(mm, k, n);
      for (int call = 0; call < 2; ++call) {
        moe::route(k3::cpu::serial{}, ra.args(sv, cview(b), {}, &ref), opt);
        moe::route(k3::cpu::threads<>(1), rb.args(sv, cview(b), {}, &got), opt);
        CHECK(got == ref);
      }
      std::int64_t top = 0;
      for (index_t x = 0; x < bins; ++x) top = std::max(top, ref(0, x));
      CHECK(top == 2 * mm);  // expert 0's margins did pile into one bin
    }
  }
}

TEST_CASE("threads router + fused histogram: random shapes, bins, masks, strides and thread counts, bit-identical to serial") {
  // 60 random configurations: odd and tiny n, k up to n - 1, bin counts on both sides of the
  // 16-bit bin buffer's limit (65536), rows with a padded stride, padding masks, a fresh or an
  // already-touched histogram, 1-4 threads; two calls into the same histogram.
  std::mt19937_64 g(20261130);
  auto pick = [&](index_t lo, index_t hi) { return std::uniform_int_distribution<index_t>(lo, hi)(g); };
  index_t const bin_choices[] = {1, 2, 7, 255, 1000, 65536, 65537};
  for (int c = 0; c < 60; ++c) {
    index_t const n = c % 7 == 0 ? 896 : c % 10 == 3 ? pick(2, 40) : pick(2, 200);
    index_t const k = pick(1, std::min<index_t>(n - 1, 20));
    index_t const m = c % 5 == 0 ? pick(1, 8) : pick(1, 700);
    // n x bins int64 counts: keep them small; every 10th configuration on the per-token path
    index_t const bins = c % 10 == 3 ? 65537 : bin_choices[pick(0, n <= 40 ? 6 : 4)];
    index_t const ld = n + pick(0, 3);
    int const nt = static_cast<int>(pick(1, 4));
    bool const masked = pick(0, 1) == 1, touched = pick(0, 1) == 1;
    CAPTURE(c);
    CAPTURE(n);
    CAPTURE(k);
    CAPTURE(m);
    CAPTURE(bins);
    CAPTURE(ld);
    CAPTURE(nt);
    auto dense = skewed_scores(m, n, double(pick(0, 3)), std::uint64_t(1000 + c));
    std::vector<float> s(static_cast<std::size_t>(m * ld), 7.f);  // padding never read
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j) s[i * ld + j] = dense[i * n + j];
    k3::const_view<float, 2> sv(s.data(), {m, n}, {ld, 1});
    auto b = uniform(n, -0.1, 0.1, std::uint64_t(2000 + c));
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(m), 1);
    for (auto& x : mask) x = pick(0, 3) != 0;
    k3::const_view<std::uint8_t, 1> mv = masked ? k3::const_view<std::uint8_t, 1>(mask.data(), {m}) : k3::const_view<std::uint8_t, 1>{};
    moe::router_options opt;
    opt.k = k;
    routed r1(m, k, n), r2(m, k, n);
    auto h1 = moe::qb_histogram::for_bias(cview(b), bins);
    auto h2 = moe::qb_histogram::for_bias(cview(b), bins);
    if (touched) (void)h2.data();
    for (int call = 0; call < 2; ++call) {
      moe::route(k3::cpu::serial{}, r1.args(sv, cview(b), mv, &h1), opt);
      moe::route(k3::cpu::threads<>(nt), r2.args(sv, cview(b), mv, &h2), opt);
      check_bit_identical(r2, h2, r1, h1);
    }
  }
}

TEST_CASE("threads router + fused histogram: more private histograms than the merge's 16-bit sums hold (300 threads)") {
  // The merge adds the threads' 8-bit counts in 16-bit lanes when at most 257 of them are
  // summed; with more it takes the scalar path. Every count is exact either way, onto a fresh
  // histogram and onto one that already holds counts. One bin and about 255 tokens per thread,
  // so that the private 8-bit counts wrap and carry as well.
  index_t const m = 300 * 255, n = 2, k = 1, bins = 1;
  auto s = skewed_scores(m, n, 1.0, 77);
  auto b = uniform(n, -0.1, 0.1, 78);
  moe::router_options opt;
  opt.k = k;
  routed r1(m, k, n), r2(m, k, n);
  auto h1 = moe::qb_histogram::for_bias(cview(b), bins), h2 = h1;
  k3::cpu::threads<> many(300);
  REQUIRE(many.concurrency() == 300);  // 300 private histograms (m >= 300 tokens)
  for (int call = 0; call < 2; ++call) {
    moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b), {}, &h1), opt);
    moe::route(many, r2.args(cview(s, m, n), cview(b), {}, &h2), opt);
    check_bit_identical(r2, h2, r1, h1);
  }
}

TEST_CASE("qb_histogram::known_zero tracks every way the counts can change") {
  std::vector<float> b{-0.1f, 0.f, 0.2f};
  auto h = moe::qb_histogram::for_bias(cview(b), 10);
  CHECK(h.known_zero());
  (void)h.data();
  CHECK_FALSE(h.known_zero());
  h.clear();
  CHECK(h.known_zero());
  h(1, 2) = 5;
  CHECK_FALSE(h.known_zero());
  h.reset_for_bias(cview(b));
  CHECK(h.known_zero());
  (void)h.counts();
  CHECK_FALSE(h.known_zero());
  h.clear();
  auto const& ch = h;
  (void)ch.data();
  (void)ch.counts();
  (void)ch(0, 0);
  CHECK(ch.known_zero());  // const access changes nothing
  auto other = moe::qb_histogram::for_bias(cview(b), 10);
  other(0, 0) = 1;
  h.merge(other);
  CHECK_FALSE(h.known_zero());
  CHECK(h(0, 0) == 1);
  // Routing into a fresh histogram writes the counts without reading them: a copy made after
  // a mutable access that left the counts zero is not "known zero", and both paths agree.
  index_t const m = 300, n = 3;
  auto s = uniform(m * n, 0.0, 1.0, 5);
  moe::router_options opt;
  opt.k = 1;
  auto fresh = moe::qb_histogram::for_bias(cview(b), 10);
  auto touched = moe::qb_histogram::for_bias(cview(b), 10);
  (void)touched.data();
  routed r(m, 1, n);
  moe::route(k3::cpu::threads<>(2), r.args(cview(s, m, n), cview(b), {}, &fresh), opt);
  moe::route(k3::cpu::threads<>(2), r.args(cview(s, m, n), cview(b), {}, &touched), opt);
  CHECK_FALSE(fresh.known_zero());
  CHECK(fresh == touched);
  CHECK(fresh.tokens() == m);
}

TEST_CASE("threads router: tokens handed out in chunks from a shared counter, any thread count and token count") {
  // The threads take chunks of min(64, m / (4 P)) tokens in order from one counter; which thread
  // routes a token must not matter: outputs, loads and the fused histogram (added onto existing
  // counts, twice) bit-identical to the serial reference for 1..5 threads, token counts around
  // the chunk sizes (and fewer tokens than threads), with and without a padding mask.
  for (index_t n : {37, 896}) {
    index_t const k = n == 37 ? 4 : 16;
    for (index_t m : {1, 2, 3, 5, 63, 64, 65, 129, 257, 1000}) {
      CAPTURE(n);
      CAPTURE(m);
      auto s = skewed_scores(m, n, 2.0, std::uint64_t(31 * m + n));
      auto b = uniform(n, -0.05, 0.05, std::uint64_t(m + 5));
      std::vector<std::uint8_t> mask(static_cast<std::size_t>(m), 1);
      for (index_t i = 1; i < m; i += 5) mask[i] = 0;
      for (bool masked : {false, true}) {
        CAPTURE(masked);
        k3::const_view<std::uint8_t, 1> mv = masked ? k3::const_view<std::uint8_t, 1>(mask.data(), {m}) : k3::const_view<std::uint8_t, 1>{};
        moe::router_options opt;
        opt.k = k;
        routed r1(m, k, n);
        auto h1 = moe::qb_histogram::for_bias(cview(b), 50);
        moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b), mv, &h1), opt);
        moe::route(k3::cpu::serial{}, r1.args(cview(s, m, n), cview(b), mv, &h1), opt);
        for (int nt = 1; nt <= 5; ++nt) {
          CAPTURE(nt);
          k3::cpu::threads<> thr(nt);
          routed r2(m, k, n);
          auto h2 = moe::qb_histogram::for_bias(cview(b), 50);
          moe::route(thr, r2.args(cview(s, m, n), cview(b), mv, &h2), opt);
          moe::route(thr, r2.args(cview(s, m, n), cview(b), mv, &h2), opt);
          check_bit_identical(r2, h2, r1, h1);
        }
      }
    }
  }
}

TEST_CASE("threads router: with several non-finite tokens the first one is reported, whatever the thread count") {
  // Chunks are handed out in order and finished once taken, so the smallest bad token any
  // thread records is the first bad token overall; the histogram stays untouched.
  index_t const m = 1000, n = 896, k = 16;
  auto b = uniform(n, -0.05, 0.05, 3);
  for (auto const& bad : std::vector<std::vector<std::pair<index_t, index_t>>>{
           {{700, 5}, {301, 9}, {300, 17}, {999, 0}}, {{0, 895}, {1, 0}}, {{999, 3}}, {{63, 1}, {64, 0}, {128, 2}}, {{63, 1}}}) {
    auto s = skewed_scores(m, n, 1.0, 4);
    index_t first = m, first_j = 0;
    for (auto [i, j] : bad) {
      s[std::size_t(i * n + j)] = std::numeric_limits<float>::quiet_NaN();
      if (i < first) first = i, first_j = j;
    }
    if (bad.size() == 1 && bad[0].first == 63)  // and every later token: each thread stops at its own first
      for (index_t i = 64; i < m; ++i) s[std::size_t(i * n + (i % n))] = -std::numeric_limits<float>::infinity();
    std::string const want = "'scores': non-finite value at token " + std::to_string(first) + ", expert " + std::to_string(first_j);
    for (int nt = 1; nt <= 5; ++nt) {
      CAPTURE(nt);
      CAPTURE(first);
      moe::router_options opt;
      opt.k = k;
      routed r(m, k, n);
      auto h = moe::qb_histogram::for_bias(cview(b), 100);
      h(0, 0) = 7;
      std::string got;
      try {
        moe::route(k3::cpu::threads<>(nt), r.args(cview(s, m, n), cview(b), {}, &h), opt);
      } catch (k3::error const& e) {
        got = e.what();
      }
      CHECK(got.find(want) != std::string::npos);
      CHECK(h.tokens() == 7);
    }
  }
  // A single token that is not finite, more threads than tokens.
  std::vector<float> s1(static_cast<std::size_t>(n), 0.5f), b1(static_cast<std::size_t>(n), 0.f);
  s1[400] = std::numeric_limits<float>::infinity();
  routed r(1, k, n);
  moe::router_options opt;
  opt.k = k;
  CHECK_THROWS_WITH_AS(moe::route(k3::cpu::threads<>(3), r.args(cview(s1, 1, n), cview(b1)), opt),
                       doctest::Contains("non-finite value at token 0, expert 400"), k3::error);
}
