// The Stable LatentMoE layer (k3/moe/latent_moe.hpp) against a brute-force float64 reference
// (loops over tokens, selected experts and elements, no Eigen, gradients by the chain rule per
// token) to 1e-12, and against central finite differences; float32 and bfloat16 against
// float64; ties, k = n, k = 1, T = 1, experts that receive no token, no shared experts; the
// same bits on every thread count; errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/moe/latent_moe.hpp"
#include "support/error_of.hpp"
#include "support/metrics.hpp"
#include "support/random.hpp"

namespace moe = k3::moe;
using k3::index_t;
using vec = std::vector<double>;

namespace {

struct dims {
  index_t T, d, n, l, f, s, F, k;
};

struct layer {
  dims m;
  vec x, wr, bias, wd, wg, wu, wdn, nw, wup, wsg, wsu, wsd;
};

layer random_layer(dims m, unsigned seed) {
  layer L{m, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  auto g = [&](index_t n, double sc) { return k3::test::gaussian(static_cast<std::size_t>(n), seed++, sc); };
  L.x = g(m.T * m.d, 1.0);
  L.wr = g(m.n * m.d, 0.5);
  L.bias = g(m.n, 0.1);
  L.wd = g(m.l * m.d, 0.4);
  L.wg = g(m.n * m.f * m.l, 0.5);
  L.wu = g(m.n * m.f * m.l, 0.5);
  L.wdn = g(m.n * m.l * m.f, 0.4);
  L.nw = g(m.l, 0.3);
  for (auto& v : L.nw) v += 1.0;
  L.wup = g(m.d * m.l, 0.4);
  L.wsg = g(m.s * m.F * m.d, 0.4);
  L.wsu = g(m.s * m.F * m.d, 0.4);
  L.wsd = g(m.s * m.d * m.F, 0.4);
  return L;
}

double sig(double v) { return 1.0 / (1.0 + std::exp(-v)); }
double situ(double gv, double uv, double bg, double bu) { return bg * std::tanh(gv / bg) * sig(gv) * bu * std::tanh(uv / bu); }
double situ_dg(double gv, double uv, double bg, double bu) {
  double const th = std::tanh(gv / bg);
  return ((1 - th * th) * sig(gv) + bg * th * sig(gv) * (1 - sig(gv))) * bu * std::tanh(uv / bu);
}
double situ_du(double gv, double uv, double bg, double bu) {
  double const tu = std::tanh(uv / bu);
  return bg * std::tanh(gv / bg) * sig(gv) * (1 - tu * tu);
}

struct result {
  vec y, p;
  std::vector<index_t> idx;
  vec dx, dwr, dwd, dwg, dwu, dwdn, dnw, dwup, dwsg, dwsu, dwsd;
};

// The layer written out token by token; with dy, its gradient by the chain rule.
result brute(layer const& L, moe::latent_moe_options const& o, vec const* dy) {
  dims const m = L.m;
  double const bg = o.beta_gate, bu = o.beta_up;
  result R;
  R.y.assign(static_cast<std::size_t>(m.T * m.d), 0);
  R.p.assign(static_cast<std::size_t>(m.T * m.k), 0);
  R.idx.assign(R.p.size(), 0);
  if (dy) {
    R.dx.assign(L.x.size(), 0);
    R.dwr.assign(L.wr.size(), 0);
    R.dwd.assign(L.wd.size(), 0);
    R.dwg.assign(L.wg.size(), 0);
    R.dwu.assign(L.wu.size(), 0);
    R.dwdn.assign(L.wdn.size(), 0);
    R.dnw.assign(L.nw.size(), 0);
    R.dwup.assign(L.wup.size(), 0);
    R.dwsg.assign(L.wsg.size(), 0);
    R.dwsu.assign(L.wsu.size(), 0);
    R.dwsd.assign(L.wsd.size(), 0);
  }
  auto X = [&](index_t t, index_t i) { return L.x[t * m.d + i]; };
  for (index_t t = 0; t < m.T; ++t) {
    vec s(static_cast<std::size_t>(m.n));
    for (index_t e = 0; e < m.n; ++e) {
      double acc = 0;
      for (index_t i = 0; i < m.d; ++i) acc += X(t, i) * L.wr[e * m.d + i];
      s[e] = sig(acc);
    }
    std::vector<index_t> ord(static_cast<std::size_t>(m.n));
    std::iota(ord.begin(), ord.end(), index_t(0));
    std::stable_sort(ord.begin(), ord.end(), [&](index_t a, index_t b) { return s[a] + L.bias[a] > s[b] + L.bias[b]; });
    double sum = 0;
    for (index_t r = 0; r < m.k; ++r) sum += s[ord[r]];
    double const dn = sum > 0 ? sum : 1.0;
    vec z(static_cast<std::size_t>(m.l), 0);
    for (index_t j = 0; j < m.l; ++j)
      for (index_t i = 0; i < m.d; ++i) z[j] += L.wd[j * m.d + i] * X(t, i);
    vec u(static_cast<std::size_t>(m.l), 0);
    std::vector<vec> gs, us, as;
    for (index_t r = 0; r < m.k; ++r) {
      index_t const e = ord[r];
      R.idx[t * m.k + r] = e;
      double const pr = s[e] / dn * o.scale;
      R.p[t * m.k + r] = pr;
      vec gv(static_cast<std::size_t>(m.f), 0), uv(gv), av(gv);
      for (index_t c = 0; c < m.f; ++c) {
        for (index_t j = 0; j < m.l; ++j) {
          gv[c] += L.wg[(e * m.f + c) * m.l + j] * z[j];
          uv[c] += L.wu[(e * m.f + c) * m.l + j] * z[j];
        }
        av[c] = situ(gv[c], uv[c], bg, bu);
      }
      for (index_t j = 0; j < m.l; ++j)
        for (index_t c = 0; c < m.f; ++c) u[j] += pr * L.wdn[(e * m.l + j) * m.f + c] * av[c];
      gs.push_back(gv);
      us.push_back(uv);
      as.push_back(av);
    }
    double ms = 0;
    for (double v : u) ms += v * v;
    ms /= double(m.l);
    double const rs = 1.0 / std::sqrt(ms + o.eps);
    vec nrm(u.size()), rr(u.size());
    for (index_t j = 0; j < m.l; ++j) nrm[j] = u[j] * rs, rr[j] = nrm[j] * L.nw[j];
    for (index_t i = 0; i < m.d; ++i)
      for (index_t j = 0; j < m.l; ++j) R.y[t * m.d + i] += L.wup[i * m.l + j] * rr[j];
    std::vector<vec> hg(static_cast<std::size_t>(m.s), vec(static_cast<std::size_t>(m.F), 0)), hu = hg;
    for (index_t q = 0; q < m.s; ++q)
      for (index_t c = 0; c < m.F; ++c) {
        for (index_t i = 0; i < m.d; ++i) {
          hg[q][c] += L.wsg[(q * m.F + c) * m.d + i] * X(t, i);
          hu[q][c] += L.wsu[(q * m.F + c) * m.d + i] * X(t, i);
        }
        double const a = situ(hg[q][c], hu[q][c], bg, bu);
        for (index_t i = 0; i < m.d; ++i) R.y[t * m.d + i] += L.wsd[(q * m.d + i) * m.F + c] * a;
      }
    if (!dy) continue;
    auto DY = [&](index_t i) { return (*dy)[t * m.d + i]; };
    vec dr(static_cast<std::size_t>(m.l), 0);
    for (index_t j = 0; j < m.l; ++j)
      for (index_t i = 0; i < m.d; ++i) {
        dr[j] += DY(i) * L.wup[i * m.l + j];
        R.dwup[i * m.l + j] += DY(i) * rr[j];
      }
    double dot = 0;
    for (index_t j = 0; j < m.l; ++j) {
      R.dnw[j] += dr[j] * nrm[j];
      dot += dr[j] * L.nw[j] * nrm[j];
    }
    vec du(static_cast<std::size_t>(m.l));
    for (index_t j = 0; j < m.l; ++j) du[j] = rs * (dr[j] * L.nw[j] - nrm[j] * dot / double(m.l));
    vec dz(static_cast<std::size_t>(m.l), 0), dp(static_cast<std::size_t>(m.k), 0);
    for (index_t r = 0; r < m.k; ++r) {
      index_t const e = ord[r];
      double const pr = R.p[t * m.k + r];
      for (index_t c = 0; c < m.f; ++c) {
        double dap = 0;
        for (index_t j = 0; j < m.l; ++j) {
          dap += L.wdn[(e * m.l + j) * m.f + c] * du[j];
          R.dwdn[(e * m.l + j) * m.f + c] += pr * du[j] * as[r][c];
        }
        dp[r] += dap * as[r][c];
        double const dgv = pr * dap * situ_dg(gs[r][c], us[r][c], bg, bu), duv = pr * dap * situ_du(gs[r][c], us[r][c], bg, bu);
        for (index_t j = 0; j < m.l; ++j) {
          R.dwg[(e * m.f + c) * m.l + j] += dgv * z[j];
          R.dwu[(e * m.f + c) * m.l + j] += duv * z[j];
          dz[j] += dgv * L.wg[(e * m.f + c) * m.l + j] + duv * L.wu[(e * m.f + c) * m.l + j];
        }
      }
    }
    for (index_t j = 0; j < m.l; ++j)
      for (index_t i = 0; i < m.d; ++i) {
        R.dwd[j * m.d + i] += dz[j] * X(t, i);
        R.dx[t * m.d + i] += dz[j] * L.wd[j * m.d + i];
      }
    double acc = 0;
    for (index_t r = 0; r < m.k; ++r) acc += dp[r] * (s[ord[r]] / dn);
    for (index_t r = 0; r < m.k; ++r) {
      index_t const e = ord[r];
      double const ds = sum > 0 ? o.scale * (dp[r] - acc) / dn : o.scale * dp[r];
      double const dl = ds * s[e] * (1 - s[e]);
      for (index_t i = 0; i < m.d; ++i) {
        R.dwr[e * m.d + i] += dl * X(t, i);
        R.dx[t * m.d + i] += dl * L.wr[e * m.d + i];
      }
    }
    for (index_t q = 0; q < m.s; ++q)
      for (index_t c = 0; c < m.F; ++c) {
        double das = 0;
        double const a = situ(hg[q][c], hu[q][c], bg, bu);
        for (index_t i = 0; i < m.d; ++i) {
          das += DY(i) * L.wsd[(q * m.d + i) * m.F + c];
          R.dwsd[(q * m.d + i) * m.F + c] += DY(i) * a;
        }
        double const dgv = das * situ_dg(hg[q][c], hu[q][c], bg, bu), duv = das * situ_du(hg[q][c], hu[q][c], bg, bu);
        for (index_t i = 0; i < m.d; ++i) {
          R.dwsg[(q * m.F + c) * m.d + i] += dgv * X(t, i);
          R.dwsu[(q * m.F + c) * m.d + i] += duv * X(t, i);
          R.dx[t * m.d + i] += dgv * L.wsg[(q * m.F + c) * m.d + i] + duv * L.wsu[(q * m.F + c) * m.d + i];
        }
      }
  }
  return R;
}

template <class T>
std::vector<T> cast(vec const& v) {
  std::vector<T> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = k3::store_as<T>(v[i]);
  return o;
}
template <class T>
vec widen(std::vector<T> const& v) {
  vec o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = k3::load_as<double>(v[i]);
  return o;
}

// The library on layer L in storage T; results widened to double. With from_saved the backward
// starts from the state a separate forward saved.
template <class T, class Bk>
result run(Bk const& b, layer const& L, moe::latent_moe_options const& o, vec const* dy, bool shared = true, bool from_saved = false) {
  dims const m = L.m;
  auto x = cast<T>(L.x), wr = cast<T>(L.wr), bias = cast<T>(L.bias), wd = cast<T>(L.wd), wg = cast<T>(L.wg), wu = cast<T>(L.wu),
       wdn = cast<T>(L.wdn), nw = cast<T>(L.nw), wup = cast<T>(L.wup), wsg = cast<T>(L.wsg), wsu = cast<T>(L.wsu), wsd = cast<T>(L.wsd);
  std::vector<T> y(static_cast<std::size_t>(m.T * m.d)), p(static_cast<std::size_t>(m.T * m.k));
  std::vector<std::int64_t> idx(p.size());
  moe::latent_moe_args<T> a{{x.data(), {m.T, m.d}},   {wr.data(), {m.n, m.d}},         {bias.data(), {m.n}},
                            {wd.data(), {m.l, m.d}},  {wg.data(), {m.n, m.f, m.l}},    {wu.data(), {m.n, m.f, m.l}},
                            {wdn.data(), {m.n, m.l, m.f}}, {nw.data(), {m.l}},         {wup.data(), {m.d, m.l}},
                            {},                       {},                              {},
                            {y.data(), {m.T, m.d}},   {idx.data(), {m.T, m.k}},        {p.data(), {m.T, m.k}}};
  if (shared) {
    a.ws_gate = {wsg.data(), {m.s, m.F, m.d}};
    a.ws_up = {wsu.data(), {m.s, m.F, m.d}};
    a.ws_down = {wsd.data(), {m.s, m.d, m.F}};
  }
  result R;
  if (!dy) {
    moe::latent_moe_forward(b, a, o);
  } else {
    auto dyv = cast<T>(*dy);
    std::vector<T> dx(x.size()), dwr(wr.size()), dwd(wd.size()), dwg(wg.size()), dwu(wu.size()), dwdn(wdn.size()), dnw(nw.size()),
        dwup(wup.size()), dwsg(wsg.size()), dwsu(wsu.size()), dwsd(wsd.size());
    moe::latent_moe_gradients<T> g{{dyv.data(), {m.T, m.d}}, {dx.data(), {m.T, m.d}}, {dwr.data(), {m.n, m.d}}, {dwd.data(), {m.l, m.d}},
                                   {dwg.data(), {m.n, m.f, m.l}}, {dwu.data(), {m.n, m.f, m.l}}, {dwdn.data(), {m.n, m.l, m.f}},
                                   {dnw.data(), {m.l}}, {dwup.data(), {m.d, m.l}}};
    if (shared) {
      g.dws_gate = {dwsg.data(), {m.s, m.F, m.d}};
      g.dws_up = {dwsu.data(), {m.s, m.F, m.d}};
      g.dws_down = {dwsd.data(), {m.s, m.d, m.F}};
    }
    moe::latent_moe_saved<T> saved;
    if (from_saved) {
      a.saved = &saved;
      moe::latent_moe_forward(b, a, o);
      REQUIRE(saved.filled());
      std::fill(dx.begin(), dx.end(), static_cast<T>(7.0));  // the backward overwrites every gradient
    }
    moe::latent_moe_backward(b, moe::latent_moe_backward_args<T>{a, g}, o);
    R.dx = widen(dx), R.dwr = widen(dwr), R.dwd = widen(dwd), R.dwg = widen(dwg), R.dwu = widen(dwu), R.dwdn = widen(dwdn);
    R.dnw = widen(dnw), R.dwup = widen(dwup), R.dwsg = widen(dwsg), R.dwsu = widen(dwsu), R.dwsd = widen(dwsd);
  }
  R.y = widen(y);
  R.p = widen(p);
  R.idx.assign(idx.begin(), idx.end());
  return R;
}

double rel(vec const& got, vec const& ref) { return k3::test::rel_max(got, ref); }

void check_all(result const& got, result const& ref, double tol_y, double tol_g, bool grads) {
  CHECK(got.idx == ref.idx);
  CHECK(rel(got.y, ref.y) < tol_y);
  CHECK(rel(got.p, ref.p) < tol_y);
  if (!grads) return;
  CHECK(rel(got.dx, ref.dx) < tol_g);
  CHECK(rel(got.dwr, ref.dwr) < tol_g);
  CHECK(rel(got.dwd, ref.dwd) < tol_g);
  CHECK(rel(got.dwg, ref.dwg) < tol_g);
  CHECK(rel(got.dwu, ref.dwu) < tol_g);
  CHECK(rel(got.dwdn, ref.dwdn) < tol_g);
  CHECK(rel(got.dnw, ref.dnw) < tol_g);
  CHECK(rel(got.dwup, ref.dwup) < tol_g);
  CHECK(rel(got.dwsg, ref.dwsg) < tol_g);
  CHECK(rel(got.dwsu, ref.dwsu) < tol_g);
  CHECK(rel(got.dwsd, ref.dwsd) < tol_g);
}

}  // namespace

TEST_CASE("latent_moe float64: forward and every gradient equal the brute-force layer to 1e-12") {
  for (dims m : {dims{5, 6, 7, 4, 3, 2, 5, 3}, dims{1, 4, 3, 3, 2, 1, 2, 3}, dims{9, 5, 6, 3, 4, 1, 3, 1}, dims{4, 3, 8, 5, 2, 2, 2, 8}}) {
    CAPTURE(m.T);
    CAPTURE(m.k);
    layer const L = random_layer(m, static_cast<unsigned>(m.T * 31 + m.k));
    vec const dy = k3::test::gaussian(static_cast<std::size_t>(m.T * m.d), 99);
    moe::latent_moe_options o;
    o.k = m.k;
    o.scale = 2.5;
    auto const ref = brute(L, o, &dy);
    check_all(run<double>(k3::cpu::serial{}, L, o, &dy), ref, 1e-12, 1e-12, true);
    check_all(run<double>(k3::cpu::threads<>(2), L, o, &dy, true, true), ref, 1e-12, 1e-12, true);
    check_all(run<double>(k3::cpu::threads<>(3), L, o, nullptr), ref, 1e-12, 0, false);
  }
}

TEST_CASE("latent_moe float64: gradients match central finite differences of <y, dy>") {
  dims const m{4, 5, 6, 4, 3, 1, 3, 2};
  layer const L = random_layer(m, 7);
  vec const dy = k3::test::gaussian(static_cast<std::size_t>(m.T * m.d), 8);
  moe::latent_moe_options o;
  o.k = m.k;
  auto const g = run<double>(k3::cpu::serial{}, L, o, &dy);
  auto loss = [&](layer const& P) {
    auto const r = run<double>(k3::cpu::serial{}, P, o, nullptr);
    double acc = 0;
    for (std::size_t i = 0; i < dy.size(); ++i) acc += r.y[i] * dy[i];
    return acc;
  };
  double const h = 1e-6;
  auto fd = [&](vec layer::*member, vec const& grad, char const* name) {
    for (std::size_t i = 0; i < grad.size(); i += std::max<std::size_t>(1, grad.size() / 7)) {
      layer P = L, M = L;
      (P.*member)[i] += h;
      (M.*member)[i] -= h;
      double const num = (loss(P) - loss(M)) / (2 * h);
      CAPTURE(name);
      CAPTURE(i);
      CHECK(grad[i] == doctest::Approx(num).epsilon(1e-6).scale(1.0));
    }
  };
  fd(&layer::x, g.dx, "dx");
  fd(&layer::wr, g.dwr, "dw_router");
  fd(&layer::wd, g.dwd, "dw_down");
  fd(&layer::wg, g.dwg, "dwe_gate");
  fd(&layer::wu, g.dwu, "dwe_up");
  fd(&layer::wdn, g.dwdn, "dwe_down");
  fd(&layer::nw, g.dnw, "dnorm_weight");
  fd(&layer::wup, g.dwup, "dw_up");
  fd(&layer::wsg, g.dwsg, "dws_gate");
  fd(&layer::wsu, g.dwsu, "dws_up");
  fd(&layer::wsd, g.dwsd, "dws_down");
}

TEST_CASE("latent_moe float32 within 2e-5 / 1e-4 and bfloat16 within 2e-2 of float64, the same bits on every thread count") {
  dims const m{12, 16, 8, 12, 10, 1, 6, 3};
  layer const L = random_layer(m, 17);
  vec const dy = k3::test::gaussian(static_cast<std::size_t>(m.T * m.d), 18);
  moe::latent_moe_options o;
  o.k = m.k;
  auto const ref = brute(L, o, &dy);
  auto const f = run<float>(k3::cpu::serial{}, L, o, &dy);
  check_all(f, ref, 2e-5, 1e-4, true);
  auto const f2 = run<float>(k3::cpu::threads<>(2), L, o, &dy);
  CHECK(f2.y == f.y);
  CHECK(f2.dx == f.dx);
  CHECK(f2.dwg == f.dwg);
  CHECK(f2.dwr == f.dwr);
  // The backward from the forward's saved state: the same bits as the one that runs the forward.
  auto const f3 = run<float>(k3::cpu::threads<>(3), L, o, &dy, true, true);
  CHECK(f3.y == f.y);
  CHECK(f3.dx == f.dx);
  CHECK(f3.dwg == f.dwg);
  CHECK(f3.dwu == f.dwu);
  CHECK(f3.dwdn == f.dwdn);
  CHECK(f3.dwr == f.dwr);
  CHECK(f3.dwd == f.dwd);
  CHECK(f3.dnw == f.dnw);
  CHECK(f3.dwup == f.dwup);
  CHECK(f3.dwsg == f.dwsg);
  // bfloat16 storage: compare with float64 on the bfloat16-rounded inputs.
  layer Lb = L;
  for (vec* v : {&Lb.x, &Lb.wr, &Lb.bias, &Lb.wd, &Lb.wg, &Lb.wu, &Lb.wdn, &Lb.nw, &Lb.wup, &Lb.wsg, &Lb.wsu, &Lb.wsd})
    *v = widen(cast<k3::bfloat16>(*v));
  vec const dyb = widen(cast<k3::bfloat16>(dy));
  auto const refb = brute(Lb, o, &dyb);
  auto const b = run<k3::bfloat16>(k3::cpu::threads<>(2), Lb, o, &dyb);
  check_all(b, refb, 2e-2, 2e-2, true);
}

TEST_CASE("latent_moe: ties go to the lower expert, p = 0 experts keep their id and gradient, idle experts get zero gradients") {
  dims const m{3, 4, 6, 3, 2, 0, 0, 4};
  layer L = random_layer(m, 23);
  std::fill(L.wr.begin(), L.wr.end(), 0.0);  // every score 0.5: routing decided by bias and index
  std::fill(L.bias.begin(), L.bias.end(), 0.0);
  L.bias[5] = 0.25;
  vec const dy = k3::test::gaussian(static_cast<std::size_t>(m.T * m.d), 24);
  moe::latent_moe_options o;
  o.k = m.k;
  auto const got = run<double>(k3::cpu::serial{}, L, o, &dy, false);
  for (index_t t = 0; t < m.T; ++t) {
    CHECK(got.idx[t * 4 + 0] == 5);
    CHECK(got.idx[t * 4 + 1] == 0);
    CHECK(got.idx[t * 4 + 2] == 1);
    CHECK(got.idx[t * 4 + 3] == 2);
  }
  auto const ref = brute(L, o, &dy);
  check_all(got, ref, 1e-12, 1e-12, false);
  CHECK(rel(got.dwg, ref.dwg) < 1e-12);
  CHECK(rel(got.dwr, ref.dwr) < 1e-12);
  // Expert 4 gets no token: its weight gradients are zero.
  for (index_t i = 0; i < m.f * m.l; ++i) CHECK(got.dwg[4 * m.f * m.l + i] == 0.0);
  // A selected expert whose score is 0 (logit -inf-like): p = 0 but it keeps its id and dp.
  layer Z = random_layer(dims{2, 3, 4, 3, 2, 0, 0, 4}, 31);
  for (index_t i = 0; i < 3; ++i) Z.wr[2 * 3 + i] = (Z.x[i] > 0 ? -1.0 : 1.0) * 2000.0;  // token 0: s_2 underflows to 0
  vec const dz = k3::test::gaussian(6, 32);
  moe::latent_moe_options o4;
  o4.k = 4;
  auto const zr = run<double>(k3::cpu::serial{}, Z, o4, &dz, false);
  auto const zref = brute(Z, o4, &dz);
  CHECK(zr.idx == zref.idx);
  CHECK(std::find(zr.idx.begin(), zr.idx.begin() + 4, 2) != zr.idx.begin() + 4);
  CHECK(rel(zr.dwdn, zref.dwdn) < 1e-12);
  CHECK(rel(zr.dx, zref.dx) < 1e-12);
}

TEST_CASE("latent_moe: shape mismatches, k > n, NaN in x and bad options are k3::errors naming the argument") {
  dims const m{2, 3, 4, 3, 2, 0, 0, 2};
  layer L = random_layer(m, 41);
  moe::latent_moe_options o;
  o.k = 2;
  auto err = [&](layer const& P, moe::latent_moe_options const& oo) {
    return k3::test::error_of([&] { run<double>(k3::cpu::serial{}, P, oo, nullptr, false); });
  };
  CHECK(err(L, o).empty());
  moe::latent_moe_options big = o;
  big.k = 5;
  CHECK(err(L, big).find("option 'k': expected 1 <= k <= n = 4 experts, got 5") != std::string::npos);
  moe::latent_moe_options bad_eps = o;
  bad_eps.eps = 0;
  CHECK(err(L, bad_eps).find("option 'eps'") != std::string::npos);
  layer N = L;
  N.x[4] = NAN;
  CHECK(err(N, o).find("argument 'x': non-finite value at [1, 1] (token 1)") != std::string::npos);
  std::vector<double> x(6), wr(12), wd(9), wg(24), wu(24), wdn(24), wup(9), y(6);
  moe::latent_moe_args<double> a{{x.data(), {2, 3}}, {wr.data(), {4, 3}}, {}, {wd.data(), {3, 3}}, {wg.data(), {4, 2, 3}}, {wu.data(), {4, 2, 3}},
                                 {wdn.data(), {4, 3, 2}}, {}, {wup.data(), {3, 3}}};
  a.y = {y.data(), {2, 3}};
  CHECK(k3::test::error_of([&] { moe::latent_moe_forward(k3::cpu::serial{}, a, o); }).empty());
  a.we_down = {wdn.data(), {4, 2, 3}};
  CHECK(k3::test::error_of([&] { moe::latent_moe_forward(k3::cpu::serial{}, a, o); }).find("argument 'we_down': expected shape [4, 3, 2]") !=
        std::string::npos);
  a.we_down = {wdn.data(), {4, 3, 2}};
  a.ws_gate = {wg.data(), {1, 2, 3}};
  CHECK(k3::test::error_of([&] { moe::latent_moe_forward(k3::cpu::serial{}, a, o); }).find("all three or none") != std::string::npos);
}

TEST_CASE("latent_moe saved state: 2·k·l values per token fewer than the naive layer, other shapes or options are an error") {
  dims const m{7, 5, 6, 4, 3, 1, 3, 3};
  layer const L = random_layer(m, 61);
  auto x = L.x, wr = L.wr, wd = L.wd, wg = L.wg, wu = L.wu, wdn = L.wdn, wup = L.wup, dy = L.x, dx = L.x;
  moe::latent_moe_args<double> a{{x.data(), {m.T, m.d}},       {wr.data(), {m.n, m.d}},       {}, {wd.data(), {m.l, m.d}},
                                 {wg.data(), {m.n, m.f, m.l}}, {wu.data(), {m.n, m.f, m.l}}, {wdn.data(), {m.n, m.l, m.f}},
                                 {},                           {wup.data(), {m.d, m.l}}};
  moe::latent_moe_saved<double> saved;
  CHECK(!saved.filled());
  a.saved = &saved;
  moe::latent_moe_options o;
  o.k = m.k;
  moe::latent_moe_forward(k3::cpu::serial{}, a, o);
  REQUIRE(saved.filled());
  // z, h_g and h_u of every slot and the normalised u, plus the routing (T·k ids, p, scores; T sums).
  std::size_t const values = static_cast<std::size_t>(m.T * m.l + 2 * m.T * m.k * m.f + m.T * m.l);
  CHECK(saved.bytes() >= values * sizeof(double));
  CHECK(saved.bytes() < values * sizeof(double) + static_cast<std::size_t>(m.T * m.k) * 40 + static_cast<std::size_t>(m.T + m.n + 1) * 24);
  CHECK(saved.naive_bytes() - saved.bytes() == static_cast<std::size_t>(2 * m.T * m.k * m.l) * sizeof(double));
  moe::latent_moe_gradients<double> g{{dy.data(), {m.T, m.d}}, {dx.data(), {m.T, m.d}}};
  moe::latent_moe_options other = o;
  other.scale = 2.0;
  CHECK(k3::test::error_of([&] { moe::latent_moe_backward(k3::cpu::serial{}, moe::latent_moe_backward_args<double>{a, g}, other); }).find("argument 'saved'") != std::string::npos);
  moe::latent_moe_args<double> shorter = a;
  shorter.x = {x.data(), {m.T - 1, m.d}};
  g.dy = {dy.data(), {m.T - 1, m.d}};
  g.dx = {dx.data(), {m.T - 1, m.d}};
  CHECK(k3::test::error_of([&] { moe::latent_moe_backward(k3::cpu::serial{}, moe::latent_moe_backward_args<double>{shorter, g}, o); }).find("argument 'saved'") != std::string::npos);
  saved.clear();
  CHECK(!saved.filled());
  CHECK(k3::test::error_of([&] { moe::latent_moe_backward(k3::cpu::serial{}, moe::latent_moe_backward_args<double>{shorter, g}, o); }).empty());
  CHECK(saved.filled());
}

TEST_CASE("latent_moe: NaN or Inf in a weight the step reads, in float, double and bfloat16, is an error naming it, an idle expert's weights are not read") {
  dims const m{3, 4, 5, 3, 2, 1, 2, 2};
  layer L = random_layer(m, 71);
  moe::latent_moe_options o;
  o.k = m.k;
  auto const clean = run<double>(k3::cpu::serial{}, L, o, nullptr);
  index_t const used = clean.idx[0];
  for (int which = 0; which < 5; ++which) {
    layer N = L;
    std::size_t const fl = static_cast<std::size_t>(m.f * m.l);
    vec* v = which == 0 ? &N.wg : which == 1 ? &N.wdn : which == 2 ? &N.wu : which == 3 ? &N.wup : &N.wsd;
    std::size_t const at = which <= 2 ? static_cast<std::size_t>(used) * fl + fl - 1 : v->size() - 1;
    (*v)[at] = which % 2 ? INFINITY : NAN;
    std::string const name = which == 0   ? "argument 'we_gate': non-finite value at [" + std::to_string(used) + ", 1, 2]"
                             : which == 1 ? "argument 'we_down': non-finite value at [" + std::to_string(used) + ", 2, 1]"
                             : which == 2 ? "argument 'we_up': non-finite value at [" + std::to_string(used) + ", 1, 2]"
                             : which == 3 ? "argument 'w_up'"
                                          : "argument 'ws_down'";
    CAPTURE(name);
    CHECK(k3::test::error_of([&] { run<double>(k3::cpu::serial{}, N, o, nullptr); }).find(name) != std::string::npos);
    CHECK(k3::test::error_of([&] { run<float>(k3::cpu::threads<>(2), N, o, nullptr); }).find(name) != std::string::npos);
    CHECK(k3::test::error_of([&] { run<k3::bfloat16>(k3::cpu::threads<>(2), N, o, nullptr); }).find(name) != std::string::npos);
    vec const dy = k3::test::gaussian(static_cast<std::size_t>(m.T * m.d), 72);
    CHECK(k3::test::error_of([&] { run<float>(k3::cpu::serial{}, N, o, &dy, true, true); }).find(name) != std::string::npos);
  }
  CHECK(k3::test::error_of([&] { run<k3::bfloat16>(k3::cpu::serial{}, L, o, nullptr); }).empty());
  // Expert 0 made idle by its bias: a NaN in its weights is never read.
  layer I = L;
  I.bias[0] = -100;
  auto const idle = run<double>(k3::cpu::serial{}, I, o, nullptr);
  CHECK(std::find(idle.idx.begin(), idle.idx.end(), index_t(0)) == idle.idx.end());
  I.wg[0] = NAN;
  I.wdn[1] = NAN;
  CHECK(run<double>(k3::cpu::serial{}, I, o, nullptr).y == idle.y);
}
