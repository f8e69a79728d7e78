// Adversarial API checks (round 4): the mix's outputs (h, stats; dsources, dpartial, dw,
// dgain) overlapping an input or each other must be rejected with a k3::error naming both.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attnres/loopback.hpp"
#include "error_of.hpp"
#include "k3/attnres.hpp"

namespace ar = k3::attnres;
using k3::index_t;

namespace {
using k3::test::error_of;
using k3::test::loopback;
using k3::test::mailbox;
bool names(std::string const& e, char const* a, char const* b) {
  return e.find(std::string("'") + a + "'") != std::string::npos && e.find(std::string("'") + b + "'") != std::string::npos &&
         e.find("overlap") != std::string::npos;
}
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
    return error_of([&] { ar::mix_forward(thr, src, w, g, k3::host_view(h, T, d), {}, k3::host_view(st, T, n + 1, index_t(3))); });
  };
  CHECK(fwd(at(4), at(5)) == "");
  CHECK(names(fwd(at(4), at(0)), "stats", "sources"));
  CHECK(names(fwd(at(4), at(1)), "stats", "partial"));
  CHECK(names(fwd(at(4), at(4) + 3), "stats", "h"));

  auto dh = k3::host_view(static_cast<double const*>(at(6)), T, d);
  auto bwd = [&](double* db, double* dp, double* dw, double* dg) {
    return error_of([&] {
      ar::mix_backward(thr, src, w, g, dh, ar::make_grads(k3::host_view(db, n, T, d), k3::host_view(dp, T, d)), k3::host_view(dw, d),
                       k3::host_view(dg, d));
    });
  };
  CHECK(bwd(at(7), at(8), at(9), at(10)) == "");
  CHECK(names(bwd(at(6), at(8), at(9), at(10)), "dsources", "dh"));
  CHECK(names(bwd(at(7), at(0) + 8, at(9), at(10)), "dpartial", "sources"));
  CHECK(names(bwd(at(7), at(8), at(2), at(10)), "dw", "w"));
  CHECK(names(bwd(at(7), at(8), at(9), at(9)), "dw", "dgain"));
  CHECK(names(bwd(at(7), at(8), at(7) + 2, at(10)), "dw", "dsources"));
  CHECK(names(bwd(at(7), at(8), at(9), at(6)), "dgain", "dh"));
  CHECK(names(bwd(at(7), at(7) + 8, at(9), at(10)), "dsources", "dpartial"));
}

TEST_CASE("attnres two-phase: outputs overlapping inputs are rejected; a bad eps is an error") {
  index_t const n = 2, nq = 2, T = 3, d = 4;
  std::vector<float> mem(64 * 16, 0.5f);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = 0.02f * float(i % 11) + 0.1f;
  auto at = [&](int i) { return mem.data() + 64 * i; };
  auto cf = [](float* p) { return static_cast<float const*>(p); };
  k3::cpu::simd<> be;
  // block_rinv
  CHECK(error_of([&] { ar::block_rinv(be, k3::host_view(cf(at(0)), T, d), k3::host_view(at(1), T)); }) == "");
  CHECK(names(error_of([&] { ar::block_rinv(be, k3::host_view(cf(at(0)), T, d), k3::host_view(at(0) + 5, T)); }), "rinv", "block"));
  // phase1: bank at 0, rinv at 1, u at 2, o at 3, lse at 4
  auto p1 = [&](float* o, float* lse) {
    return error_of([&] {
      ar::phase1(be, k3::host_view(cf(at(0)), n, T, d), k3::host_view(cf(at(1)), n, T), k3::host_view(cf(at(2)), nq, d), k3::host_view(o, nq, T, d),
                 k3::host_view(lse, nq, T));
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
      ar::phase2(be, k3::host_view(cf(at(3)), T, d), k3::host_view(cf(at(4)), T), k3::host_view(cf(at(5)), T, d), true, k3::host_view(cf(at(6)), d),
                 k3::host_view(h, T, d), eps);
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
      ar::phase2_add(be, k3::host_view(cf(at(3)), T, d), k3::host_view(cf(at(4)), T), k3::host_view(prefix, T, d), k3::host_view(cf(delta), T, d),
                     k3::host_view(cf(at(6)), d), k3::host_view(h, T, d));
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
