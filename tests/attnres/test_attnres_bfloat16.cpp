// bfloat16 storage in AttnRes, checked tightly. The reference is float64 fed the SAME
// bfloat16 values the library sees (sources, running sums as stored, dh), so the only
// differences left are
//   - the rounding of a bfloat16 output: |fl(x) - x| <= u |x| per element, u = 2^-8, hence
//     rms(err) / rms(ref) <= u (fla's relative-RMS metric) for h and for bf16 gradients;
//   - fp32 mixing (spec §2.1: K3 mixes in fp32): a few ulps of float per operation, summed over
//     d and the m sources: relative ~ (d + m) 2^-24, i.e. < 1e-5 for the sizes here (float
//     gradients, which are not rounded to bfloat16).
// test_attnres_driver.cpp compares bfloat16 drivers with a float64 driver fed unrounded inputs
// through a nonlinear stack (tolerance 0.3 on gradients); here the stack is open loop (sublayer outputs
// and input gradients are fixed data), so every rounding the reference does not share would
// show up at 1e-5.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "k3/attnres.hpp"
#include "support/metrics.hpp"

namespace ar = k3::attnres;
using k3::bfloat16;
using k3::index_t;
using k3::test::rel_rms;

namespace {

constexpr double u_bf16 = 1.0 / 256;  // unit roundoff of bfloat16 (8 significant bits)

double bf(double x) { return double(float(bfloat16(float(x)))); }

std::vector<double> randn(std::mt19937_64& gen, std::size_t n, double s, bool round_bf16) {
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> v(n);
  for (auto& x : v) x = round_bf16 ? bf(s * nd(gen)) : double(float(s * nd(gen)));
  return v;
}

// One token's mix in float64 (spec §2.1) and its backward (spec §5.2).
struct mix64 {
  std::vector<double> r, c, alpha, h;
};
mix64 mix_fwd(std::vector<std::vector<double>> const& V, std::vector<double> const& u, double eps) {
  std::size_t const m = V.size(), d = u.size();
  mix64 o;
  o.r.resize(m), o.c.resize(m), o.alpha.resize(m), o.h.assign(d, 0);
  std::vector<double> s(m);
  for (std::size_t j = 0; j < m; ++j) {
    double ss = 0, c = 0;
    for (std::size_t k = 0; k < d; ++k) ss += V[j][k] * V[j][k], c += u[k] * V[j][k];
    o.r[j] = 1 / std::sqrt(ss / double(d) + eps);
    o.c[j] = c;
    s[j] = o.r[j] * c;
  }
  double const mx = *std::max_element(s.begin(), s.end());
  double z = 0;
  for (std::size_t j = 0; j < m; ++j) z += std::exp(s[j] - mx);
  for (std::size_t j = 0; j < m; ++j) o.alpha[j] = std::exp(s[j] - mx) / z;
  for (std::size_t k = 0; k < d; ++k)
    for (std::size_t j = 0; j < m; ++j) o.h[k] += o.alpha[j] * V[j][k];
  return o;
}
// dV (added into), du (added into)
void mix_bwd(std::vector<std::vector<double>> const& V, std::vector<double> const& u, double eps, std::vector<double> const& dh,
             std::vector<std::vector<double>>& dV, std::vector<double>& du) {
  auto f = mix_fwd(V, u, eps);
  std::size_t const m = V.size(), d = u.size();
  double dhh = 0;
  for (std::size_t k = 0; k < d; ++k) dhh += dh[k] * f.h[k];
  for (std::size_t j = 0; j < m; ++j) {
    double a = 0;
    for (std::size_t k = 0; k < d; ++k) a += dh[k] * V[j][k];
    double const ds = f.alpha[j] * (a - dhh);
    for (std::size_t k = 0; k < d; ++k) {
      dV[j][k] += f.alpha[j] * dh[k] + ds * (f.r[j] * u[k] - f.c[j] * f.r[j] * f.r[j] * f.r[j] * V[j][k] / double(d));
      du[k] += ds * f.r[j] * V[j][k];
    }
  }
}

// ---- one mixing site -------------------------------------------------------------------------

struct site_case {
  index_t n, T, d;
  bool partial;
  double scale;  // source magnitude
};

// bfloat16 sources, h stored as H, dh given as DH, gradients stored as G.
template <class H, class DH, class G, class Bk>
void check_site(site_case const& sc, Bk const& be, std::uint64_t seed, double h_tol, double g_tol) {
  index_t const n = sc.n, T = sc.T, d = sc.d, m = n + (sc.partial ? 1 : 0);
  std::mt19937_64 gen(seed);
  auto bank64 = randn(gen, std::size_t(n * T * d), sc.scale, true), part64 = randn(gen, std::size_t(T * d), sc.scale, true);
  auto w64 = randn(gen, std::size_t(d), 1.0, false), g64 = randn(gen, std::size_t(d), 0.3, false);
  for (auto& x : g64) x = double(float(x + 1));
  auto dh64 = randn(gen, std::size_t(T * d), 1.0, std::is_same_v<DH, bfloat16>);
  std::vector<bfloat16> bank(bank64.size()), part(part64.size());
  for (std::size_t i = 0; i < bank.size(); ++i) bank[i] = bfloat16(float(bank64[i]));
  for (std::size_t i = 0; i < part.size(); ++i) part[i] = bfloat16(float(part64[i]));
  std::vector<float> w(w64.begin(), w64.end()), g(g64.begin(), g64.end());
  std::vector<DH> dh(dh64.size());
  for (std::size_t i = 0; i < dh.size(); ++i) dh[i] = DH(float(dh64[i]));
  auto bv = k3::tensor_view<bfloat16 const, 3>(bank.data(), {n, T, d});
  auto pv = k3::tensor_view<bfloat16 const, 2>(part.data(), {T, d});
  auto src = sc.partial ? ar::make_sources(bv, pv) : ar::make_sources(bv);
  auto wv = k3::tensor_view<float const, 1>(w.data(), {d}), gv = k3::tensor_view<float const, 1>(g.data(), {d});
  std::vector<H> h(std::size_t(T * d));
  ar::options opt;
  ar::mix_forward(be, ar::mix_forward_args<bfloat16, float, H>{.sources = src, .w = wv, .gain = gv, .h = k3::host_view(h.data(), T, d)}, opt);
  std::vector<G> dbank(bank.size()), dpart(part.size());
  std::vector<float> dw(static_cast<std::size_t>(d)), dg(static_cast<std::size_t>(d));
  auto grads = sc.partial ? ar::make_grads(k3::host_view(dbank.data(), n, T, d), k3::host_view(dpart.data(), T, d))
                          : ar::make_grads(k3::host_view(dbank.data(), n, T, d));
  ar::mix_backward(be,
                   ar::mix_backward_args<bfloat16, float, DH, G, float>{.sources = src,
                                                                        .w = wv,
                                                                        .gain = gv,
                                                                        .d_h = k3::tensor_view<DH const, 2>(dh.data(), {T, d}),
                                                                        .d_sources = grads,
                                                                        .d_w = k3::host_view(dw.data(), d),
                                                                        .d_gain = k3::host_view(dg.data(), d)},
                   opt);

  // float64 reference on the same values
  std::vector<double> u(static_cast<std::size_t>(d));
  for (index_t k = 0; k < d; ++k) u[std::size_t(k)] = double(w[std::size_t(k)]) * double(g[std::size_t(k)]);
  std::vector<double> h_ref(h.size()), h_got(h.size()), dsrc_ref, dsrc_got, du(std::size_t(d), 0.0);
  std::vector<double> db_ref(bank.size(), 0.0), dp_ref(part.size(), 0.0);
  double worst_elem = 0;  // max over elements of |err| / (u |ref| + 1e-5 max|source|)
  for (index_t t = 0; t < T; ++t) {
    std::vector<std::vector<double>> V(static_cast<std::size_t>(m), std::vector<double>(static_cast<std::size_t>(d)));
    double vmax = 0;
    for (index_t j = 0; j < m; ++j)
      for (index_t k = 0; k < d; ++k) {
        double const x = j < n ? bank64[std::size_t((j * T + t) * d + k)] : part64[std::size_t(t * d + k)];
        V[std::size_t(j)][std::size_t(k)] = x;
        vmax = std::max(vmax, std::abs(x));
      }
    auto f = mix_fwd(V, u, opt.eps);
    std::vector<double> dht(dh64.begin() + t * d, dh64.begin() + (t + 1) * d);
    std::vector<std::vector<double>> dV(std::size_t(m), std::vector<double>(std::size_t(d), 0.0));
    mix_bwd(V, u, opt.eps, dht, dV, du);
    for (index_t k = 0; k < d; ++k) {
      double const got = double(float(h[std::size_t(t * d + k)])), want = f.h[std::size_t(k)];
      h_ref[std::size_t(t * d + k)] = want;
      h_got[std::size_t(t * d + k)] = got;
      double const bound = (std::is_same_v<H, bfloat16> ? u_bf16 * std::abs(want) : 0.0) + 1e-5 * vmax;
      worst_elem = std::max(worst_elem, std::abs(got - want) / bound);
      for (index_t j = 0; j < m; ++j)
        (j < n ? db_ref[std::size_t((j * T + t) * d + k)] : dp_ref[std::size_t(t * d + k)]) = dV[std::size_t(j)][std::size_t(k)];
    }
  }
  std::vector<double> gotb, gotp, dwr(static_cast<std::size_t>(d)), dgr(static_cast<std::size_t>(d)), dwg(dw.begin(), dw.end()), dgg(dg.begin(), dg.end());
  for (auto x : dbank) gotb.push_back(double(float(x)));
  for (auto x : dpart) gotp.push_back(double(float(x)));
  for (index_t k = 0; k < d; ++k) {
    dwr[std::size_t(k)] = du[std::size_t(k)] * double(g[std::size_t(k)]);
    dgr[std::size_t(k)] = du[std::size_t(k)] * double(w[std::size_t(k)]);
  }
  CAPTURE(n);
  CAPTURE(T);
  CAPTURE(d);
  CAPTURE(sc.partial);
  CAPTURE(sc.scale);
  CHECK(worst_elem <= 1.0);
  CHECK(rel_rms(h_got, h_ref) <= h_tol);
  CHECK(rel_rms(gotb, db_ref) <= g_tol);
  if (sc.partial) CHECK(rel_rms(gotp, dp_ref) <= g_tol);
  CHECK(rel_rms(dwg, dwr) <= 1e-5);  // dw, dg: float outputs summed in double
  CHECK(rel_rms(dgg, dgr) <= 1e-5);
}

site_case const site_cases[] = {{1, 5, 7, true, 1.0}, {3, 4, 33, true, 1.0}, {8, 3, 64, true, 3.0}, {2, 17, 16, false, 0.05},
                                {1, 2, 1, false, 1.0}, {5, 9, 100, false, 10.0}};

}  // namespace

