#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attnres/reference.hpp"
#include "k3/attnres.hpp"
#include "support/error_of.hpp"

namespace ar = k3::attnres;
using attnres_ref::rel_err;
using k3::index_t;

namespace {

// A random mixing problem: n bank rows + optional partial, T tokens, width d.
struct problem {
  index_t n, T, d;
  bool partial;
  double eps;
  std::vector<double> bank, part, w, g, dh;
  problem(index_t n_, index_t T_, index_t d_, bool p, std::uint64_t seed, double eps_ = 1e-5) : n(n_), T(T_), d(d_), partial(p), eps(eps_) {
    attnres_ref::rng r(seed);
    bank.resize(std::size_t(n * T * d));
    // sources of very different magnitudes, as block sums and partial sums are
    for (index_t j = 0; j < n; ++j) {
      double sc = std::exp(r.uniform(-1.5, 1.5));
      for (index_t i = 0; i < T * d; ++i) bank[std::size_t(j * T * d + i)] = sc * r.normal();
    }
    part = r.normals<double>(std::size_t(T * d), 2.0);
    w = r.normals<double>(std::size_t(d), 1.0 / std::sqrt(double(d)) * 3);
    g = r.normals<double>(std::size_t(d), 0.3);
    for (auto& x : g) x += 1.0;
    dh = r.normals<double>(std::size_t(T * d));
  }
  index_t m() const { return n + (partial ? 1 : 0); }
  std::vector<attnres_ref::vec> token(index_t t) const {
    std::vector<attnres_ref::vec> V;
    for (index_t j = 0; j < n; ++j) V.emplace_back(bank.begin() + (j * T + t) * d, bank.begin() + (j * T + t + 1) * d);
    if (partial) V.emplace_back(part.begin() + t * d, part.begin() + (t + 1) * d);
    return V;
  }
  // reference outputs
  std::vector<double> h, dbank, dpart, dw, dg;
  void reference() {
    h.assign(std::size_t(T * d), 0);
    dbank.assign(bank.size(), 0);
    dpart.assign(part.size(), 0);
    std::vector<long double> du(std::size_t(d), 0);
    for (index_t t = 0; t < T; ++t) {
      auto V = token(t);
      auto f = attnres_ref::forward(V, w, g, eps);
      std::copy(f.h.begin(), f.h.end(), h.begin() + t * d);
      attnres_ref::vec dht(dh.begin() + t * d, dh.begin() + (t + 1) * d);
      std::vector<attnres_ref::vec> dV;
      attnres_ref::backward(V, w, g, eps, dht, dV, du);
      for (index_t j = 0; j < n; ++j) std::copy(dV[j].begin(), dV[j].end(), dbank.begin() + (j * T + t) * d);
      if (partial) std::copy(dV[n].begin(), dV[n].end(), dpart.begin() + t * d);
    }
    dw.resize(std::size_t(d));
    dg.resize(std::size_t(d));
    for (index_t k = 0; k < d; ++k) {
      dw[k] = double(du[k] * g[k]);
      dg[k] = double(du[k] * w[k]);
    }
  }
};

template <class S>
std::vector<S> cast(std::vector<double> const& v) {
  std::vector<S> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = S(v[i]);
  return o;
}
template <class S>
std::vector<double> widen(std::vector<S> const& v) {
  std::vector<double> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = double(float(v[i]));
  if constexpr (std::is_same_v<S, double>)
    for (std::size_t i = 0; i < v.size(); ++i) o[i] = v[i];
  return o;
}

struct errors {
  double h, dbank, dpart, dw, dg;
};

// Runs the library on `p` with storage S on backend B; returns relative errors vs the reference.
template <class S, class B>
errors run(B const& b, problem const& p) {
  using C = k3::accumulation_t<S>;
  auto bank = cast<S>(p.bank), part = cast<S>(p.part);
  auto w = cast<C>(p.w), g = cast<C>(p.g), dh = cast<C>(p.dh);
  std::vector<S> h(std::size_t(p.T * p.d));
  std::vector<C> dbank(bank.size(), C(7)), dpart(part.size(), C(7)), dw(std::size_t(p.d)), dg(std::size_t(p.d));
  auto bv = k3::host_view(bank.data(), p.n, p.T, p.d);
  auto pv = k3::host_view(part.data(), p.T, p.d);
  auto src = p.partial ? ar::make_sources(bv, pv) : ar::make_sources(bv);
  ar::options opt;
  opt.eps = p.eps;
  ar::mix_forward(
      b,
      ar::mix_forward_args<S>{
          .sources = src, .w = k3::host_view(w.data(), p.d), .gain = k3::host_view(g.data(), p.d), .h = k3::host_view(h.data(), p.T, p.d)},
      opt);
  ar::mix_backward(
      b,
      ar::mix_backward_args<S, C, C>{.sources = src,
                                     .w = k3::host_view(w.data(), p.d),
                                     .gain = k3::host_view(g.data(), p.d),
                                     .d_h = k3::host_view(dh.data(), p.T, p.d),
                                     .d_sources = ar::make_grads(k3::host_view(dbank.data(), p.n, p.T, p.d), k3::host_view(dpart.data(), p.T, p.d)),
                                     .d_w = k3::host_view(dw.data(), p.d),
                                     .d_gain = k3::host_view(dg.data(), p.d)},
      opt);
  errors e{rel_err(widen(h), p.h), rel_err(widen(dbank), p.dbank), p.partial ? rel_err(widen(dpart), p.dpart) : 0.0,
           rel_err(widen(dw), p.dw), rel_err(widen(dg), p.dg)};
  return e;
}

double worst(errors const& e) { return std::max({e.h, e.dbank, e.dpart, e.dw, e.dg}); }

struct shape {
  index_t n, T, d;
  bool partial;
};
std::vector<shape> shapes() {
  return {{1, 1, 1, false}, {0, 3, 5, true},  {1, 4, 8, true},   {2, 1, 33, false}, {3, 7, 17, true},
          {8, 5, 64, true}, {9, 2, 71, false}, {5, 13, 40, true}, {1, 0, 8, true},   {20, 3, 24, true}};
}

}  // namespace

