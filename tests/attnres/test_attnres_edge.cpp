// Adversarial API checks: the mix's outputs (h, stats; dsources, dpartial, dw,
// dgain) overlapping an input or each other must be rejected with a k3::error naming both.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attnres/loopback.hpp"
#include "support/error_of.hpp"
#include "k3/attnres.hpp"

namespace ar = k3::attnres;
using k3::index_t;

namespace {
using k3::test::error_of;
using k3::test::loopback;
using k3::test::mailbox;
constexpr auto names = k3::test::names_overlap;
}  // namespace

TEST_CASE("attnres mix: stats and gradients overlapping inputs or each other are rejected") {
  index_t const n = 2, T = 3, d = 4;
  // slots of 64 doubles in one buffer
  std::vector<double> mem(64 * 16, 0.25);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = 0.01 * double(i % 13) - 0.05;
  auto at = [&](int i) { return mem.data() + 64 * i; };
  auto bank = k3::host_view(static_cast<double const*>(at(0)), n, T, d);
  auto part = k3::host_view(static_cast<double const*>(at(1)), T, d);
  auto src = ar::make_sources(bank, part);
  auto w = k3::host_view(static_cast<double const*>(at(2)), d);
  auto g = k3::host_view(static_cast<double const*>(at(3)), d);
  k3::cpu::threads<> thr(2);
  auto fwd = [&](double* h, double* st) {
    return error_of([&] {
      ar::mix_forward(thr, ar::mix_forward_args<double>{
                               .sources = src, .w = w, .gain = g, .h = k3::host_view(h, T, d), .stats = k3::host_view(st, T, n + 1, index_t(3))});
    });
  };
  CHECK(fwd(at(4), at(5)) == "");
  CHECK(names(fwd(at(4), at(0)), "stats", "sources"));
  CHECK(names(fwd(at(4), at(1)), "stats", "partial"));
  CHECK(names(fwd(at(4), at(4) + 3), "stats", "h"));

  auto dh = k3::host_view(static_cast<double const*>(at(6)), T, d);
  auto bwd = [&](double* db, double* dp, double* dw, double* dg) {
    return error_of([&] {
      ar::mix_backward(thr, ar::mix_backward_args<double>{.sources = src,
                                                          .w = w,
                                                          .gain = g,
                                                          .d_h = dh,
                                                          .d_sources = ar::make_grads(k3::host_view(db, n, T, d), k3::host_view(dp, T, d)),
                                                          .d_w = k3::host_view(dw, d),
                                                          .d_gain = k3::host_view(dg, d)});
    });
  };
  CHECK(bwd(at(7), at(8), at(9), at(10)) == "");
  CHECK(names(bwd(at(6), at(8), at(9), at(10)), "d_sources", "d_h"));
  CHECK(names(bwd(at(7), at(0) + 8, at(9), at(10)), "d_partial", "sources"));
  CHECK(names(bwd(at(7), at(8), at(2), at(10)), "d_w", "w"));
  CHECK(names(bwd(at(7), at(8), at(9), at(9)), "d_w", "d_gain"));
  CHECK(names(bwd(at(7), at(8), at(7) + 2, at(10)), "d_w", "d_sources"));
  CHECK(names(bwd(at(7), at(8), at(9), at(6)), "d_gain", "d_h"));
  CHECK(names(bwd(at(7), at(7) + 8, at(9), at(10)), "d_sources", "d_partial"));
}

