// Adversarial API checks: outputs aliasing inputs must be rejected (k3::error naming
// both arguments), invalid SiTU caps must be rejected, every backend agrees on strided input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/error_of.hpp"
#include "k3/moe.hpp"

using namespace k3;
using namespace k3::moe;

namespace {
using k3::test::error_of;
}  // namespace

TEST_CASE("route: outputs overlapping the scores, bias, mask or each other are rejected") {
  index_t const m = 6, n = 8, k = 2;
  std::vector<float> buf(std::size_t(m * n + 64), 0.5f);
  std::mt19937 rng(3);
  for (auto& x : buf) x = std::uniform_real_distribution<float>(0.05f, 0.95f)(rng);
  std::vector<float> bias(n, 0.0f), w(std::size_t(m * k)), cut(static_cast<std::size_t>(m));
  std::vector<std::int32_t> idx(std::size_t(m * k));
  std::vector<std::int64_t> load(static_cast<std::size_t>(n));
  std::vector<std::uint8_t> mask(std::size_t(m), 1);
  router_options opt;
  opt.k = k;
  auto scores = host_view(static_cast<float const*>(buf.data()), m, n);
  auto call = [&](route_args<float> o, const_view<float, 1> b, const_view<std::uint8_t, 1> mk) {
    o.bias = b;
    o.mask = mk;
    return error_of([&] { route(cpu::serial{}, o, opt); });
  };
  auto good = route_args<float>{.scores = scores,
                                .indices = host_view(idx.data(), m, k),
                                .weights = host_view(w.data(), m, k),
                                .cutoff = host_view(cut.data(), m),
                                .load = host_view(load.data(), n)};
  CHECK(call(good, host_view(static_cast<float const*>(bias.data()), n), host_view(static_cast<std::uint8_t const*>(mask.data()), m)) == "");
  // weights written in place over the scores
  auto o1 = good;
  o1.weights = host_view(buf.data(), m, k);
  std::string e = call(o1, host_view(static_cast<float const*>(bias.data()), n), {});
  CHECK(e.find("weights") != std::string::npos);
  CHECK(e.find("scores") != std::string::npos);
  // cut-off over the bias
  auto o2 = good;
  o2.cutoff = host_view(bias.data(), m);
  std::vector<float> bias2(std::size_t(m + n), 0.0f);
  o2.cutoff = host_view(bias2.data(), m);
  e = call(o2, host_view(static_cast<float const*>(bias2.data()), n), {});
  CHECK(e.find("cutoff") != std::string::npos);
  CHECK(e.find("bias") != std::string::npos);
  // load over the indices
  auto o3 = good;
  o3.load = host_view(reinterpret_cast<std::int64_t*>(idx.data()), n / 2);
  std::vector<std::int64_t> big(std::size_t(n + m * k), 0);
  o3.indices = host_view(reinterpret_cast<std::int32_t*>(big.data()), m, k);
  o3.load = host_view(big.data() + 1, n);
  e = call(o3, host_view(static_cast<float const*>(bias.data()), n), {});
  CHECK(e.find("load") != std::string::npos);
  CHECK(e.find("indices") != std::string::npos);
  // indices over the padding mask
  std::vector<std::int32_t> mk32(std::size_t(m * k + m), 1);
  auto o4 = good;
  o4.indices = host_view(mk32.data(), m, k);
  e = call(o4, host_view(static_cast<float const*>(bias.data()), n), host_view(reinterpret_cast<std::uint8_t const*>(mk32.data()), m));
  CHECK(e.find("indices") != std::string::npos);
  CHECK(e.find("mask") != std::string::npos);
  // the threads backend validates the same way
  o1.bias = host_view(static_cast<float const*>(bias.data()), n);
  e = error_of([&] { route(cpu::threads<>(2), o1, opt); });
  CHECK(e.find("weights") != std::string::npos);
}