TEST_CASE("spec numeric test vector (d = 4, eps = 1e-5)") {
  std::vector<double> bank = {1, -2, 3, 0.5, 0.5, 0.5, -1, 2, -1, 1, 1, -1};
  std::vector<double> w = {0.2, -0.1, 0.3, 0.05}, g = {1, 1.5, 0.5, 1}, h(4), dh = {1, 0, -1, 0.5};
  std::vector<double> stats(9), dbank(12), dw(4), dg(4);
  auto src = ar::make_sources(k3::host_view(bank.data(), 3, 1, 4));
  k3::cpu::serial b;
  ar::mix_forward(b, ar::mix_forward_args<double>{.sources = src,
                                                  .w = k3::host_view(w.data(), 4),
                                                  .gain = k3::host_view(g.data(), 4),
                                                  .h = k3::host_view(h.data(), 1, 4),
                                                  .stats = k3::host_view(stats.data(), 1, 3, 3)});
  double const r[] = {0.529812, 0.852800, 0.999995}, s[] = {0.516567, -0.021320, -0.249999}, al[] = {0.488141, 0.285065, 0.226793};
  for (int j = 0; j < 3; ++j) {
    CHECK(std::abs(stats[3 * j] - r[j]) < 5e-7);
    CHECK(std::abs(stats[3 * j] * stats[3 * j + 1] - s[j]) < 5e-7);
    CHECK(std::abs(stats[3 * j + 2] - al[j]) < 5e-7);
  }
  double const hr[] = {0.403881, -0.606957, 1.406152, 0.587408};
  for (int k = 0; k < 4; ++k) CHECK(std::abs(h[k] - hr[k]) < 5e-7);
  ar::mix_backward(b, ar::mix_backward_args<double>{.sources = src,
                                                    .w = k3::host_view(w.data(), 4),
                                                    .gain = k3::host_view(g.data(), 4),
                                                    .d_h = k3::host_view(dh.data(), 1, 4),
                                                    .d_sources = ar::make_grads(k3::host_view(dbank.data(), 3, 1, 4)),
                                                    .d_w = k3::host_view(dw.data(), 4),
                                                    .d_gain = k3::host_view(dg.data(), 4)});
  double const dv[3][4] = {{0.452702, 0.003544, -0.473257, 0.239818},
                           {0.442841, -0.115229, -0.171609, 0.188624},
                           {0.170929, 0.035550, -0.313128, 0.118475}};
  double const dwr[] = {0.526952, 0.783602, -0.997157, 1.831642}, dgr[] = {0.105390, -0.052240, -0.598294, 0.091582};
  for (int j = 0; j < 3; ++j)
    for (int k = 0; k < 4; ++k) CHECK(std::abs(dbank[j * 4 + k] - dv[j][k]) < 5e-7);
  for (int k = 0; k < 4; ++k) {
    CHECK(std::abs(dw[k] - dwr[k]) < 5e-7);
    CHECK(std::abs(dg[k] - dgr[k]) < 5e-7);
  }
  // the same with v2 as the partial sum, on the threaded backend
  std::vector<double> h2(4);
  ar::mix_forward(k3::cpu::threads<>(2),
                  ar::mix_forward_args<double>{.sources = ar::make_sources(k3::host_view(bank.data(), 2, 1, 4), k3::host_view(bank.data() + 8, 1, 4)),
                                               .w = k3::host_view(w.data(), 4),
                                               .gain = k3::host_view(g.data(), 4),
                                               .h = k3::host_view(h2.data(), 1, 4)});
  for (int k = 0; k < 4; ++k) CHECK(std::abs(h2[k] - hr[k]) < 5e-7);
}

