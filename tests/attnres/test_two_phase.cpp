#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attnres/reference.hpp"
#include "k3/attnres.hpp"

namespace ar = k3::attnres;
using attnres_ref::rel_err;
using k3::index_t;

// Every op takes one aggregate of views, the same for each CPU backend.
static_assert(std::is_aggregate_v<ar::mix_forward_args<float>> && std::is_aggregate_v<ar::mix_backward_args<k3::bfloat16>> &&
              std::is_aggregate_v<ar::block_rinv_args<double>> && std::is_aggregate_v<ar::phase1_args<k3::bfloat16, float>> &&
              std::is_aggregate_v<ar::phase2_args<float>> && std::is_aggregate_v<ar::phase2_add_args<k3::bfloat16, float>> &&
              std::is_aggregate_v<ar::two_phase_options> && std::is_aggregate_v<ar::tuning>);
template <class B>
concept takes_attnres_args = requires(B const& b) {
  ar::mix_forward(b, ar::mix_forward_args<float>{}, ar::options{});
  ar::mix_backward(b, ar::mix_backward_args<k3::bfloat16, float, float>{}, ar::options{});
  ar::block_rinv(b, ar::block_rinv_args<double>{}, ar::two_phase_options{});
  ar::phase1(b, ar::phase1_args<k3::bfloat16, float>{}, ar::two_phase_options{});
  ar::phase2(b, ar::phase2_args<float>{}, ar::two_phase_options{});
  ar::phase2_add(b, ar::phase2_add_args<k3::bfloat16, float>{}, ar::two_phase_options{});
};
static_assert(takes_attnres_args<k3::cpu::serial> && takes_attnres_args<k3::cpu::simd<>> && takes_attnres_args<k3::cpu::threads<>>);