TEST_CASE("expert FFN: non-positive or non-finite SiTU caps and aliasing outputs are rejected") {
  index_t const Tn = 3, d = 4, f = 5, E = 2, K = 2;
  std::vector<double> x(std::size_t(Tn * d), 0.3), wg(std::size_t(E * d * f), 0.1), wu(wg), wd(std::size_t(E * f * d), 0.2);
  std::vector<std::int32_t> idx{0, 1, 1, -1, 0, 0};
  std::vector<double> p(std::size_t(Tn * K), 0.5), o(std::size_t(Tn * d)), hg(std::size_t(Tn * K * f)), hu(hg);
  auto xv = host_view(static_cast<double const*>(x.data()), Tn, d);
  auto iv = host_view(static_cast<std::int32_t const*>(idx.data()), Tn, K);
  auto pv = host_view(static_cast<double const*>(p.data()), Tn, K);
  expert_ffn_args<double> const a{.x = xv,
                                  .idx = iv,
                                  .p = pv,
                                  .w_gate = host_view(static_cast<double const*>(wg.data()), E, d, f),
                                  .w_up = host_view(static_cast<double const*>(wu.data()), E, d, f),
                                  .w_down = host_view(static_cast<double const*>(wd.data()), E, f, d),
                                  .o = host_view(o.data(), Tn, d),
                                  .h_gate = host_view(hg.data(), Tn, K, f),
                                  .h_up = host_view(hu.data(), Tn, K, f)};
  expert_ffn_options<double> const w{};
  auto fwd = [&](expert_ffn_options<double> const& ww, tensor_view<double, 2> ov) {
    auto ao = a;
    ao.o = ov;
    return error_of([&] { expert_ffn_forward(cpu::serial{}, ao, ww); });
  };
  CHECK(fwd(w, host_view(o.data(), Tn, d)) == "");
  for (double bad : {0.0, -4.0, std::nan("")}) {
    auto w1 = w;
    w1.act.beta1 = bad;
    CHECK(fwd(w1, host_view(o.data(), Tn, d)).find("beta1") != std::string::npos);
    auto w2 = w;
    w2.act.beta2 = bad;
    CHECK(fwd(w2, host_view(o.data(), Tn, d)).find("beta2") != std::string::npos);
  }
  // o written in place over x: o(t, :) = 0 comes before x(t, :) is read
  std::string e = fwd(w, host_view(x.data(), Tn, d));
  CHECK(e.find("'o'") != std::string::npos);
  CHECK(e.find("'x'") != std::string::npos);
  // h_gate over h_up
  auto ah = a;
  ah.h_up = host_view(hg.data(), Tn, K, f);
  e = error_of([&] { expert_ffn_forward(cpu::serial{}, ah, w); });
  CHECK(e.find("h_gate") != std::string::npos);
  // backward: d_x over d_o
  std::vector<double> dout(std::size_t(Tn * d), 1.0), dp(std::size_t(Tn * K)), dwg(wg.size()), dwu(wg.size()), dwd(wd.size());
  e = error_of([&] {
    expert_ffn_backward(cpu::serial{},
                        expert_ffn_backward_args<double>{.x = xv,
                                                         .idx = iv,
                                                         .p = pv,
                                                         .w_gate = a.w_gate,
                                                         .w_up = a.w_up,
                                                         .w_down = a.w_down,
                                                         .h_gate = host_view(static_cast<double const*>(hg.data()), Tn, K, f),
                                                         .h_up = host_view(static_cast<double const*>(hu.data()), Tn, K, f),
                                                         .d_o = host_view(static_cast<double const*>(dout.data()), Tn, d),
                                                         .d_x = host_view(dout.data(), Tn, d),
                                                         .d_p = host_view(dp.data(), Tn, K),
                                                         .d_w_gate = host_view(dwg.data(), E, d, f),
                                                         .d_w_up = host_view(dwu.data(), E, d, f),
                                                         .d_w_down = host_view(dwd.data(), E, f, d)},
                        w);
  });
  CHECK(e.find("d_x") != std::string::npos);
  CHECK(e.find("d_o") != std::string::npos);
}