TEST_CASE("attnres two-phase: outputs overlapping inputs are rejected, a bad eps is an error") {
  index_t const n = 2, nq = 2, T = 3, d = 4;
  std::vector<float> mem(64 * 16, 0.5f);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = 0.02f * float(i % 11) + 0.1f;
  auto at = [&](int i) { return mem.data() + 64 * i; };
  auto cf = [](float* p) { return static_cast<float const*>(p); };
  k3::cpu::simd<> be;
  // block_rinv
  CHECK(error_of([&] { ar::block_rinv(be, ar::block_rinv_args<float>{.block = k3::host_view(cf(at(0)), T, d), .rinv = k3::host_view(at(1), T)}); }) ==
        "");
  CHECK(names(
      error_of([&] { ar::block_rinv(be, ar::block_rinv_args<float>{.block = k3::host_view(cf(at(0)), T, d), .rinv = k3::host_view(at(0) + 5, T)}); }),
      "rinv", "block"));
  // phase1: bank at 0, rinv at 1, u at 2, o at 3, lse at 4
  auto p1 = [&](float* o, float* lse) {
    return error_of([&] {
      ar::phase1(be, ar::phase1_args<float>{.bank = k3::host_view(cf(at(0)), n, T, d),
                                            .bank_rinv = k3::host_view(cf(at(1)), n, T),
                                            .u = k3::host_view(cf(at(2)), nq, d),
                                            .o = k3::host_view(o, nq, T, d),
                                            .lse = k3::host_view(lse, nq, T)});
    });
  };
  CHECK(p1(at(3), at(4)) == "");
  CHECK(names(p1(at(3), at(1)), "lse", "bank_rinv"));
  CHECK(names(p1(at(3), at(3) + 20), "lse", "o"));
  CHECK(names(p1(at(2), at(4)), "o", "u"));
  CHECK(names(p1(at(3), at(0)), "lse", "bank"));
  // phase2: o at 3 (one site), lse at 4, partial at 5, u at 6, h at 7
  auto p2 = [&](float* h, double eps) {
    return error_of([&] {
      ar::phase2(be,
                 ar::phase2_args<float>{.o = k3::host_view(cf(at(3)), T, d),
                                        .lse = k3::host_view(cf(at(4)), T),
                                        .partial = k3::host_view(cf(at(5)), T, d),
                                        .u = k3::host_view(cf(at(6)), d),
                                        .h = k3::host_view(h, T, d)},
                 {.eps = eps});
    });
  };
  CHECK(p2(at(7), 1e-5) == "");
  CHECK(names(p2(at(4), 1e-5), "h", "lse"));
  CHECK(names(p2(at(6) - 2, 1e-5), "h", "u"));
  CHECK(p2(at(7), -1.0).find("eps") != std::string::npos);
  CHECK(p2(at(7), std::nan("")).find("eps") != std::string::npos);
  // phase2_add: prefix at 5 (written), delta at 8
  auto p2a = [&](float* prefix, float* delta, float* h) {
    return error_of([&] {
      ar::phase2_add(be, ar::phase2_add_args<float>{.o = k3::host_view(cf(at(3)), T, d),
                                                    .lse = k3::host_view(cf(at(4)), T),
                                                    .prefix = k3::host_view(prefix, T, d),
                                                    .delta = k3::host_view(cf(delta), T, d),
                                                    .u = k3::host_view(cf(at(6)), d),
                                                    .h = k3::host_view(h, T, d)});
    });
  };
  CHECK(p2a(at(5), at(8), at(7)) == "");
  CHECK(names(p2a(at(5), at(8), at(8)), "h", "delta"));
  CHECK(names(p2a(at(3), at(8), at(7)), "prefix", "o"));
  CHECK(names(p2a(at(4), at(8), at(7)), "prefix", "lse"));
}