TEST_CASE("one bfloat16 mixing site vs float64 on the same bfloat16 values: h within u = 2^-8, float gradients within 1e-5") {
  std::uint64_t seed = 1;
  for (auto const& sc : site_cases) {
    // h in bf16 (rounded once: <= u), gradients in float (fp32 only), dh float or bf16
    check_site<bfloat16, float, float>(sc, k3::cpu::serial{}, seed, u_bf16, 1e-5);
    check_site<bfloat16, bfloat16, float>(sc, k3::cpu::simd<>{}, seed + 1, u_bf16, 1e-5);
    check_site<bfloat16, float, float>(sc, k3::cpu::threads<>(2), seed + 2, u_bf16, 1e-5);
    // h in float: fp32 only
    check_site<float, float, float>(sc, k3::cpu::serial{}, seed + 3, 1e-5, 1e-5);
    // gradients stored in bfloat16: each rounded once (<= u)
    check_site<bfloat16, float, bfloat16>(sc, k3::cpu::simd<>{}, seed + 4, u_bf16, u_bf16);
    seed += 5;
  }
}

// ---- the Block / Full AttnRes driver, open loop ---------------------------------------------

namespace {

struct stack {
  index_t L, S, T, d;
  bool skip;
  double eps = 1e-5;
  std::vector<double> w, g, emb, dout;       // float values (w, g), bf16 values (emb), float (dout)
  std::vector<std::vector<double>> y, dx;    // per sublayer: its output (bf16 values), the input gradient fed back (float)
  stack(index_t L_, index_t S_, index_t T_, index_t d_, bool skip_, std::uint64_t seed) : L(L_), S(S_), T(T_), d(d_), skip(skip_) {
    std::mt19937_64 gen(seed);
    w = randn(gen, std::size_t((L + 1) * d), 1.0, false);
    g = randn(gen, std::size_t((L + 1) * d), 0.3, false);
    for (auto& x : g) x = double(float(x + 1));
    emb = randn(gen, std::size_t(T * d), 1.0, true);
    dout = randn(gen, std::size_t(T * d), 1.0, false);
    for (index_t l = 0; l < L; ++l) {
      y.push_back(randn(gen, std::size_t(T * d), 0.7, true));
      dx.push_back(randn(gen, std::size_t(T * d), 1.0, false));
    }
  }
};

struct stack_result {
  std::vector<std::vector<double>> h;   // every site's input (L + 1)
  std::vector<std::vector<double>> dy;  // gradient of every sublayer output (L)
  std::vector<double> demb, dw, dg;
};

// float64 Eq. 6 over the stored values: running sums rounded to bfloat16 after every add, as the
// driver stores them (the sum itself in fp32, exact here for two bfloat16 addends of similar size).
stack_result reference(stack const& p) {
  index_t const L = p.L, S = p.S, T = p.T, d = p.d;
  std::vector<std::vector<double>> rows = {p.emb};   // bank rows as stored
  std::vector<std::vector<double>> partials(std::size_t(L + 1));  // partial sum entering site l (when partial_at(l))
  std::vector<double> run = p.emb;
  bool fresh = false;
  stack_result r;
  // sources of site l: rows 0..l/S, plus partial when l % S != 0
  auto sources_of = [&](index_t l) {
    std::vector<std::vector<double> const*> v;
    for (index_t j = 0; j <= l / S; ++j) v.push_back(&rows[std::size_t(j)]);
    if (l % S != 0) v.push_back(&partials[std::size_t(l)]);
    return v;
  };
  auto uq = [&](index_t l) {
    std::vector<double> u(static_cast<std::size_t>(d));
    for (index_t k = 0; k < d; ++k) u[std::size_t(k)] = double(float(p.w[std::size_t(l * d + k)])) * double(float(p.g[std::size_t(l * d + k)]));
    return u;
  };
  for (index_t l = 0; l <= L; ++l) {
    if (l % S == 0) {  // close the block: push it (row 0, the embedding, is there already)
      if (l > 0) rows.push_back(run);
      fresh = true;
    }
    if (l % S != 0) partials[std::size_t(l)] = run;
    std::vector<double> h(std::size_t(T * d));
    if (p.skip && l == 0) {
      h = p.emb;
    } else {
      auto src = sources_of(l);
      for (index_t t = 0; t < T; ++t) {
        std::vector<std::vector<double>> V;
        for (auto const* s : src) V.emplace_back(s->begin() + t * d, s->begin() + (t + 1) * d);
        auto f = mix_fwd(V, uq(l), p.eps);
        std::copy(f.h.begin(), f.h.end(), h.begin() + t * d);
      }
    }
    r.h.push_back(h);
    if (l == L) break;
    for (index_t i = 0; i < T * d; ++i)
      run[std::size_t(i)] = fresh ? p.y[std::size_t(l)][std::size_t(i)] : bf(double(float(run[std::size_t(i)]) + float(p.y[std::size_t(l)][std::size_t(i)])));
    fresh = false;
  }
  // backward: d(row j), d(partial at l); loss = sum_l <dx_l, h_l> + <dout, h_L>
  std::vector<std::vector<double>> drow(rows.size(), std::vector<double>(std::size_t(T * d), 0.0)),
      dpart(std::size_t(L + 1), std::vector<double>(std::size_t(T * d), 0.0));
  r.dw.assign(std::size_t((L + 1) * d), 0.0);
  r.dg = r.dw;
  for (index_t l = 0; l <= L; ++l) {
    auto const& dh = l == L ? p.dout : p.dx[std::size_t(l)];
    if (p.skip && l == 0) {
      for (index_t i = 0; i < T * d; ++i) drow[0][std::size_t(i)] += dh[std::size_t(i)];
      continue;
    }
    auto src = sources_of(l);
    auto u = uq(l);
    std::vector<double> du(std::size_t(d), 0.0);
    for (index_t t = 0; t < T; ++t) {
      std::vector<std::vector<double>> V, dV(src.size(), std::vector<double>(std::size_t(d), 0.0));
      for (auto const* s : src) V.emplace_back(s->begin() + t * d, s->begin() + (t + 1) * d);
      mix_bwd(V, u, p.eps, std::vector<double>(dh.begin() + t * d, dh.begin() + (t + 1) * d), dV, du);
      for (std::size_t j = 0; j < src.size(); ++j) {
        auto& dst = (l % S != 0 && j + 1 == src.size()) ? dpart[std::size_t(l)] : drow[j];
        for (index_t k = 0; k < d; ++k) dst[std::size_t(t * d + k)] += dV[j][std::size_t(k)];
      }
    }
    for (index_t k = 0; k < d; ++k) {
      r.dw[std::size_t(l * d + k)] = du[std::size_t(k)] * double(float(p.g[std::size_t(l * d + k)]));
      r.dg[std::size_t(l * d + k)] = du[std::size_t(k)] * double(float(p.w[std::size_t(l * d + k)]));
    }
  }
  // y_j lies in the bank row of its block (when that row was pushed) and in the partial of
  // every later site of its block
  r.dy.assign(std::size_t(L), std::vector<double>(std::size_t(T * d), 0.0));
  for (index_t j = 0; j < L; ++j) {
    index_t const blk = j / S + 1;  // its bank row
    auto& dyj = r.dy[std::size_t(j)];
    if (blk < index_t(rows.size()))
      for (index_t i = 0; i < T * d; ++i) dyj[std::size_t(i)] += drow[std::size_t(blk)][std::size_t(i)];
    for (index_t l = j + 1; l <= L && l < (j / S + 1) * S; ++l)
      for (index_t i = 0; i < T * d; ++i) dyj[std::size_t(i)] += dpart[std::size_t(l)][std::size_t(i)];
  }
  r.demb = drow[0];
  return r;
}

template <class Bk>
stack_result run_driver(stack const& p, ar::mode m, Bk const& be) {
  index_t const T = p.T, d = p.d;
  ar::block_config cfg;
  cfg.d = d;
  cfg.tokens = T;
  cfg.sublayers = p.L;
  cfg.block_sublayers = p.S;
  cfg.skip_first_mix = p.skip;
  cfg.eps = p.eps;
  cfg.run_mode = m;
  std::vector<float> w(p.w.begin(), p.w.end()), g(p.g.begin(), p.g.end());
  ar::block_attn_res<bfloat16, Bk> a(cfg, k3::tensor_view<float const, 2>(w.data(), {p.L + 1, d}), k3::tensor_view<float const, 2>(g.data(), {p.L + 1, d}),
                                      be);
  auto tob = [](std::vector<double> const& v) {
    std::vector<bfloat16> o(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) o[i] = bfloat16(float(v[i]));
    return o;
  };
  auto back = [](auto const* x, std::size_t n) {
    std::vector<double> o(n);
    for (std::size_t i = 0; i < n; ++i) o[i] = double(float(x[i]));
    return o;
  };
  stack_result r;
  auto e = tob(p.emb);
  std::vector<bfloat16> x(std::size_t(T * d));
  a.begin(k3::host_view(e.data(), T, d));
  for (index_t l = 0; l <= p.L; ++l) {
    if (l == p.L) a.output(k3::host_view(x.data(), T, d));
    else a.input(k3::host_view(x.data(), T, d));
    r.h.push_back(back(x.data(), x.size()));
    if (l == p.L) break;
    auto y = tob(p.y[std::size_t(l)]);
    a.add(k3::host_view(y.data(), T, d));
  }
  if (m != ar::mode::train_stored && m != ar::mode::train_recompute) return r;
  a.backward_begin();
  std::vector<float> dv(p.dout.begin(), p.dout.end());
  a.backward_site(k3::host_view(dv.data(), T, d));
  r.dy.resize(std::size_t(p.L));
  for (index_t l = p.L - 1; l >= 0; --l) {
    r.dy[std::size_t(l)] = back(a.grad_sublayer_output().data_handle(), std::size_t(T * d));
    std::vector<float> dxl(p.dx[std::size_t(l)].begin(), p.dx[std::size_t(l)].end());
    a.backward_site(k3::host_view(dxl.data(), T, d));
  }
  r.demb = back(a.grad_embedding().data_handle(), std::size_t(T * d));
  r.dw = back(a.grad_w().data_handle(), std::size_t((p.L + 1) * d));
  r.dg = back(a.grad_gain().data_handle(), std::size_t((p.L + 1) * d));
  return r;
}

std::vector<double> flat(std::vector<std::vector<double>> const& v) {
  std::vector<double> o;
  for (auto const& x : v) o.insert(o.end(), x.begin(), x.end());
  return o;
}

// max over sites and elements of |got - ref| / (u |ref| + 1e-5 max|ref row|)
double worst_h(std::vector<std::vector<double>> const& got, std::vector<std::vector<double>> const& ref, index_t d) {
  double w = 0;
  for (std::size_t l = 0; l < ref.size(); ++l)
    for (std::size_t t = 0; t * std::size_t(d) < ref[l].size(); ++t) {
      double mx = 0;
      for (index_t k = 0; k < d; ++k) mx = std::max(mx, std::abs(ref[l][t * std::size_t(d) + std::size_t(k)]));
      for (index_t k = 0; k < d; ++k) {
        std::size_t const i = t * std::size_t(d) + std::size_t(k);
        w = std::max(w, std::abs(got[l][i] - ref[l][i]) / (u_bf16 * std::abs(ref[l][i]) + 1e-5 * mx + 1e-30));
      }
    }
  return w;
}

}  // namespace