TEST_CASE("the float64 reference agrees with finite differences") {
  problem p(3, 2, 6, true, 11);
  p.reference();
  double const eps_fd = 1e-6;
  // loss = sum(dh * h); perturb a few entries of each input
  auto loss = [&](problem const& q) {
    double L = 0;
    for (index_t t = 0; t < q.T; ++t) {
      auto f = attnres_ref::forward(q.token(t), q.w, q.g, q.eps);
      for (index_t k = 0; k < q.d; ++k) L += q.dh[std::size_t(t * q.d + k)] * f.h[std::size_t(k)];
    }
    return L;
  };
  double maxerr = 0;
  for (std::size_t i = 0; i < p.bank.size(); i += 5) {
    problem a = p, c = p;
    a.bank[i] += eps_fd;
    c.bank[i] -= eps_fd;
    maxerr = std::max(maxerr, std::abs((loss(a) - loss(c)) / (2 * eps_fd) - p.dbank[i]));
  }
  for (std::size_t i = 0; i < p.part.size(); i += 3) {
    problem a = p, c = p;
    a.part[i] += eps_fd;
    c.part[i] -= eps_fd;
    maxerr = std::max(maxerr, std::abs((loss(a) - loss(c)) / (2 * eps_fd) - p.dpart[i]));
  }
  for (std::size_t i = 0; i < p.w.size(); ++i) {
    problem a = p, c = p;
    a.w[i] += eps_fd;
    c.w[i] -= eps_fd;
    maxerr = std::max(maxerr, std::abs((loss(a) - loss(c)) / (2 * eps_fd) - p.dw[i]));
    problem a2 = p, c2 = p;
    a2.g[i] += eps_fd;
    c2.g[i] -= eps_fd;
    maxerr = std::max(maxerr, std::abs((loss(a2) - loss(c2)) / (2 * eps_fd) - p.dg[i]));
  }
  CHECK(maxerr < 1e-8);
}

TEST_CASE("double storage matches the float64 reference to 1e-12 (serial and threads)") {
  std::uint64_t seed = 100;
  for (auto s : shapes()) {
    CAPTURE(s.n);
    CAPTURE(s.T);
    CAPTURE(s.d);
    CAPTURE(s.partial);
    if (s.n == 0 && !s.partial) continue;
    problem p(s.n, s.T, s.d, s.partial, seed++);
    p.reference();
    CHECK(worst(run<double>(k3::cpu::serial{}, p)) <= 1e-12);
    CHECK(worst(run<double>(k3::cpu::threads<>(3), p)) <= 1e-12);
  }
}