namespace {

template <class S>
std::vector<S> cast(std::vector<double> const& v) {
  std::vector<S> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = S(v[i]);
  return o;
}
template <class S>
std::vector<double> widen(std::vector<S> const& v) {
  std::vector<double> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = double(v[i]);
  return o;
}

// n completed blocks, nq sites, and a partial; compares phase 1 + phase 2 with the one-pass mix.
template <class S, class B>
double two_phase_vs_one_pass(B const& b, index_t n, index_t nq, index_t T, index_t d, std::uint64_t seed, bool check_lse,
                             double scale = 1.0) {
  using C = k3::accumulation_t<S>;
  attnres_ref::rng r(seed);
  std::vector<double> bankd(std::size_t(n * T * d));
  for (index_t j = 0; j < n; ++j) {
    double sc = std::exp(r.uniform(-1, 1));
    for (index_t i = 0; i < T * d; ++i) bankd[std::size_t(j * T * d + i)] = scale * sc * r.normal();
  }
  auto bank = cast<S>(bankd), part = cast<S>(r.normals<double>(std::size_t(T * d), 3.0 * scale));
  std::vector<double> wd = r.normals<double>(std::size_t(nq * d), 4.0 / std::sqrt(double(d))), gd = r.normals<double>(std::size_t(nq * d), 0.3);
  for (auto& x : gd) x += 1;
  auto w = cast<C>(wd), g = cast<C>(gd);
  std::vector<C> u(std::size_t(nq * d));
  for (std::size_t i = 0; i < u.size(); ++i) u[i] = w[i] * g[i];
  std::vector<C> rinv(std::size_t(n * T)), o(std::size_t(nq * T * d)), lse(std::size_t(nq * T));
  auto bv = k3::host_view(bank.data(), n, T, d);
  for (index_t j = 0; j < n; ++j)
    ar::block_rinv(b, ar::block_rinv_args<S>{.block = bv.slice(0, j), .rinv = k3::host_view(rinv.data() + j * T, T)}, {.eps = 1e-5});
  ar::phase1(b, ar::phase1_args<S, C>{.bank = bv,
                                      .bank_rinv = k3::tensor_view<C const, 2>(rinv.data(), {n, T}),
                                      .u = k3::tensor_view<C const, 2>(u.data(), {nq, d}),
                                      .o = k3::host_view(o.data(), nq, T, d),
                                      .lse = k3::host_view(lse.data(), nq, T)});
  double err = 0;
  for (index_t l = 0; l < nq; ++l) {
    auto wl = k3::host_view(w.data() + l * d, d), gl = k3::host_view(g.data() + l * d, d);
    auto ul = k3::tensor_view<C const, 1>(u.data() + l * d, {d});
    auto ol = k3::tensor_view<C const, 2>(o.data() + l * T * d, {T, d});
    auto ll = k3::tensor_view<C const, 1>(lse.data() + l * T, {T});
    std::vector<S> h1(std::size_t(T * d)), h2(h1.size()), h3(h1.size()), h4(h1.size());
    // first site of a block: bank only
    if (n > 0) {
      ar::mix_forward(b, ar::mix_forward_args<S>{.sources = ar::make_sources(bv), .w = wl, .gain = gl, .h = k3::host_view(h1.data(), T, d)});
      ar::phase2(b, ar::phase2_args<S, C>{.o = ol, .lse = ll, .u = ul, .h = k3::host_view(h2.data(), T, d)});
      err = std::max(err, rel_err(widen(h2), widen(h1)));
    }
    // later sites: bank + partial
    ar::mix_forward(b,
                    ar::mix_forward_args<S>{
                        .sources = ar::make_sources(bv, k3::host_view(part.data(), T, d)), .w = wl, .gain = gl, .h = k3::host_view(h3.data(), T, d)});
    ar::phase2(b, ar::phase2_args<S, C>{
                      .o = ol, .lse = ll, .partial = k3::tensor_view<S const, 2>(part.data(), {T, d}), .u = ul, .h = k3::host_view(h4.data(), T, d)});
    err = std::max(err, rel_err(widen(h4), widen(h3)));
    if (check_lse && n > 0) {
      for (index_t t = 0; t < T; ++t) {
        std::vector<attnres_ref::vec> V;
        for (index_t j = 0; j < n; ++j) V.emplace_back(bankd.begin() + (j * T + t) * d, bankd.begin() + (j * T + t + 1) * d);
        auto f = attnres_ref::forward(V, attnres_ref::vec(wd.begin() + l * d, wd.begin() + (l + 1) * d),
                                      attnres_ref::vec(gd.begin() + l * d, gd.begin() + (l + 1) * d), 1e-5);
        // lse = log sum_j exp(s_j); alpha_j = exp(s_j - lse) -> lse = s_0 - log alpha_0
        double s0 = f.r[0] * f.c[0];
        err = std::max(err, std::abs(double(lse[std::size_t(l * T + t)]) - (s0 - std::log(f.alpha[0]))) / (1 + std::abs(s0)));
      }
    }
  }
  return err;
}

}  // namespace

TEST_CASE("phase 1 + phase 2 equal the one-pass mix at every site (double: 1e-12, float: 1e-6)") {
  struct cs {
    index_t n, nq, T, d;
  };
  std::uint64_t seed = 1;
  for (cs c : {cs{1, 1, 1, 1}, cs{3, 5, 4, 33}, cs{8, 24, 3, 71}, cs{9, 3, 5, 16}, cs{2, 2, 0, 8}, cs{12, 7, 2, 40}, cs{0, 3, 3, 8}}) {
    CAPTURE(c.n);
    CAPTURE(c.nq);
    CAPTURE(c.d);
    CHECK(two_phase_vs_one_pass<double>(k3::cpu::serial{}, c.n, c.nq, c.T, c.d, seed, true) <= 1e-12);
    CHECK(two_phase_vs_one_pass<double>(k3::cpu::threads<>(2), c.n, c.nq, c.T, c.d, seed, true) <= 1e-12);
    CHECK(two_phase_vs_one_pass<float>(k3::cpu::serial{}, c.n, c.nq, c.T, c.d, seed, false) <= 1e-6);
    CHECK(two_phase_vs_one_pass<float>(k3::cpu::threads<>(2), c.n, c.nq, c.T, c.d, seed, false) <= 1e-6);
    CHECK(two_phase_vs_one_pass<k3::bfloat16>(k3::cpu::threads<>(2), c.n, c.nq, c.T, c.d, seed, false) <= 8e-3);  // h rounded to bf16
    ++seed;
  }
}