TEST_CASE("quantile balancing: non-finite scores or cut-offs and degenerate histogram bounds are errors, not UB") {
  index_t const m = 4, n = 6;
  std::vector<float> s(std::size_t(m * n), 0.5f), cut(std::size_t(m), 0.25f);
  router_options opt;
  opt.k = 2;
  auto sv = [&] { return host_view(static_cast<float const*>(s.data()), m, n); };
  auto cv = [&] { return host_view(static_cast<float const*>(cut.data()), m); };
  qb_histogram h(n, 100, -1.f, 1.f);
  CHECK(error_of([&] { qb_accumulate(k3::cpu::serial{}, qb_accumulate_args<float>{.scores = sv(), .cutoff = cv(), .histogram = &h}, opt); }) == "");
  cut[2] = std::nanf("");
  CHECK(error_of([&] { qb_accumulate(k3::cpu::serial{}, qb_accumulate_args<float>{.scores = sv(), .cutoff = cv(), .histogram = &h}, opt); }).find("cutoff") != std::string::npos);
  std::vector<double> out;
  CHECK(error_of([&] { k3::moe::detail::qb_exact_quantile(sv(), cv(), opt, out); }).find("cutoff") != std::string::npos);
  cut[2] = 0.25f;
  s[7] = std::numeric_limits<float>::infinity();
  CHECK(error_of([&] { qb_accumulate(k3::cpu::serial{}, qb_accumulate_args<float>{.scores = sv(), .cutoff = cv(), .histogram = &h}, opt); }).find("scores") != std::string::npos);
  CHECK(error_of([&] { k3::moe::detail::qb_exact_quantile(sv(), cv(), opt, out); }).find("scores") != std::string::npos);
  // A padding row may hold anything: it is never read.
  std::vector<std::uint8_t> mask{1, 0, 1, 1};
  CHECK(error_of([&] { qb_accumulate(k3::cpu::serial{}, qb_accumulate_args<float>{.scores = sv(), .cutoff = cv(), .mask = host_view(static_cast<std::uint8_t const*>(mask.data()), m), .histogram = &h}, opt); }) == "");
  // Bounds so close (or so far apart) that the bin width's inverse is not a finite positive float.
  CHECK(error_of([] { qb_histogram(4, 1000, 0.f, 1e-44f); }).find("bins") != std::string::npos);
  CHECK(error_of([] { qb_histogram(4, 10, -3e38f, 3e38f); }).find("bins") != std::string::npos);
}

TEST_CASE("placement: non-finite or negative EPLB loads and aliasing MoonEP dispatch outputs are rejected") {
  std::vector<double> load{5, 1, 3, 2, 8, 1, 1, 4};
  auto lv = [&] { return host_view(static_cast<double const*>(load.data()), index_t(1), index_t(8)); };
  eplb_plan placed;
  eplb_options const eo{.physical = 12, .groups = 4, .nodes = 2, .gpus = 4};
  CHECK(error_of([&] { eplb(cpu::serial{}, eplb_args<double>{.load = lv(), .placement = &placed}, eo); }) == "");
  for (double bad : {std::nan(""), -1.0, std::numeric_limits<double>::infinity()}) {
    load[3] = bad;
    CHECK(error_of([&] { eplb(cpu::serial{}, eplb_args<double>{.load = lv(), .placement = &placed}, eo); }).find("load") != std::string::npos);
  }
  std::vector<std::int64_t> counts{3, 1, 2, 2};
  auto plan = moonep_rebalance(host_view(static_cast<std::int64_t const*>(counts.data()), index_t(4)), 2);
  std::vector<std::int32_t> idx{0, 2, 3, 0, 1, 2, 3, 0};
  std::vector<std::int64_t> ro(8), so(8);
  auto iv = host_view(static_cast<std::int32_t const*>(idx.data()), index_t(4), index_t(2));
  CHECK(error_of([&] { moonep_dispatch(iv, plan, host_view(ro.data(), index_t(4), index_t(2)), host_view(so.data(), index_t(4), index_t(2))); }) == "");
  std::string e = error_of([&] { moonep_dispatch(iv, plan, host_view(ro.data(), index_t(4), index_t(2)), host_view(ro.data(), index_t(4), index_t(2))); });
  CHECK(e.find("rank_of") != std::string::npos);
  CHECK(e.find("slot_of") != std::string::npos);
}