TEST_CASE("bfloat16 Block/Full AttnRes driver vs float64 Eq. 6 on the stored values: inputs within u, gradients within 1e-5, every mode") {
  struct ly {
    index_t L, S, T, d;
    bool skip;
  };
  for (auto const& c : {ly{7, 3, 3, 37, true}, ly{6, 1, 2, 16, false}, ly{5, 8, 2, 33, true}, ly{9, 4, 4, 64, false}, ly{4, 2, 1, 5, true},
                        ly{12, 1, 2, 9, true}}) {
    stack p(c.L, c.S, c.T, c.d, c.skip, std::uint64_t(40 + c.L * 3 + c.S));
    CAPTURE(c.L);
    CAPTURE(c.S);
    CAPTURE(c.d);
    auto ref = reference(p);
    auto check_all = [&](auto const& be, char const* bname) {
      CAPTURE(bname);
      stack_result res[4];
      int i = 0;
      for (ar::mode m : {ar::mode::one_pass, ar::mode::two_phase, ar::mode::train_stored, ar::mode::train_recompute}) {
        CAPTURE(int(m));
        auto got = run_driver(p, m, be);
        CHECK(worst_h(got.h, ref.h, c.d) <= 1.0);
        CHECK(rel_rms(flat(got.h), flat(ref.h)) <= u_bf16);
        if (m == ar::mode::train_stored || m == ar::mode::train_recompute) {
          CHECK(rel_rms(flat(got.dy), flat(ref.dy)) <= 1e-5);
          CHECK(rel_rms(got.demb, ref.demb) <= 1e-5);
          CHECK(rel_rms(got.dw, ref.dw) <= 1e-5);
          CHECK(rel_rms(got.dg, ref.dg) <= 1e-5);
        }
        res[i++] = got;
      }
      // training modes mix exactly like one_pass; recompute gives the stored gradients bit for bit
      CHECK(res[2].h == res[0].h);
      CHECK(res[3].h == res[0].h);
      CHECK(res[2].dy == res[3].dy);
      CHECK(res[2].dw == res[3].dw);
      CHECK(res[2].dg == res[3].dg);
      CHECK(res[2].demb == res[3].demb);
      // two-phase vs one-pass: each within u of the exact mix, so within 2u of each other
      CHECK(rel_rms(flat(res[1].h), flat(res[0].h)) <= 2 * u_bf16);
    };
    check_all(k3::cpu::serial{}, "serial");
    check_all(k3::cpu::simd<>{}, "simd");
    check_all(k3::cpu::threads<>(2), "threads");
  }
}