// Regression: the vector paths summed the partial's sum of squares (phase 2) and the
// phase-1 scores in float lanes, which overflow for rows beyond ~1e18 (resp. ~1e36): the
// two-phase result was then off by 100% (float) while the one-pass mix (double sums) was right.
TEST_CASE("two-phase equals one-pass for huge rows on the vector backends (float lane sums overflow)") {
  for (double scale : {1e20, 1e30, 1e37}) {
    CAPTURE(scale);
    CHECK(two_phase_vs_one_pass<float>(k3::cpu::threads<>(2), 3, 5, 4, 33, 61, false, scale) <= 1e-6);
    CHECK(two_phase_vs_one_pass<float>(k3::cpu::threads<>(2), 9, 3, 5, 256, 62, false, scale) <= 1e-6);
    CHECK(two_phase_vs_one_pass<k3::bfloat16>(k3::cpu::threads<>(2), 8, 3, 5, 512, 63, false, scale) <= 8e-3);
    // the fused residual add (AVX-512 bfloat16 kernel) against phase2 on the summed prefix
    index_t const T = 3, d = 96;
    attnres_ref::rng r(64);
    auto o = cast<k3::bfloat16>(r.normals<double>(std::size_t(T * d), scale)), pre = cast<k3::bfloat16>(r.normals<double>(std::size_t(T * d), scale)),
         del = cast<k3::bfloat16>(r.normals<double>(std::size_t(T * d), scale));
    auto u = cast<float>(r.normals<double>(std::size_t(d), 0.2));
    std::vector<float> lse = {0.5f, -1.f, 2.f};
    std::vector<k3::bfloat16> pre2(pre.size()), h1(pre.size()), h2(pre.size());
    for (std::size_t i = 0; i < pre.size(); ++i) pre2[i] = k3::bfloat16(float(pre[i]) + float(del[i]));
    ar::phase2_add(k3::cpu::threads<>(2), ar::phase2_add_args<k3::bfloat16>{.o = k3::tensor_view<k3::bfloat16 const, 2>(o.data(), {T, d}),
                                                                            .lse = k3::tensor_view<float const, 1>(lse.data(), {T}),
                                                                            .prefix = k3::host_view(pre.data(), T, d),
                                                                            .delta = k3::tensor_view<k3::bfloat16 const, 2>(del.data(), {T, d}),
                                                                            .u = k3::tensor_view<float const, 1>(u.data(), {d}),
                                                                            .h = k3::host_view(h1.data(), T, d)});
    ar::phase2(k3::cpu::serial{}, ar::phase2_args<k3::bfloat16>{.o = k3::tensor_view<k3::bfloat16 const, 2>(o.data(), {T, d}),
                                                                .lse = k3::tensor_view<float const, 1>(lse.data(), {T}),
                                                                .partial = k3::tensor_view<k3::bfloat16 const, 2>(pre2.data(), {T, d}),
                                                                .u = k3::tensor_view<float const, 1>(u.data(), {d}),
                                                                .h = k3::host_view(h2.data(), T, d)});
    CHECK(rel_err(widen(h1), widen(h2)) <= 8e-3);
  }
}