TEST_CASE("pipeline cache: a malformed forward header is a k3::error (never an out-of-range bank read later)") {
  index_t const d = 3, L = 8;
  ar::block_config c;
  c.d = d;
  c.tokens = 2;
  c.sublayers = L;
  c.block_sublayers = 2;
  std::vector<float> w((L + 1) * d, 0.1f), g((L + 1) * d, 1.0f), e(2 * d, 1.0f), x(2 * d), y(2 * d, 0.5f);
  auto wv = k3::tensor_view<float const, 2>(w.data(), {L + 1, d});
  auto gv = k3::tensor_view<float const, 2>(g.data(), {L + 1, d});
  // header layout: site, n, k, T, prefix_empty, then the rows held per rank
  for (int field : {5, 6, 1, 3, 0}) {
    for (std::int64_t bad : {std::int64_t(-5), std::int64_t(1000)}) {
      CAPTURE(field);
      CAPTURE(bad);
      auto box = std::make_shared<mailbox>();
      loopback c0(box, 0, 2), c1(box, 1, 2);
      ar::pipeline_cache<loopback> p0(c0), p1(c1);
      ar::block_attn_res<float> a0(c, wv, gv), a1(c, wv, gv);
      a0.begin(k3::host_view(e.data(), 2, d));
      for (int l = 0; l < 5; ++l) {
        a0.input(k3::host_view(x.data(), 2, d));
        a0.add(k3::host_view(y.data(), 2, d));
      }
      p0.send_forward(a0, 1, 9);
      auto& msg = box->q[{0, 1, 9}].front().second;
      std::int64_t h[7];
      std::memcpy(h, msg.data(), sizeof h);
      h[field] = bad;
      std::memcpy(msg.data(), h, sizeof h);
      std::string const err = error_of([&] { p1.recv_forward(a1, 0, 9); });
      CHECK(err != "");
      CHECK(err.find("loopback") == std::string::npos);  // refused from the header, before reading the rows
    }
  }
}

TEST_CASE("block driver: an identity sublayer may hand grad_sublayer_output() straight back to backward_site") {
  index_t const d = 4, T = 3, L = 5;
  ar::block_config c;
  c.d = d;
  c.tokens = T;
  c.sublayers = L;
  c.block_sublayers = 2;
  for (auto md : {ar::mode::train_stored, ar::mode::train_recompute}) {
    c.run_mode = md;
    std::vector<double> w((L + 1) * d), g((L + 1) * d), emb(T * d), dout(T * d);
    for (std::size_t i = 0; i < w.size(); ++i) {
      w[i] = 0.3 * std::sin(double(i));
      g[i] = 1.0 + 0.1 * std::cos(double(i));
    }
    for (std::size_t i = 0; i < emb.size(); ++i) {
      emb[i] = std::cos(0.7 * double(i));
      dout[i] = std::sin(1.3 * double(i));
    }
    auto run = [&](bool alias) {
      ar::block_attn_res<double> a(c, k3::tensor_view<double const, 2>(w.data(), {L + 1, d}), k3::tensor_view<double const, 2>(g.data(), {L + 1, d}));
      std::vector<double> x(T * d), out(T * d);
      a.begin(k3::host_view(static_cast<double const*>(emb.data()), T, d));
      for (index_t l = 0; l < L; ++l) {
        a.input(k3::host_view(x.data(), T, d));
        a.add(k3::host_view(static_cast<double const*>(x.data()), T, d));  // y = x
      }
      a.output(k3::host_view(out.data(), T, d));
      a.backward_begin();
      a.backward_site(k3::host_view(static_cast<double const*>(dout.data()), T, d));
      for (index_t l = L - 1; l >= 0; --l) {
        auto dy = a.grad_sublayer_output();
        if (alias) {
          a.backward_site(dy);
        } else {
          std::vector<double> copy(dy.data_handle(), dy.data_handle() + T * d);
          a.backward_site(k3::host_view(static_cast<double const*>(copy.data()), T, d));
        }
      }
      std::vector<double> r;
      for (auto v : {a.grad_embedding(), a.grad_w(), a.grad_gain()})
        for (index_t i = 0; i < v.extent(0); ++i)
          for (index_t k = 0; k < d; ++k) r.push_back(v(i, k));
      return r;
    };
    std::vector<double> ref = run(false), got;
    std::string const e = error_of([&] { got = run(true); });
    CHECK(e == "");
    CHECK(got == ref);
  }
}

namespace {
bool broadcast_named(std::string const& e, char const* arg) {
  return e.find(std::string("argument '") + arg + "'") != std::string::npos && e.find("stride 0") != std::string::npos;
}
}  // namespace