TEST_CASE("float storage matches the float64 reference to 1e-6 (serial and threads)") {
  std::uint64_t seed = 200;
  for (auto s : shapes()) {
    CAPTURE(s.n);
    CAPTURE(s.T);
    CAPTURE(s.d);
    problem p(s.n, s.T, s.d, s.partial, seed++);
    // the reference sees exactly the float inputs
    for (auto* v : {&p.bank, &p.part, &p.w, &p.g, &p.dh})
      for (auto& x : *v) x = double(float(x));
    p.reference();
    errors es = run<float>(k3::cpu::serial{}, p), et = run<float>(k3::cpu::threads<>(3), p);
    CAPTURE(es.h);
    CAPTURE(es.dbank);
    CAPTURE(es.dw);
    CAPTURE(et.h);
    CAPTURE(et.dbank);
    CAPTURE(et.dw);
    CHECK(worst(es) <= 1e-6);
    CHECK(worst(et) <= 1e-6);
  }
}

TEST_CASE("bfloat16 storage: float mixing of the rounded inputs, output rounded once") {
  problem p(8, 6, 96, true, 300);
  for (auto* v : {&p.bank, &p.part})
    for (auto& x : *v) x = double(float(k3::bfloat16(float(x))));
  for (auto* v : {&p.w, &p.g, &p.dh})
    for (auto& x : *v) x = double(float(x));
  p.reference();
  errors e = run<k3::bfloat16>(k3::cpu::threads<>(2), p);
  CHECK(e.h <= 4e-3);  // one bf16 rounding of h
  CHECK(std::max({e.dbank, e.dpart, e.dw, e.dg}) <= 1e-6);
  errors es = run<k3::bfloat16>(k3::cpu::serial{}, p);
  CHECK(es.h <= 4e-3);
  CHECK(std::max({es.dbank, es.dpart, es.dw, es.dg}) <= 1e-6);
}

TEST_CASE("zero query gives the mean, one source is returned unchanged, dg = 0 at w = 0") {
  problem p(4, 5, 12, true, 400);
  std::fill(p.w.begin(), p.w.end(), 0.0);
  p.reference();
  std::vector<double> mean(std::size_t(p.T * p.d), 0);
  for (index_t t = 0; t < p.T; ++t)
    for (index_t k = 0; k < p.d; ++k) {
      double s = p.part[std::size_t(t * p.d + k)];
      for (index_t j = 0; j < p.n; ++j) s += p.bank[std::size_t((j * p.T + t) * p.d + k)];
      mean[std::size_t(t * p.d + k)] = s / double(p.m());
    }
  std::vector<double> h(mean.size());
  auto bv = k3::host_view(p.bank.data(), p.n, p.T, p.d);
  ar::mix_forward(k3::cpu::serial{}, ar::mix_forward_args<double>{.sources = ar::make_sources(bv, k3::host_view(p.part.data(), p.T, p.d)),
                                                                  .w = k3::host_view(p.w.data(), p.d),
                                                                  .gain = k3::host_view(p.g.data(), p.d),
                                                                  .h = k3::host_view(h.data(), p.T, p.d)});
  CHECK(rel_err(h, mean) <= 1e-15);
  for (double x : p.dg) CHECK(x == 0.0);
  // a single source comes back bit for bit, whatever the query
  problem q(1, 3, 9, false, 401);
  std::vector<float> b1 = cast<float>(q.bank), h1(b1.size()), w1 = cast<float>(q.w), g1 = cast<float>(q.g);
  ar::mix_forward(k3::cpu::threads<>(2), ar::mix_forward_args<float>{.sources = ar::make_sources(k3::host_view(b1.data(), 1, 3, 9)),
                                                                     .w = k3::host_view(w1.data(), 9),
                                                                     .gain = k3::host_view(g1.data(), 9),
                                                                     .h = k3::host_view(h1.data(), 3, 9)});
  CHECK(h1 == b1);
}