TEST_CASE("block_rinv is the inverse RMS of each token, phase2_add fuses the residual add") {
  index_t const T = 5, d = 19;
  attnres_ref::rng r(3);
  auto x = r.normals<double>(std::size_t(T * d), 0.01);
  std::vector<double> rinv(static_cast<std::size_t>(T));
  ar::block_rinv(k3::cpu::threads<>(2), ar::block_rinv_args<double>{.block = k3::host_view(x.data(), T, d), .rinv = k3::host_view(rinv.data(), T)},
                 {.eps = 1e-5});
  for (index_t t = 0; t < T; ++t) {
    double ss = 0;
    for (index_t k = 0; k < d; ++k) ss += x[std::size_t(t * d + k)] * x[std::size_t(t * d + k)];
    CHECK(std::abs(rinv[std::size_t(t)] - 1 / std::sqrt(ss / d + 1e-5)) <= 1e-12 * rinv[std::size_t(t)]);
  }
  // phase2_add(prefix, delta) == (prefix += delta; phase2(prefix))
  auto o = cast<float>(r.normals<double>(std::size_t(T * d))), pre = cast<float>(r.normals<double>(std::size_t(T * d))),
       del = cast<float>(r.normals<double>(std::size_t(T * d))), u = cast<float>(r.normals<double>(std::size_t(d)));
  std::vector<float> lse = {0.1f, -2.f, 3.f, 0.f, 1.f}, pre2 = pre, h1(std::size_t(T * d)), h2(h1.size());
  k3::cpu::threads<> b(2);
  ar::phase2_add(b, ar::phase2_add_args<float>{.o = k3::host_view(o.data(), T, d),
                                               .lse = k3::host_view(lse.data(), T),
                                               .prefix = k3::host_view(pre.data(), T, d),
                                               .delta = k3::host_view(del.data(), T, d),
                                               .u = k3::host_view(u.data(), d),
                                               .h = k3::host_view(h1.data(), T, d)});
  for (std::size_t i = 0; i < pre2.size(); ++i) pre2[i] += del[i];
  CHECK(pre == pre2);
  ar::phase2(b, ar::phase2_args<float>{.o = k3::host_view(o.data(), T, d),
                                       .lse = k3::host_view(lse.data(), T),
                                       .partial = k3::host_view(pre2.data(), T, d),
                                       .u = k3::host_view(u.data(), d),
                                       .h = k3::host_view(h2.data(), T, d)});
  CHECK(h1 == h2);
}

TEST_CASE("two-phase: a NaN in one token stays there, shape errors name the argument") {
  index_t const n = 3, nq = 4, T = 6, d = 10;
  attnres_ref::rng r(9);
  auto bank = cast<float>(r.normals<double>(std::size_t(n * T * d)));
  bank[std::size_t((1 * T + 3) * d + 2)] = std::numeric_limits<float>::quiet_NaN();  // token 3
  std::vector<float> rinv(std::size_t(n * T)), u = cast<float>(r.normals<double>(std::size_t(nq * d))), o(std::size_t(nq * T * d)),
      lse(std::size_t(nq * T));
  k3::cpu::threads<> b(3);
  auto bv = k3::host_view(bank.data(), n, T, d);
  for (index_t j = 0; j < n; ++j)
    ar::block_rinv(b, ar::block_rinv_args<float>{.block = bv.slice(0, j), .rinv = k3::host_view(rinv.data() + j * T, T)});
  ar::phase1(b, ar::phase1_args<float>{.bank = bv,
                                       .bank_rinv = k3::host_view(rinv.data(), n, T),
                                       .u = k3::host_view(u.data(), nq, d),
                                       .o = k3::host_view(o.data(), nq, T, d),
                                       .lse = k3::host_view(lse.data(), nq, T)});
  for (index_t l = 0; l < nq; ++l)
    for (index_t t = 0; t < T; ++t) {
      bool fin = true;
      for (index_t k = 0; k < d; ++k) fin &= std::isfinite(o[std::size_t((l * T + t) * d + k)]);
      CHECK(fin == (t != 3));
      CHECK(std::isfinite(lse[std::size_t(l * T + t)]) == (t != 3));
    }
  std::vector<float> u5(std::size_t(nq * (d + 1)));
  try {
    ar::phase1(b, ar::phase1_args<float>{.bank = bv,
                                         .bank_rinv = k3::host_view(rinv.data(), n, T),
                                         .u = k3::host_view(u5.data(), nq, d + 1),
                                         .o = k3::host_view(o.data(), nq, T, d),
                                         .lse = k3::host_view(lse.data(), nq, T)});
    FAIL("no throw");
  } catch (k3::error const& e) {
    std::string m = e.what();
    CHECK(m.find("'u'") != std::string::npos);
    CHECK(m.find("[4, 10]") != std::string::npos);
    CHECK(m.find("[4, 11]") != std::string::npos);
  }
  CHECK_THROWS_AS(ar::phase1(b, ar::phase1_args<float>{.bank = bv,
                                                       .bank_rinv = k3::host_view(rinv.data(), n - 1, T),
                                                       .u = k3::host_view(u.data(), nq, d),
                                                       .o = k3::host_view(o.data(), nq, T, d),
                                                       .lse = k3::host_view(lse.data(), nq, T)}),
                  k3::error);
}