TEST_CASE("attnres: an output with a stride-0 dimension (aliasing itself) is rejected, naming it, at every entry point") {
  index_t const n = 2, nq = 2, T = 3, d = 4;
  std::vector<float> mem(64 * 16, 0.5f);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = 0.02f * float(i % 11) + 0.1f;
  auto at = [&](int i) { return mem.data() + 64 * i; };
  auto cf = [](float* p) { return static_cast<float const*>(p); };
  auto run = [&](auto const& be) {
    // block_rinv: rinv [T] with stride 0
    CHECK(broadcast_named(error_of([&] {
                            ar::block_rinv(be, ar::block_rinv_args<float>{.block = k3::host_view(cf(at(0)), T, d),
                                                                          .rinv = k3::tensor_view<float, 1>(at(1), {T}, {0})});
                          }),
                          "rinv"));
    // phase1: o [nq, T, d] broadcast over sites or tokens; lse [nq, T] over tokens
    auto p1 = [&](k3::tensor_view<float, 3> o, k3::tensor_view<float, 2> lse) {
      return error_of([&] {
        ar::phase1(be, ar::phase1_args<float>{.bank = k3::host_view(cf(at(0)), n, T, d),
                                              .bank_rinv = k3::host_view(cf(at(1)), n, T),
                                              .u = k3::host_view(cf(at(2)), nq, d),
                                              .o = o,
                                              .lse = lse});
      });
    };
    CHECK(p1(k3::host_view(at(3), nq, T, d), k3::host_view(at(4), nq, T)) == "");
    CHECK(broadcast_named(p1(k3::tensor_view<float, 3>(at(3), {nq, T, d}, {0, d, 1}), k3::host_view(at(4), nq, T)), "o"));
    CHECK(broadcast_named(p1(k3::tensor_view<float, 3>(at(3), {nq, T, d}, {T * d, 0, 1}), k3::host_view(at(4), nq, T)), "o"));
    CHECK(broadcast_named(p1(k3::host_view(at(3), nq, T, d), k3::tensor_view<float, 2>(at(4), {nq, T}, {T, 0})), "lse"));
    // phase2 / phase2_add: h, prefix [T, d] with stride-0 rows
    k3::tensor_view<float, 2> const rows0(at(7), {T, d}, {0, 1});
    for (bool has_partial : {false, true})
      CHECK(broadcast_named(error_of([&] {
                              ar::phase2(
                                  be, ar::phase2_args<float>{.o = k3::host_view(cf(at(3)), T, d),
                                                             .lse = k3::host_view(cf(at(4)), T),
                                                             .partial = has_partial ? k3::tensor_view<float const, 2>(k3::host_view(cf(at(5)), T, d))
                                                                                    : k3::tensor_view<float const, 2>{},
                                                             .u = k3::host_view(cf(at(6)), d),
                                                             .h = rows0});
                            }),
                            "h"));
    auto p2a = [&](k3::tensor_view<float, 2> prefix, k3::tensor_view<float, 2> h) {
      return error_of([&] {
        ar::phase2_add(be, ar::phase2_add_args<float>{.o = k3::host_view(cf(at(3)), T, d),
                                                      .lse = k3::host_view(cf(at(4)), T),
                                                      .prefix = prefix,
                                                      .delta = k3::host_view(cf(at(8)), T, d),
                                                      .u = k3::host_view(cf(at(6)), d),
                                                      .h = h});
      });
    };
    CHECK(broadcast_named(p2a(k3::host_view(at(5), T, d), rows0), "h"));
    CHECK(broadcast_named(p2a(k3::tensor_view<float, 2>(at(5), {T, d}, {0, 1}), k3::host_view(at(9), T, d)), "prefix"));
    // mix forward (h, stats) and backward (dsources, dpartial, dw, dgain)
    auto src = ar::make_sources(k3::host_view(cf(at(0)), n, T, d), k3::host_view(cf(at(1)), T, d));
    auto w = k3::host_view(cf(at(2)), d);
    auto g = k3::host_view(cf(at(3)), d);
    CHECK(broadcast_named(error_of([&] { ar::mix_forward(be, ar::mix_forward_args<float>{.sources = src, .w = w, .gain = g, .h = rows0}); }), "h"));
    // (stats must be contiguous, which already refuses a stride-0 dimension)
    CHECK(error_of([&] {
            ar::mix_forward(be, ar::mix_forward_args<float>{.sources = src,
                                                            .w = w,
                                                            .gain = g,
                                                            .h = k3::host_view(at(7), T, d),
                                                            .stats = k3::tensor_view<float, 3>(at(8), {T, n + 1, 3}, {0, 3, 1})});
          }).find("argument 'stats'") != std::string::npos);
    auto dh = k3::host_view(cf(at(6)), T, d);
    auto bwd = [&](k3::tensor_view<float, 3> db, k3::tensor_view<float, 2> dp, k3::tensor_view<float, 1> dw, k3::tensor_view<float, 1> dg) {
      return error_of([&] {
        ar::mix_backward(be, ar::mix_backward_args<float>{
                                 .sources = src, .w = w, .gain = g, .d_h = dh, .d_sources = ar::make_grads(db, dp), .d_w = dw, .d_gain = dg});
      });
    };
    auto db = k3::host_view(at(10), n, T, d);
    auto dp = k3::host_view(at(11), T, d);
    auto dw = k3::host_view(at(12), d);
    auto dg = k3::host_view(at(13), d);
    CHECK(bwd(db, dp, dw, dg) == "");
    CHECK(broadcast_named(bwd(k3::tensor_view<float, 3>(at(10), {n, T, d}, {0, d, 1}), dp, dw, dg), "d_sources"));
    CHECK(broadcast_named(bwd(db, k3::tensor_view<float, 2>(at(11), {T, d}, {0, 1}), dw, dg), "d_partial"));
    CHECK(broadcast_named(bwd(db, dp, k3::tensor_view<float, 1>(at(12), {d}, {0}), dg), "d_w"));
    CHECK(broadcast_named(bwd(db, dp, dw, k3::tensor_view<float, 1>(at(13), {d}, {0})), "d_gain"));
  };
  run(k3::cpu::serial{});
  run(k3::cpu::threads<>(2));

  // the block driver names its own argument
  index_t const L = 3;
  ar::block_config c;
  c.d = d;
  c.tokens = T;
  c.sublayers = L;
  c.block_sublayers = 2;
  std::vector<float> wv((L + 1) * d, 0.1f), gv((L + 1) * d, 1.0f), emb(T * d, 0.5f), y(T * d, 0.25f), x(T * d);
  for (auto md : {ar::mode::one_pass, ar::mode::two_phase}) {
    for (bool skip : {false, true}) {
      CAPTURE(skip);
      c.run_mode = md;
      c.skip_first_mix = skip;
      ar::block_attn_res<float> a(c, k3::tensor_view<float const, 2>(wv.data(), {L + 1, d}), k3::tensor_view<float const, 2>(gv.data(), {L + 1, d}));
      a.begin(k3::host_view(cf(emb.data()), T, d));
      k3::tensor_view<float, 2> const xb(x.data(), {T, d}, {0, 1});
      CHECK(broadcast_named(error_of([&] { a.input(xb); }), "x"));
      a.input(k3::host_view(x.data(), T, d));
      a.add(k3::host_view(cf(y.data()), T, d));
      a.input(k3::host_view(x.data(), T, d));
      CHECK(broadcast_named(error_of([&] { a.add_input(k3::host_view(cf(y.data()), T, d), xb); }), "x"));
    }
  }
}