TEST_CASE("with eps = 0 the RMSNorm removes a pure-scale advantage") {
  index_t const d = 10;
  attnres_ref::rng r(5);
  auto x = r.normals<double>(std::size_t(d));
  std::vector<double> bank(std::size_t(2 * d)), w = r.normals<double>(std::size_t(d)), g(std::size_t(d), 1.0), stats(6), h(static_cast<std::size_t>(d));
  for (index_t k = 0; k < d; ++k) {
    bank[std::size_t(k)] = 0.01 * x[std::size_t(k)];
    bank[std::size_t(d + k)] = 10 * x[std::size_t(k)];
  }
  ar::options opt;
  opt.eps = 0;
  ar::mix_forward(k3::cpu::serial{},
                  ar::mix_forward_args<double>{.sources = ar::make_sources(k3::host_view(bank.data(), 2, 1, d)),
                                               .w = k3::host_view(w.data(), d),
                                               .gain = k3::host_view(g.data(), d),
                                               .h = k3::host_view(h.data(), 1, d),
                                               .stats = k3::host_view(stats.data(), 1, 2, 3)},
                  opt);
  CHECK(std::abs(stats[2] - 0.5) < 1e-14);
  CHECK(std::abs(stats[5] - 0.5) < 1e-14);
}

TEST_CASE("stored statistics and recomputation give bit-identical gradients, accumulate adds") {
  problem p(5, 9, 37, true, 500);
  auto bank = cast<float>(p.bank), part = cast<float>(p.part), w = cast<float>(p.w), g = cast<float>(p.g), dh = cast<float>(p.dh);
  auto src = ar::make_sources(k3::host_view(bank.data(), p.n, p.T, p.d), k3::host_view(part.data(), p.T, p.d));
  std::vector<float> h(part.size()), stats(std::size_t(p.T * p.m() * 3));
  k3::cpu::threads<> b(2);
  auto wv = k3::host_view(w.data(), p.d), gv = k3::host_view(g.data(), p.d);
  ar::mix_forward(
      b, ar::mix_forward_args<float>{
             .sources = src, .w = wv, .gain = gv, .h = k3::host_view(h.data(), p.T, p.d), .stats = k3::host_view(stats.data(), p.T, p.m(), 3)});
  std::vector<float> db1(bank.size()), dp1(part.size()), dw1(std::size_t(p.d)), dg1(std::size_t(p.d));
  std::vector<float> db2 = db1, dp2 = dp1, dw2 = dw1, dg2 = dg1;
  ar::mix_backward(
      b, ar::mix_backward_args<float>{.sources = src,
                                      .w = wv,
                                      .gain = gv,
                                      .d_h = k3::host_view(dh.data(), p.T, p.d),
                                      .d_sources = ar::make_grads(k3::host_view(db1.data(), p.n, p.T, p.d), k3::host_view(dp1.data(), p.T, p.d)),
                                      .d_w = k3::host_view(dw1.data(), p.d),
                                      .d_gain = k3::host_view(dg1.data(), p.d),
                                      .stats = k3::tensor_view<float const, 3>(stats.data(), {p.T, p.m(), 3})});
  ar::mix_backward(
      b, ar::mix_backward_args<float>{.sources = src,
                                      .w = wv,
                                      .gain = gv,
                                      .d_h = k3::host_view(dh.data(), p.T, p.d),
                                      .d_sources = ar::make_grads(k3::host_view(db2.data(), p.n, p.T, p.d), k3::host_view(dp2.data(), p.T, p.d)),
                                      .d_w = k3::host_view(dw2.data(), p.d),
                                      .d_gain = k3::host_view(dg2.data(), p.d)});
  CHECK(db1 == db2);
  CHECK(dp1 == dp2);
  CHECK(dw1 == dw2);
  CHECK(dg1 == dg2);
  ar::options acc;
  acc.accumulate = true;
  ar::mix_backward(
      b,
      ar::mix_backward_args<float>{.sources = src,
                                   .w = wv,
                                   .gain = gv,
                                   .d_h = k3::host_view(dh.data(), p.T, p.d),
                                   .d_sources = ar::make_grads(k3::host_view(db2.data(), p.n, p.T, p.d), k3::host_view(dp2.data(), p.T, p.d)),
                                   .d_w = k3::host_view(dw2.data(), p.d),
                                   .d_gain = k3::host_view(dg2.data(), p.d)},
      acc);
  for (std::size_t i = 0; i < db1.size(); ++i) CHECK(db2[i] == 2 * db1[i]);
  for (std::size_t i = 0; i < dw1.size(); ++i) CHECK(dw2[i] == doctest::Approx(2 * dw1[i]).epsilon(1e-6));
}