TEST_CASE("quantile balancing: a null bias or mask with a non-empty shape is a k3::error, not a crash") {
  index_t const m = 4, n = 6;
  std::vector<float> s(std::size_t(m * n), 0.5f), cut(std::size_t(m), 0.25f);
  router_options opt;
  opt.k = 2;
  auto sv = host_view(static_cast<float const*>(s.data()), m, n);
  auto cv = host_view(static_cast<float const*>(cut.data()), m);
  tensor_view<float, 1> null_bias(nullptr, {n});
  CHECK(error_of([&] { qb_exact_update(k3::cpu::serial{}, qb_exact_update_args<float>{.scores = sv, .cutoff = cv, .bias = null_bias}, {.router = opt}); }).find("bias") != std::string::npos);
  CHECK(error_of([&] { qb_offline_solve(k3::cpu::serial{}, qb_offline_args<float>{.scores = sv, .bias = null_bias}, {.router = opt, .iterations = 3}); }).find("bias") != std::string::npos);
  qb_histogram h(n, 10, -1.f, 1.f);
  qb_accumulate(k3::cpu::serial{}, qb_accumulate_args<float>{.scores = sv, .cutoff = cv, .histogram = &h}, opt);
  CHECK(error_of([&] { qb_update(k3::cpu::serial{}, qb_update_args<float>{.histogram = &h, .bias = null_bias}, {.router = {.k = opt.k}}); }).find("bias") != std::string::npos);
  std::vector<float> bias(static_cast<std::size_t>(n));
  CHECK(error_of([&] { qb_offline_solve(k3::cpu::serial{}, qb_offline_args<float>{.scores = sv, .mask = const_view<std::uint8_t, 1>(nullptr, {m}), .bias = host_view(bias.data(), n)}, {.router = opt, .iterations = 3}); }).find("mask") !=
        std::string::npos);
}

namespace {
bool broadcast_named(std::string const& e, char const* arg) {
  return e.find(std::string("argument '") + arg + "'") != std::string::npos && e.find("stride 0") != std::string::npos;
}
}  // namespace