TEST_CASE("attnres: strided outputs (padded rows, sites and tokens swapped) give the numbers of contiguous ones") {
  index_t const n = 3, nq = 2, T = 5, d = 16;
  std::vector<float> mem(std::size_t(n * T * d + nq * d + T * d + 64));
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = 0.3f * std::sin(0.37f * float(i)) + 0.05f;
  float const* bank = mem.data();
  float const* u = bank + n * T * d;
  float const* part = u + nq * d;
  auto run = [&](auto const& be) {
    // block_rinv into every other element
    std::vector<float> r0(static_cast<std::size_t>(T)), r1(std::size_t(2 * T), -1.f);
    ar::block_rinv(be, ar::block_rinv_args<float>{.block = k3::host_view(bank, T, d), .rinv = k3::host_view(r0.data(), T)});
    ar::block_rinv(be, ar::block_rinv_args<float>{.block = k3::host_view(bank, T, d), .rinv = k3::tensor_view<float, 1>(r1.data(), {T}, {2})});
    for (index_t t = 0; t < T; ++t) CHECK(r1[std::size_t(2 * t)] == r0[std::size_t(t)]);
    std::vector<float> rinv(std::size_t(n * T));
    for (index_t j = 0; j < n; ++j)
      ar::block_rinv(be, ar::block_rinv_args<float>{.block = k3::host_view(bank + j * T * d, T, d), .rinv = k3::host_view(rinv.data() + j * T, T)});
    auto bv = k3::host_view(bank, n, T, d);
    auto rv = k3::host_view(static_cast<float const*>(rinv.data()), n, T);
    auto uv = k3::host_view(u, nq, d);
    // phase1: o as [T, nq, d] in memory with padded rows; lse transposed
    std::vector<float> o0(std::size_t(nq * T * d)), l0(std::size_t(nq * T)), o1(std::size_t(T * nq * (d + 3))), l1(std::size_t(nq * T));
    ar::phase1(be, ar::phase1_args<float>{
                       .bank = bv, .bank_rinv = rv, .u = uv, .o = k3::host_view(o0.data(), nq, T, d), .lse = k3::host_view(l0.data(), nq, T)});
    k3::tensor_view<float, 3> o1v(o1.data(), {nq, T, d}, {d + 3, nq * (d + 3), 1});
    k3::tensor_view<float, 2> l1v(l1.data(), {nq, T}, {1, nq});
    ar::phase1(be, ar::phase1_args<float>{.bank = bv, .bank_rinv = rv, .u = uv, .o = o1v, .lse = l1v});
    for (index_t l = 0; l < nq; ++l)
      for (index_t t = 0; t < T; ++t) {
        CHECK(l1v(l, t) == l0[std::size_t(l * T + t)]);
        for (index_t k = 0; k < d; ++k) REQUIRE(o1v(l, t, k) == o0[std::size_t((l * T + t) * d + k)]);
      }
    // phase2 into padded rows
    auto oc = k3::host_view(static_cast<float const*>(o0.data()), T, d);
    auto lc = k3::host_view(static_cast<float const*>(l0.data()), T);
    std::vector<float> h0(std::size_t(T * d)), h1(std::size_t(T * (d + 5)));
    ar::phase2(be, ar::phase2_args<float>{
                       .o = oc, .lse = lc, .partial = k3::host_view(part, T, d), .u = k3::host_view(u, d), .h = k3::host_view(h0.data(), T, d)});
    k3::tensor_view<float, 2> h1v(h1.data(), {T, d}, {d + 5, 1});
    ar::phase2(be, ar::phase2_args<float>{.o = oc, .lse = lc, .partial = k3::host_view(part, T, d), .u = k3::host_view(u, d), .h = h1v});
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < d; ++k) REQUIRE(h1v(t, k) == h0[std::size_t(t * d + k)]);
    // phase2_add: prefix and h with padded rows
    std::vector<float> pf0(part, part + T * d), pf1(std::size_t(T * (d + 2))), h2(std::size_t(T * (d + 7)));
    k3::tensor_view<float, 2> pf1v(pf1.data(), {T, d}, {d + 2, 1}), h2v(h2.data(), {T, d}, {d + 7, 1});
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < d; ++k) pf1v(t, k) = pf0[std::size_t(t * d + k)];
    auto delta = k3::host_view(bank + d, T, d);
    ar::phase2_add(be, ar::phase2_add_args<float>{.o = oc,
                                                  .lse = lc,
                                                  .prefix = k3::host_view(pf0.data(), T, d),
                                                  .delta = delta,
                                                  .u = k3::host_view(u, d),
                                                  .h = k3::host_view(h0.data(), T, d)});
    ar::phase2_add(be, ar::phase2_add_args<float>{.o = oc, .lse = lc, .prefix = pf1v, .delta = delta, .u = k3::host_view(u, d), .h = h2v});
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < d; ++k) {
        REQUIRE(pf1v(t, k) == pf0[std::size_t(t * d + k)]);
        REQUIRE(h2v(t, k) == h0[std::size_t(t * d + k)]);
      }
    // mix forward into padded h
    auto src = ar::make_sources(bv, k3::host_view(part, T, d));
    auto w = k3::host_view(u, d);
    auto g = k3::host_view(u + d, d);
    ar::mix_forward(be, ar::mix_forward_args<float>{.sources = src, .w = w, .gain = g, .h = k3::host_view(h0.data(), T, d)});
    ar::mix_forward(be, ar::mix_forward_args<float>{.sources = src, .w = w, .gain = g, .h = h1v});
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < d; ++k) REQUIRE(h1v(t, k) == h0[std::size_t(t * d + k)]);
    // mix backward into padded dsources / dpartial and strided dw / dgain
    std::vector<float> db0(std::size_t(n * T * d)), dp0(std::size_t(T * d)), dw0(static_cast<std::size_t>(d)), dg0(static_cast<std::size_t>(d));
    std::vector<float> db1(std::size_t(n * T * (d + 1) + n)), dp1(std::size_t(T * (d + 4))), dw1(std::size_t(3 * d)), dg1(std::size_t(2 * d));
    auto dh = k3::host_view(bank + 2 * d, T, d);
    ar::mix_backward(be,
                     ar::mix_backward_args<float>{.sources = src,
                                                  .w = w,
                                                  .gain = g,
                                                  .d_h = dh,
                                                  .d_sources = ar::make_grads(k3::host_view(db0.data(), n, T, d), k3::host_view(dp0.data(), T, d)),
                                                  .d_w = k3::host_view(dw0.data(), d),
                                                  .d_gain = k3::host_view(dg0.data(), d)});
    k3::tensor_view<float, 3> db1v(db1.data(), {n, T, d}, {T * (d + 1) + 1, d + 1, 1});
    k3::tensor_view<float, 2> dp1v(dp1.data(), {T, d}, {d + 4, 1});
    k3::tensor_view<float, 1> dw1v(dw1.data(), {d}, {3}), dg1v(dg1.data(), {d}, {2});
    ar::mix_backward(be, ar::mix_backward_args<float>{
                             .sources = src, .w = w, .gain = g, .d_h = dh, .d_sources = ar::make_grads(db1v, dp1v), .d_w = dw1v, .d_gain = dg1v});
    for (index_t k = 0; k < d; ++k) {
      REQUIRE(dw1v(k) == dw0[std::size_t(k)]);
      REQUIRE(dg1v(k) == dg0[std::size_t(k)]);
      for (index_t t = 0; t < T; ++t) {
        REQUIRE(dp1v(t, k) == dp0[std::size_t(t * d + k)]);
        for (index_t j = 0; j < n; ++j) REQUIRE(db1v(j, t, k) == db0[std::size_t((j * T + t) * d + k)]);
      }
    }
  };
  run(k3::cpu::serial{});
  run(k3::cpu::simd<>{});
  run(k3::cpu::threads<>(2));
}