// Regression: dw and dgain (sums over tokens) were reduced over one partial sum per
// thread task, so double results differed in the last bits between 1, 2 and 3 threads.
TEST_CASE("gradients are bitwise the same for every thread count") {
  problem p(4, 200, 37, true, 77);
  auto grads = [&](auto const& b) {
    auto bank = p.bank, part = p.part;
    std::vector<double> dbank(bank.size()), dpart(part.size()), dw(std::size_t(p.d)), dg(std::size_t(p.d));
    auto src = ar::make_sources(k3::host_view(bank.data(), p.n, p.T, p.d), k3::host_view(part.data(), p.T, p.d));
    ar::mix_backward(b, ar::mix_backward_args<double>{
                            .sources = src,
                            .w = k3::host_view(p.w.data(), p.d),
                            .gain = k3::host_view(p.g.data(), p.d),
                            .d_h = k3::host_view(p.dh.data(), p.T, p.d),
                            .d_sources = ar::make_grads(k3::host_view(dbank.data(), p.n, p.T, p.d), k3::host_view(dpart.data(), p.T, p.d)),
                            .d_w = k3::host_view(dw.data(), p.d),
                            .d_gain = k3::host_view(dg.data(), p.d)});
    dbank.insert(dbank.end(), dpart.begin(), dpart.end());
    dbank.insert(dbank.end(), dw.begin(), dw.end());
    dbank.insert(dbank.end(), dg.begin(), dg.end());
    return dbank;
  };
  // (the serial backend's scalar per-token sums differ from the vector lanes in the last bits)
  auto const ref = grads(k3::cpu::threads<>(1));
  for (int th : {2, 3, 5}) {
    CAPTURE(th);
    CHECK(grads(k3::cpu::threads<>(th)) == ref);
  }
}

TEST_CASE("a NaN in one token stays in that token") {
  problem p(3, 6, 20, true, 600);
  p.bank[std::size_t((1 * p.T + 2) * p.d + 4)] = std::numeric_limits<double>::quiet_NaN();  // token 2
  p.part[std::size_t(4 * p.d + 1)] = std::numeric_limits<double>::infinity();               // token 4
  auto bank = cast<float>(p.bank), part = cast<float>(p.part), w = cast<float>(p.w), g = cast<float>(p.g), dh = cast<float>(p.dh);
  std::vector<float> h(part.size()), db(bank.size()), dp(part.size()), dw(std::size_t(p.d)), dg(std::size_t(p.d));
  auto src = ar::make_sources(k3::host_view(bank.data(), p.n, p.T, p.d), k3::host_view(part.data(), p.T, p.d));
  for (int backend = 0; backend < 2; ++backend) {
    auto go = [&](auto const& b) {
      ar::mix_forward(
          b, ar::mix_forward_args<float>{
                 .sources = src, .w = k3::host_view(w.data(), p.d), .gain = k3::host_view(g.data(), p.d), .h = k3::host_view(h.data(), p.T, p.d)});
      ar::mix_backward(
          b, ar::mix_backward_args<float>{.sources = src,
                                          .w = k3::host_view(w.data(), p.d),
                                          .gain = k3::host_view(g.data(), p.d),
                                          .d_h = k3::host_view(dh.data(), p.T, p.d),
                                          .d_sources = ar::make_grads(k3::host_view(db.data(), p.n, p.T, p.d), k3::host_view(dp.data(), p.T, p.d)),
                                          .d_w = k3::host_view(dw.data(), p.d),
                                          .d_gain = k3::host_view(dg.data(), p.d)});
    };
    if (backend == 0) go(k3::cpu::serial{});
    else go(k3::cpu::threads<>(3));
    for (index_t t = 0; t < p.T; ++t) {
      bool bad = t == 2 || t == 4;
      bool any_nan = false, all_finite = true;
      for (index_t k = 0; k < p.d; ++k) {
        float x = h[std::size_t(t * p.d + k)], y = dp[std::size_t(t * p.d + k)];
        any_nan |= std::isnan(x);
        all_finite &= std::isfinite(x) && std::isfinite(y);
        for (index_t j = 0; j < p.n; ++j) all_finite &= std::isfinite(db[std::size_t((j * p.T + t) * p.d + k)]);
      }
      CAPTURE(t);
      if (bad) CHECK(any_nan);
      else CHECK(all_finite);
    }
  }
}