TEST_CASE("route, quantile balancing and MoonEP dispatch reject an output with a stride-0 dimension (aliasing itself), naming it") {
  index_t const m = 6, n = 8, k = 2;
  std::vector<float> s(std::size_t(m * n));
  std::mt19937 rng(5);
  for (auto& x : s) x = std::uniform_real_distribution<float>(0.05f, 0.95f)(rng);
  std::vector<float> bias(n, 0.0f), w(std::size_t(m * k)), cut(static_cast<std::size_t>(m));
  std::vector<std::int32_t> idx(std::size_t(m * k));
  std::vector<std::int64_t> load(static_cast<std::size_t>(n));
  router_options opt;
  opt.k = k;
  auto scores = host_view(static_cast<float const*>(s.data()), m, n);
  auto bv = host_view(static_cast<float const*>(bias.data()), n);
  auto good = route_args<float>{.scores = scores,
                                .bias = bv,
                                .indices = host_view(idx.data(), m, k),
                                .weights = host_view(w.data(), m, k),
                                .cutoff = host_view(cut.data(), m),
                                .load = host_view(load.data(), n)};
  auto run = [&](auto const& be) {
    auto call = [&](route_args<float> const& o) { return error_of([&] { route(be, o, opt); }); };
    CHECK(call(good) == "");
    for (int dim : {0, 1}) {
      auto o = good;
      o.indices = tensor_view<std::int32_t, 2>(idx.data(), {m, k}, dim == 0 ? tensor_view<std::int32_t, 2>::extents_type{0, 1}
                                                                             : tensor_view<std::int32_t, 2>::extents_type{1, 0});
      CHECK(broadcast_named(call(o), "indices"));
      o = good;
      o.weights = tensor_view<float, 2>(w.data(), {m, k}, dim == 0 ? tensor_view<float, 2>::extents_type{0, 1} : tensor_view<float, 2>::extents_type{1, 0});
      CHECK(broadcast_named(call(o), "weights"));
    }
    auto o = good;
    o.cutoff = tensor_view<float, 1>(cut.data(), {m}, {0});
    CHECK(broadcast_named(call(o), "cutoff"));
    o = good;
    o.load = tensor_view<std::int64_t, 1>(load.data(), {n}, {0});
    CHECK(broadcast_named(call(o), "load"));
    // the fused histogram path (training) checks the same outputs
    auto h = qb_histogram::for_bias(bv, 50);
    o = good;
    o.cutoff = tensor_view<float, 1>(cut.data(), {m}, {0});
    o.histogram = &h;
    CHECK(broadcast_named(error_of([&] { route(be, o, opt); }), "cutoff"));
  };
  run(cpu::serial{});
  run(cpu::threads<>(2));

  // quantile balancing: the new bias
  route(cpu::serial{}, good, opt);
  auto cv = host_view(static_cast<float const*>(cut.data()), m);
  std::vector<float> nb(static_cast<std::size_t>(n));
  tensor_view<float, 1> const bcast(nb.data(), {n}, {0});
  CHECK(error_of([&] { qb_exact_update(k3::cpu::serial{}, qb_exact_update_args<float>{.scores = scores, .cutoff = cv, .bias = host_view(nb.data(), n)}, {.router = opt}); }) == "");
  CHECK(broadcast_named(error_of([&] { qb_exact_update(k3::cpu::serial{}, qb_exact_update_args<float>{.scores = scores, .cutoff = cv, .bias = bcast}, {.router = opt}); }), "bias"));
  CHECK(broadcast_named(error_of([&] { qb_offline_solve(k3::cpu::serial{}, qb_offline_args<float>{.scores = scores, .bias = bcast}, {.router = opt, .iterations = 2}); }), "bias"));
  auto h = qb_histogram::for_bias(bv, 50);
  qb_accumulate(k3::cpu::serial{}, qb_accumulate_args<float>{.scores = scores, .cutoff = cv, .histogram = &h}, opt);
  CHECK(broadcast_named(error_of([&] { qb_update(k3::cpu::serial{}, qb_update_args<float>{.histogram = &h, .bias = bcast}, {.router = {.k = opt.k}}); }), "bias"));
  // ... and the new bias written over the scores or cut-offs it is computed from
  std::vector<float> sc(s);
  auto over = [&](index_t off) { return host_view(sc.data() + off, n); };
  auto scv = host_view(static_cast<float const*>(sc.data()), m, n);
  std::string e = error_of([&] { qb_exact_update(k3::cpu::serial{}, qb_exact_update_args<float>{.scores = scv, .cutoff = cv, .bias = over(3)}, {.router = opt}); });
  CHECK((e.find("'bias'") != std::string::npos && e.find("'scores'") != std::string::npos && e.find("overlap") != std::string::npos));
  e = error_of([&] { qb_offline_solve(k3::cpu::serial{}, qb_offline_args<float>{.scores = scv, .bias = over(5)}, {.router = opt, .iterations = 2}); });
  CHECK((e.find("'bias'") != std::string::npos && e.find("'scores'") != std::string::npos && e.find("overlap") != std::string::npos));
  std::vector<float> cb(std::size_t(m + n));
  std::copy(cut.begin(), cut.end(), cb.begin());
  e = error_of([&] { qb_exact_update(k3::cpu::serial{}, qb_exact_update_args<float>{.scores = scores, .cutoff = host_view(static_cast<float const*>(cb.data()), m), .bias = host_view(cb.data() + 2, n)}, {.router = opt}); });
  CHECK((e.find("'bias'") != std::string::npos && e.find("'cutoff'") != std::string::npos && e.find("overlap") != std::string::npos));

  // MoonEP dispatch
  std::vector<std::int64_t> counts{3, 1, 2, 2};
  auto plan = moonep_rebalance(host_view(static_cast<std::int64_t const*>(counts.data()), index_t(4)), 2);
  std::vector<std::int32_t> pidx{0, 2, 3, 0, 1, 2, 3, 0};
  std::vector<std::int64_t> ro(8), so(8);
  auto iv = host_view(static_cast<std::int32_t const*>(pidx.data()), index_t(4), index_t(2));
  tensor_view<std::int64_t, 2> const rb(ro.data(), {4, 2}, {0, 1}), sb(so.data(), {4, 2}, {1, 0});
  CHECK(broadcast_named(error_of([&] { moonep_dispatch(iv, plan, rb, host_view(so.data(), index_t(4), index_t(2))); }), "rank_of"));
  CHECK(broadcast_named(error_of([&] { moonep_dispatch(iv, plan, host_view(ro.data(), index_t(4), index_t(2)), sb); }), "slot_of"));
}