TEST_CASE("bad input gives k3::error naming the argument with expected vs actual") {
  std::vector<float> bank(2 * 3 * 8), part(3 * 8), w(8), g(8), h(3 * 8), w7(7);
  auto src = ar::make_sources(k3::host_view(bank.data(), 2, 3, 8), k3::host_view(part.data(), 3, 8));
  k3::cpu::serial b;
  std::string m = k3::test::error_of([&] {
    ar::mix_forward(b, ar::mix_forward_args<float>{
                           .sources = src, .w = k3::host_view(w7.data(), 7), .gain = k3::host_view(g.data(), 8), .h = k3::host_view(h.data(), 3, 8)});
  });
  CHECK(m.find("'w'") != std::string::npos);
  CHECK(m.find("[8]") != std::string::npos);
  CHECK(m.find("[7]") != std::string::npos);
  m = k3::test::error_of([&] {
    ar::mix_forward(b, ar::mix_forward_args<float>{
                           .sources = src, .w = k3::host_view(w.data(), 8), .gain = k3::host_view(w7.data(), 7), .h = k3::host_view(h.data(), 3, 8)});
  });
  CHECK(m.find("'gain'") != std::string::npos);
  m = k3::test::error_of([&] {
    ar::mix_forward(b, ar::mix_forward_args<float>{.sources = ar::make_sources(k3::host_view(bank.data(), 2, 3, 8), k3::host_view(part.data(), 4, 6)),
                                                   .w = k3::host_view(w.data(), 8),
                                                   .gain = k3::host_view(g.data(), 8),
                                                   .h = k3::host_view(h.data(), 3, 8)});
  });
  CHECK(m.find("'partial'") != std::string::npos);
  CHECK(m.find("[3, 8]") != std::string::npos);
  CHECK(m.find("[4, 6]") != std::string::npos);
  m = k3::test::error_of([&] {
    ar::mix_forward(b, ar::mix_forward_args<float>{
                           .sources = src, .w = k3::host_view(w.data(), 8), .gain = k3::host_view(g.data(), 8), .h = k3::host_view(h.data(), 8, 3)});
  });
  CHECK(m.find("'h'") != std::string::npos);
  m = k3::test::error_of([&] {
    ar::mix_forward(b, ar::mix_forward_args<float>{.sources = ar::make_sources(k3::host_view(bank.data(), 0, 3, 8)),
                                                   .w = k3::host_view(w.data(), 8),
                                                   .gain = k3::host_view(g.data(), 8),
                                                   .h = k3::host_view(h.data(), 3, 8)});
  });
  CHECK(m.find("at least one source") != std::string::npos);
  m = k3::test::error_of([&] {
    ar::mix_forward(b,
                    ar::mix_forward_args<float>{
                        .sources = src, .w = k3::host_view(w.data(), 8), .gain = k3::host_view(g.data(), 8), .h = k3::host_view(part.data(), 3, 8)});
  });
  CHECK(m.find("overlap") != std::string::npos);
  ar::options bad;
  bad.eps = -1;
  m = k3::test::error_of([&] {
    ar::mix_forward(b,
                    ar::mix_forward_args<float>{
                        .sources = src, .w = k3::host_view(w.data(), 8), .gain = k3::host_view(g.data(), 8), .h = k3::host_view(h.data(), 3, 8)},
                    bad);
  });
  CHECK(m.find("eps") != std::string::npos);
  std::vector<float> db(2 * 3 * 8), dw(8), dg(8);
  m = k3::test::error_of([&] {
    ar::mix_backward(b, ar::mix_backward_args<float>{.sources = src,
                                                     .w = k3::host_view(w.data(), 8),
                                                     .gain = k3::host_view(g.data(), 8),
                                                     .d_h = k3::host_view(h.data(), 3, 8),
                                                     .d_sources = ar::make_grads(k3::host_view(db.data(), 2, 3, 8)),
                                                     .d_w = k3::host_view(dw.data(), 8),
                                                     .d_gain = k3::host_view(dg.data(), 8)});
  });
  CHECK(m.find("'d_partial'") != std::string::npos);
}

TEST_CASE("float64 rows beyond ~1e154 (sum of squares overflows, r = 0): finite gradients") {
  // The forward then mixes with r = 0 (every logit 0: the mean); the key path's coefficient
  // c r^3 must be formed as (c r) r^2 = 0, not (c ds) r^3 = inf * 0 = NaN.
  index_t const n = 3, T = 2, d = 5;
  std::vector<double> bank(n * T * d), w(d), g(d, 1.0), h(T * d), dh(T * d), db(bank.size()), dw(d), dg(d);
  for (std::size_t i = 0; i < bank.size(); ++i) bank[i] = (i % 3 == 0 ? -1.0 : 1.0) * (1.0 + 0.1 * double(i)) * 1e160;
  for (index_t k = 0; k < d; ++k) w[std::size_t(k)] = 0.3 * double(k) - 0.5;
  for (std::size_t i = 0; i < dh.size(); ++i) dh[i] = 0.25 * double(i % 7) - 0.75;
  auto src = ar::make_sources(k3::host_view(static_cast<double const*>(bank.data()), n, T, d));
  k3::cpu::serial b;
  ar::mix_forward(b, ar::mix_forward_args<double>{.sources = src,
                                                  .w = k3::host_view(static_cast<double const*>(w.data()), d),
                                                  .gain = k3::host_view(static_cast<double const*>(g.data()), d),
                                                  .h = k3::host_view(h.data(), T, d)});
  ar::mix_backward(b, ar::mix_backward_args<double>{.sources = src,
                                                    .w = k3::host_view(static_cast<double const*>(w.data()), d),
                                                    .gain = k3::host_view(static_cast<double const*>(g.data()), d),
                                                    .d_h = k3::host_view(static_cast<double const*>(dh.data()), T, d),
                                                    .d_sources = ar::make_grads(k3::host_view(db.data(), n, T, d)),
                                                    .d_w = k3::host_view(dw.data(), d),
                                                    .d_gain = k3::host_view(dg.data(), d)});
  for (index_t t = 0; t < T; ++t)
    for (index_t k = 0; k < d; ++k) {
      double mean = 0;
      for (index_t j = 0; j < n; ++j) mean += bank[std::size_t((j * T + t) * d + k)] / double(n);
      CHECK(h[std::size_t(t * d + k)] == doctest::Approx(mean).epsilon(1e-12));
      for (index_t j = 0; j < n; ++j) CHECK(db[std::size_t((j * T + t) * d + k)] == doctest::Approx(dh[std::size_t(t * d + k)] / double(n)).epsilon(1e-12));
    }
  for (index_t k = 0; k < d; ++k) {
    CHECK(std::isfinite(dw[std::size_t(k)]));
    CHECK(std::isfinite(dg[std::size_t(k)]));
  }
}