TEST_CASE("route, quantile balancing and MoonEP dispatch into strided outputs: the contiguous results, every backend") {
  for (index_t m : {1, 7, 40}) {
    index_t const n = 24, k = 3;
    CAPTURE(m);
    std::vector<float> s(std::size_t(m * n));
    std::mt19937 rng(static_cast<std::uint32_t>(m));
    for (auto& x : s) x = std::uniform_real_distribution<float>(0.05f, 0.95f)(rng);
    std::vector<float> bias(static_cast<std::size_t>(n));
    for (auto& x : bias) x = std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng);
    router_options opt;
    opt.k = k;
    auto scores = host_view(static_cast<float const*>(s.data()), m, n);
    auto bv = host_view(static_cast<float const*>(bias.data()), n);
    std::vector<std::int32_t> i0(std::size_t(m * k));
    std::vector<float> w0(std::size_t(m * k)), c0(static_cast<std::size_t>(m));
    std::vector<std::int64_t> l0(static_cast<std::size_t>(n));
    route(cpu::serial{},
          route_args<float>{.scores = scores,
                            .bias = bv,
                            .indices = host_view(i0.data(), m, k),
                            .weights = host_view(w0.data(), m, k),
                            .cutoff = host_view(c0.data(), m),
                            .load = host_view(l0.data(), n)},
          opt);
    auto check = [&](auto const& be) {
      // indices transposed, weights with column stride 2, cut-off stride 3, load stride 2
      std::vector<std::int32_t> i1(std::size_t(m * k), -7);
      std::vector<float> w1(std::size_t(m * k * 2), -7.f), c1(std::size_t(m * 3), -7.f);
      std::vector<std::int64_t> l1(std::size_t(n * 2), -7);
      route_args<float> const o{.scores = scores,
                                .bias = bv,
                                .indices = tensor_view<std::int32_t, 2>(i1.data(), {m, k}, {1, m}),
                                .weights = tensor_view<float, 2>(w1.data(), {m, k}, {2 * k, 2}),
                                .cutoff = tensor_view<float, 1>(c1.data(), {m}, {3}),
                                .load = tensor_view<std::int64_t, 1>(l1.data(), {n}, {2})};
      route(be, o, opt);
      for (index_t i = 0; i < m; ++i) {
        for (index_t r = 0; r < k; ++r) {
          REQUIRE(o.indices(i, r) == i0[std::size_t(i * k + r)]);
          REQUIRE(o.weights(i, r) == w0[std::size_t(i * k + r)]);
        }
        REQUIRE(o.cutoff(i) == c0[std::size_t(i)]);
      }
      for (index_t j = 0; j < n; ++j) REQUIRE(o.load(j) == l0[std::size_t(j)]);
    };
    check(cpu::serial{});
    check(cpu::threads<>(3));
    // new bias into every other element
    auto cv = host_view(static_cast<float const*>(c0.data()), m);
    std::vector<float> b0(bias), b1(std::size_t(2 * n), 0.f);
    tensor_view<float, 1> b1v(b1.data(), {n}, {2});
    for (index_t j = 0; j < n; ++j) b1v(j) = bias[std::size_t(j)];
    qb_exact_update(k3::cpu::serial{}, qb_exact_update_args<float>{.scores = scores, .cutoff = cv, .bias = host_view(b0.data(), n)}, {.router = opt, .ema = 0.5});
    qb_exact_update(k3::cpu::serial{}, qb_exact_update_args<float>{.scores = scores, .cutoff = cv, .bias = b1v}, {.router = opt, .ema = 0.5});
    for (index_t j = 0; j < n; ++j) REQUIRE(b1v(j) == b0[std::size_t(j)]);
    qb_offline_solve(k3::cpu::serial{}, qb_offline_args<float>{.scores = scores, .bias = host_view(b0.data(), n)}, {.router = opt, .iterations = 3});
    qb_offline_solve(k3::cpu::serial{}, qb_offline_args<float>{.scores = scores, .bias = b1v}, {.router = opt, .iterations = 3});
    for (index_t j = 0; j < n; ++j) REQUIRE(b1v(j) == b0[std::size_t(j)]);
    auto h = qb_histogram::for_bias(bv, 64);
    qb_accumulate(k3::cpu::serial{}, qb_accumulate_args<float>{.scores = scores, .cutoff = cv, .histogram = &h}, opt);
    qb_update(k3::cpu::serial{}, qb_update_args<float>{.histogram = &h, .bias = host_view(b0.data(), n)}, {.router = {.k = opt.k}});
    qb_update(k3::cpu::serial{}, qb_update_args<float>{.histogram = &h, .bias = b1v}, {.router = {.k = opt.k}});
    for (index_t j = 0; j < n; ++j) REQUIRE(b1v(j) == b0[std::size_t(j)]);
  }
  // MoonEP dispatch into transposed outputs
  std::vector<std::int64_t> counts{3, 1, 2, 2};
  auto plan = moonep_rebalance(host_view(static_cast<std::int64_t const*>(counts.data()), index_t(4)), 2);
  std::vector<std::int32_t> pidx{0, 2, 3, 0, 1, 2, 3, 0};
  auto iv = host_view(static_cast<std::int32_t const*>(pidx.data()), index_t(4), index_t(2));
  std::vector<std::int64_t> ro(8), so(8), rt(8), st(8);
  moonep_dispatch(iv, plan, host_view(ro.data(), index_t(4), index_t(2)), host_view(so.data(), index_t(4), index_t(2)));
  tensor_view<std::int64_t, 2> rtv(rt.data(), {4, 2}, {1, 4}), stv(st.data(), {4, 2}, {1, 4});
  moonep_dispatch(iv, plan, rtv, stv);
  for (index_t t = 0; t < 4; ++t)
    for (index_t r = 0; r < 2; ++r) {
      REQUIRE(rtv(t, r) == ro[std::size_t(t * 2 + r)]);
      REQUIRE(stv(t, r) == so[std::size_t(t * 2 + r)]);
    }
}
