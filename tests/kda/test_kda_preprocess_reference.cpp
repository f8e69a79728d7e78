// Independent checks of KDA's pre-processing ops (k3/kda/preprocess.hpp): l2norm,
// beta_sigmoid, gate_softplus, gate_lower_bound and the short causal conv (prefill, backward,
// decode), each against a float64 reference written here from the spec (spec/kda.md 1.4-1.5,
// the conv's header contract), backwards against complex-step derivatives of that reference.
// Every host backend (serial, simd<>, threads<> with 1..4 threads), float / double / bfloat16
// storage, head dims around the SIMD width, T = 0/1, varlen batches with empty and short
// sequences, padded permuted views (NaN in input padding, output padding untouched), aliasing,
// lower-bound edge values, extreme inputs and NaN/Inf confinement.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "support/error_of.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/kda/preprocess.hpp"
#include "support/complex_step.hpp"
#include "support/strided.hpp"

using namespace k3;
using k3::test::complex_step_derivative;
using k3::test::error_of;
using k3::test::strided;
using cd = std::complex<double>;

namespace {

// ---- float64 references (double or complex<double> for the complex step) -------------------

template <class Z>
Z r_log1p(Z x) {
  if constexpr (std::is_same_v<Z, double>)
    return std::log1p(x);
  else
    return std::log(Z(1) + x);
}
template <class Z>
Z r_sigmoid(Z x) {
  if (std::real(x) >= 0) return Z(1) / (Z(1) + std::exp(-x));
  Z const e = std::exp(x);
  return e / (Z(1) + e);
}
template <class Z>
Z r_softplus(Z x) {  // log(1 + e^x)
  if (std::real(x) > 0) return x + r_log1p(std::exp(-x));
  return r_log1p(std::exp(x));
}
template <class Z>
Z r_silu(Z x) {
  return x * r_sigmoid(x);
}


// ---- helpers -----------------------------------------------------------------------------

template <class S>
double tol() {
  if constexpr (std::is_same_v<S, double>)
    return 1e-12;
  else if constexpr (std::is_same_v<S, float>)
    return 2e-5;
  else
    return 1.6e-2;
}

template <class S>
S nan_s() {
  return store_as<S>(std::numeric_limits<double>::quiet_NaN());
}
template <class S>
S sentinel() {
  return store_as<S>(-777.0);
}

// max |got - ref| / max |ref| (0/0 = 0); non-finite mismatch is infinite.
// With `floor`, the denominator is at least floor (a gradient that cancels to ~0 is measured
// against the scale of its terms).
double rel_err(std::vector<double> const& ref, std::vector<double> const& got, double floor = 0) {
  if (ref.size() != got.size()) return INFINITY;
  double num = 0, den = floor;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::isfinite(ref[i]) != std::isfinite(got[i])) return INFINITY;
    if (!std::isfinite(ref[i])) {
      if (!(std::isnan(ref[i]) && std::isnan(got[i])) && ref[i] != got[i]) return INFINITY;
      continue;
    }
    num = std::max(num, std::fabs(ref[i] - got[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return den == 0 ? (num == 0 ? 0 : INFINITY) : num / den;
}

bool bitwise_same(std::vector<double> const& a, std::vector<double> const& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

std::vector<double> randn(std::size_t n, std::mt19937& rng, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<double> v(n);
  for (auto& e : v) e = nd(rng);
  return v;
}

// Every host backend: serial, simd<>, threads<> with 1..4 threads.
template <class F>
void each_backend(F&& f) {
  f(cpu::serial{}, std::string("serial"));
  f(cpu::simd<>{}, std::string("simd"));
  for (int n = 1; n <= 4; ++n) f(cpu::threads<>(n), "threads(" + std::to_string(n) + ")");
}

// ---- l2norm reference --------------------------------------------------------------------

template <class Z>
void ref_l2_row(Z const* x, Z* y, index_t D) {
  Z ss = 0;
  for (index_t d = 0; d < D; ++d) ss += x[d] * x[d];
  Z const r = Z(1) / std::sqrt(ss + Z(1e-6));
  for (index_t d = 0; d < D; ++d) y[d] = x[d] * r;
}

// y and dx = d(sum dy*y)/dx row by row (complex step).
// Returns the scale of dx's terms, max over rows of max|dy| / sqrt(sum x^2 + eps): dx = rstd (dy - (dy.y) y)
// cancels to ~0 when dy is radial (always for D = 1), and the formula of the spec (fla's) then has
// an error of order eps(T) times that scale.
double ref_l2(std::vector<double> const& x, std::vector<double> const& dy, index_t D, std::vector<double>& y, std::vector<double>& dx) {
  double scale = 0;
  std::size_t const rows = D ? x.size() / std::size_t(D) : 0;
  y.assign(x.size(), 0.0);
  dx.assign(x.size(), 0.0);
  std::vector<cd> zx(static_cast<std::size_t>(D)), zy(static_cast<std::size_t>(D));
  for (std::size_t r = 0; r < rows; ++r) {
    double const* xr = x.data() + r * std::size_t(D);
    ref_l2_row(xr, y.data() + r * std::size_t(D), D);
    double ss = 1e-6, gm = 0;
    for (index_t d = 0; d < D; ++d) ss += xr[d] * xr[d], gm = std::max(gm, std::fabs(dy[r * std::size_t(D) + std::size_t(d)]));
    scale = std::max(scale, gm / std::sqrt(ss));
    for (index_t d = 0; d < D; ++d) zx[std::size_t(d)] = xr[d];
    std::vector<double> const g = k3::test::complex_step_gradient(zx, [&] {
      ref_l2_row(zx.data(), zy.data(), D);
      cd l = 0;
      for (index_t d = 0; d < D; ++d) l += dy[r * std::size_t(D) + std::size_t(d)] * zy[std::size_t(d)];
      return l;
    });
    for (index_t i = 0; i < D; ++i) dx[r * std::size_t(D) + std::size_t(i)] = g[std::size_t(i)];
  }
  return scale;
}

// ---- gate reference ------------------------------------------------------------------------

template <class Z>
Z ref_gate(bool softplus, double lb, Z x, Z a_log, Z bias) {
  Z const u = x + bias;
  if (softplus) return -std::exp(a_log) * r_softplus(u);
  return Z(lb) * r_sigmoid(std::exp(a_log) * u);
}

// ---- conv reference --------------------------------------------------------------------------

struct seq8 {
  index_t b, start, len;
};

// y [B,T,C] and final state [N,C,W-1] of the spec's convolution, per sequence from a padded copy.
template <class Z>
void ref_conv(std::vector<Z> const& x, index_t B, index_t T, index_t C, std::vector<Z> const& w, index_t W,
              std::vector<Z> const& bias, std::vector<seq8> const& seqs, std::vector<Z> const& init, bool silu, std::vector<Z>& y,
              std::vector<Z>& fin) {
  y.assign(std::size_t(B * T * C), Z(0));
  fin.assign(seqs.size() * std::size_t(C * (W - 1)), Z(0));
  for (std::size_t n = 0; n < seqs.size(); ++n) {
    seq8 const s = seqs[n];
    for (index_t c = 0; c < C; ++c) {
      std::vector<Z> e(std::size_t(W - 1 + s.len), Z(0));
      for (index_t i = 0; i < W - 1; ++i) e[std::size_t(i)] = init.empty() ? Z(0) : init[(n * std::size_t(C) + std::size_t(c)) * std::size_t(W - 1) + std::size_t(i)];
      for (index_t i = 0; i < s.len; ++i) e[std::size_t(W - 1 + i)] = x[std::size_t((s.b * T + s.start + i) * C + c)];
      for (index_t i = 0; i < s.len; ++i) {
        Z z = bias.empty() ? Z(0) : bias[std::size_t(c)];
        for (index_t j = 0; j < W; ++j) z += w[std::size_t(c * W + j)] * e[std::size_t(i + j)];
        y[std::size_t((s.b * T + s.start + i) * C + c)] = silu ? r_silu(z) : z;
      }
      for (index_t i = 0; i < W - 1; ++i)
        fin[(n * std::size_t(C) + std::size_t(c)) * std::size_t(W - 1) + std::size_t(i)] = e[std::size_t(s.len + i)];
    }
  }
}

}  // namespace

// =============================================================================================
// l2norm
// =============================================================================================

TEST_CASE_TEMPLATE("l2norm forward/backward: every backend, head dims around the SIMD width, T = 0/1, padded permuted views",
                   S, double, float, bfloat16) {
  std::mt19937 rng(8001);
  for (index_t D : {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129})
    for (index_t T : {0, 1, 3}) {
      CAPTURE(D);
      CAPTURE(T);
      std::array<index_t, 4> const ext{2, T, 3, D};
      strided<S, 4> x(ext, {2, 0, 1}, 3, nan_s<S>()), dy(ext, {1, 2, 0}, 1, nan_s<S>());
      std::size_t const n = std::size_t(2 * T * 3 * D);
      x.set(randn(n, rng, 2.0));
      dy.set(randn(n, rng));
      std::vector<double> yr, dxr;
      double const dx_scale = ref_l2(x.get(), dy.get(), D, yr, dxr);
      std::vector<double> y0, dx0;
      bool first = true;
      each_backend([&](auto const& b, std::string const& name) {
        CAPTURE(name);
        strided<S, 4> y(ext, {0, 2, 1}, 2, sentinel<S>()), dx(ext, {1, 0, 2}, 2, sentinel<S>());
        kda::l2norm(b, kda::l2norm_args<S>{.x = x.view, .y = y.view});
        kda::l2norm_backward(b, kda::l2norm_backward_args<S>{.x = x.view, .d_y = dy.view, .d_x = dx.view});
        CHECK(rel_err(yr, y.get()) <= tol<S>());
        CHECK(rel_err(dxr, dx.get(), dx_scale) <= tol<S>());
        CHECK(y.padding_is(sentinel<S>()));
        CHECK(dx.padding_is(sentinel<S>()));
        if (first) {
          y0 = y.get(), dx0 = dx.get(), first = false;
        } else {
          CHECK(bitwise_same(y0, y.get()));
          CHECK(bitwise_same(dx0, dx.get()));
        }
      });
    }
}

TEST_CASE_TEMPLATE("l2norm: an all-zero row gives y = 0 and dx = dy / sqrt(1e-6)", S, double, float, bfloat16) {
  index_t const D = 17;
  std::vector<S> x(std::size_t(D), store_as<S>(0.0)), y(x.size(), sentinel<S>()), dy(x.size()), dx(x.size());
  std::mt19937 rng(8002);
  auto const g = randn(x.size(), rng);
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = store_as<S>(g[i]);
  each_backend([&](auto const& b, std::string const& name) {
    CAPTURE(name);
    kda::l2norm(b, kda::l2norm_args<S, 2>{.x = host_view(x.data(), 1, D), .y = host_view(y.data(), 1, D)});
    kda::l2norm_backward(b, kda::l2norm_backward_args<S, 2>{.x = host_view(x.data(), 1, D), .d_y = host_view(dy.data(), 1, D), .d_x = host_view(dx.data(), 1, D)});
    for (std::size_t i = 0; i < x.size(); ++i) {
      CHECK(load_as<double>(y[i]) == 0.0);
      CHECK(load_as<double>(dx[i]) == doctest::Approx(load_as<double>(dy[i]) * 1000.0).epsilon(tol<S>()));
    }
  });
}

// |x| so large that sum(dy * x) overflows the compute type, while dx = rstd (dy - (dy.y) y)
// is finite (and tiny): the backward must not turn it into NaN.
TEST_CASE_TEMPLATE("l2norm_backward: huge rows with an ordinary dy stay finite and exact", S, double, float, bfloat16) {
  double const big = std::is_same_v<S, double> ? 1e306 : 1e36;
  for (index_t D : {1, 3, 16, 33}) {
    CAPTURE(D);
    std::mt19937 rng(8003);
    std::vector<S> x(static_cast<std::size_t>(D)), dy(x.size()), dx(x.size(), sentinel<S>());
    auto const xs = randn(x.size(), rng), gs = randn(x.size(), rng);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = store_as<S>(big * (1.5 + std::fabs(xs[i]))), dy[i] = store_as<S>(1e3 * gs[i]);
    // Reference in double on x scaled down by 'big' (the map is 0-homogeneous in x: dx scales by 1/big).
    std::vector<double> xd(x.size()), gd(x.size()), yr, dxr;
    for (std::size_t i = 0; i < x.size(); ++i) xd[i] = load_as<double>(x[i]) / big, gd[i] = load_as<double>(dy[i]);
    // Exact: eps is negligible at this scale, so compute the reference with eps scaled away.
    double ss = 0, gy = 0;
    for (std::size_t i = 0; i < xd.size(); ++i) ss += xd[i] * xd[i];
    double const nrm = std::sqrt(ss);
    for (std::size_t i = 0; i < xd.size(); ++i) gy += gd[i] * xd[i] / nrm;
    dxr.resize(xd.size());
    double gmax = 0;
    for (std::size_t i = 0; i < xd.size(); ++i) dxr[i] = (gd[i] - gy * xd[i] / nrm) / nrm / big, gmax = std::max(gmax, std::fabs(gd[i]));
    each_backend([&](auto const& b, std::string const& name) {
      CAPTURE(name);
      kda::l2norm_backward(b, kda::l2norm_backward_args<S, 2>{.x = host_view(x.data(), 1, D), .d_y = host_view(dy.data(), 1, D),
                                                              .d_x = host_view(dx.data(), 1, D)});
      std::vector<double> got(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) got[i] = load_as<double>(dx[i]);
      for (double v : got) CHECK(std::isfinite(v));
      CHECK(rel_err(dxr, got, gmax / nrm / big) <= (std::is_same_v<S, double> ? 1e-12 : tol<S>() * 4));
    });
  }
}

TEST_CASE("l2norm: NaN and Inf stay in their own row, in-place is refused naming both arguments") {
  index_t const R = 4, D = 5;
  std::vector<float> x(std::size_t(R * D), 0.5f), y(x.size()), dy(x.size(), 1.0f), dx(x.size());
  x[std::size_t(1 * D + 2)] = NAN;
  x[std::size_t(2 * D + 0)] = INFINITY;
  each_backend([&](auto const& b, std::string const& name) {
    CAPTURE(name);
    kda::l2norm(b, kda::l2norm_args<float, 2>{.x = host_view(x.data(), R, D), .y = host_view(y.data(), R, D)});
    kda::l2norm_backward(b, kda::l2norm_backward_args<float, 2>{.x = host_view(x.data(), R, D), .d_y = host_view(dy.data(), R, D),
                                                                .d_x = host_view(dx.data(), R, D)});
    for (index_t r : {0, 3})
      for (index_t d = 0; d < D; ++d) {
        CHECK(std::isfinite(y[std::size_t(r * D + d)]));
        CHECK(std::isfinite(dx[std::size_t(r * D + d)]));
      }
  });
  auto const e = error_of([&] { kda::l2norm(cpu::serial{}, kda::l2norm_args<float, 2>{.x = host_view(x.data(), R, D), .y = host_view(x.data(), R, D)}); });
  CHECK(k3::test::names_overlap(e, "y", "x"));
  auto const e2 = error_of([&] {
    kda::l2norm_backward(cpu::serial{}, kda::l2norm_backward_args<float, 2>{.x = host_view(x.data(), R, D), .d_y = host_view(dy.data(), R, D),
                                                                            .d_x = host_view(dy.data(), R, D)});
  });
  CHECK(k3::test::names_overlap(e2, "d_x", "d_y"));
}

// =============================================================================================
// beta = sigmoid(x) (x2)
// =============================================================================================

TEST_CASE_TEMPLATE("beta_sigmoid forward/backward: every backend, odd H, padded views, both scales", S, double, float, bfloat16) {
  std::mt19937 rng(8011);
  for (index_t H : {1, 3, 15, 16, 17, 33})
    for (index_t T : {0, 1, 5})
      for (bool neg : {false, true}) {
        CAPTURE(H);
        CAPTURE(T);
        CAPTURE(neg);
        std::array<index_t, 3> const ext{2, T, H};
        strided<S, 3> x(ext, {1, 0}, 2, nan_s<S>()), db(ext, {0, 1}, 1, nan_s<S>());
        std::size_t const n = std::size_t(2 * T * H);
        x.set(randn(n, rng, 3.0));
        db.set(randn(n, rng));
        auto const xs = x.get(), gs = db.get();
        std::vector<double> yr(n), dxr(n);
        double const s = neg ? 2.0 : 1.0;
        for (std::size_t i = 0; i < n; ++i) {
          yr[i] = s * r_sigmoid(xs[i]);
          dxr[i] = gs[i] * complex_step_derivative(xs[i], [&](cd z) { return s * r_sigmoid(z); });
        }
        each_backend([&](auto const& b, std::string const& name) {
          CAPTURE(name);
          strided<S, 3> y(ext, {0, 1}, 3, sentinel<S>()), dx(ext, {1, 0}, 1, sentinel<S>());
          kda::beta_sigmoid(b, kda::beta_sigmoid_args<S>{.x = x.view, .beta = y.view}, {.allow_neg_eigval = neg});
          kda::beta_sigmoid_backward(b, kda::beta_sigmoid_backward_args<S>{.x = x.view, .d_beta = db.view, .d_x = dx.view}, {.allow_neg_eigval = neg});
          CHECK(rel_err(yr, y.get()) <= tol<S>());
          CHECK(rel_err(dxr, dx.get()) <= tol<S>());
          CHECK(y.padding_is(sentinel<S>()));
          CHECK(dx.padding_is(sentinel<S>()));
        });
      }
}

TEST_CASE_TEMPLATE("beta_sigmoid: extreme inputs give finite beta in [0, s] and finite, exact gradients", S, double, float, bfloat16) {
  double const mx = load_as<double>(store_as<S>(std::is_same_v<S, double> ? 1e308 : 3e38));
  std::vector<double> xs = {-mx, -1e30, -1e4, -104, -100, -88, -30, -1e-30, 0, 1e-30, 30, 88, 100, 104, 1e4, 1e30, mx};
  index_t const n = index_t(xs.size());
  std::vector<S> x(xs.size()), y(xs.size()), g(xs.size(), store_as<S>(1.0)), dx(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) x[i] = store_as<S>(xs[i]), xs[i] = load_as<double>(x[i]);
  for (bool neg : {false, true}) {
    double const s = neg ? 2.0 : 1.0;
    each_backend([&](auto const& b, std::string const& name) {
      CAPTURE(name);
      kda::beta_sigmoid(b, kda::beta_sigmoid_args<S, 1>{.x = host_view(x.data(), n), .beta = host_view(y.data(), n)}, {.allow_neg_eigval = neg});
      kda::beta_sigmoid_backward(
          b, kda::beta_sigmoid_backward_args<S, 1>{.x = host_view(x.data(), n), .d_beta = host_view(g.data(), n), .d_x = host_view(dx.data(), n)},
          {.allow_neg_eigval = neg});
      for (std::size_t i = 0; i < xs.size(); ++i) {
        CAPTURE(xs[i]);
        double const yv = load_as<double>(y[i]), dv = load_as<double>(dx[i]);
        REQUIRE(std::isfinite(yv));
        REQUIRE(std::isfinite(dv));
        CHECK(yv >= 0.0);
        CHECK(yv <= s);
        double const yref = s * r_sigmoid(xs[i]);
        double const dref = s * r_sigmoid(xs[i]) * r_sigmoid(-xs[i]);
        CHECK(std::fabs(yv - yref) <= tol<S>() * s);
        // Below the smallest normal of the compute type the derivative is subnormal or 0.
        double const tiny = std::is_same_v<S, double> ? 4.0 * std::numeric_limits<double>::denorm_min() : double(std::numeric_limits<float>::min());
        CHECK(std::fabs(dv - dref) <= tol<S>() * dref + tiny);
      }
    });
  }
}

// =============================================================================================
// the gates
// =============================================================================================

namespace {

// One gate case on every backend against the reference; A_log and dt_bias are views, absent
// when default-constructed.
template <class S>
void gate_case(bool softplus, double lb, index_t T, index_t K, k3::tensor_view<S const, 1> A_log, k3::tensor_view<S const, 2> dt_bias,
               std::vector<double> const& a_vals, std::vector<double> const& b_vals, std::mt19937& rng) {
  index_t const B = 2, HV = 3;
  std::array<index_t, 4> const ext{B, T, HV, K};
  strided<S, 4> x(ext, {1, 2, 0}, 2, nan_s<S>()), dg(ext, {2, 0, 1}, 1, nan_s<S>());
  std::size_t const n = std::size_t(B * T * HV * K);
  x.set(randn(n, rng, 2.0));
  dg.set(randn(n, rng));
  auto const xs = x.get(), gs = dg.get();
  bool const has_a = k3::present(A_log), has_b = k3::present(dt_bias);
  std::vector<double> gr(n), dxr(n), dar(std::size_t(HV), 0.0), dbr(std::size_t(HV * K), 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    index_t const k = index_t(i) % K, h = (index_t(i) / K) % HV;
    double const av = has_a ? a_vals[std::size_t(h)] : 0.0, bv = has_b ? b_vals[std::size_t(h * K + k)] : 0.0;
    gr[i] = ref_gate<double>(softplus, lb, xs[i], av, bv);
    // The lower-bound gate is linear in lb: derivatives at lb = -1, times -lb (a subnormal lb
    // would underflow the complex step's imaginary part).
    double const l1 = softplus ? lb : -1.0, m = softplus ? 1.0 : -lb;
    dxr[i] = m * gs[i] * complex_step_derivative(xs[i], [&](cd z) { return ref_gate<cd>(softplus, l1, z, av, bv); });
    dar[std::size_t(h)] += m * gs[i] * complex_step_derivative(av, [&](cd z) { return ref_gate<cd>(softplus, l1, xs[i], z, bv); });
    dbr[std::size_t(h * K + k)] += m * gs[i] * complex_step_derivative(bv, [&](cd z) { return ref_gate<cd>(softplus, l1, xs[i], av, z); });
  }
  std::vector<double> g0, dx0, da0, db0;
  bool first = true;
  each_backend([&](auto const& b, std::string const& name) {
    CAPTURE(name);
    strided<S, 4> g(ext, {0, 2, 1}, 3, sentinel<S>()), dx(ext, {2, 1, 0}, 1, sentinel<S>());
    strided<S, 2> ddt({HV, K}, {0}, 2, sentinel<S>());
    strided<S, 1> dA({HV}, {}, 0, sentinel<S>());
    kda::gate_args<S> const fwd{.x = x.view, .A_log = A_log, .dt_bias = dt_bias, .g = g.view};
    kda::gate_backward_args<S> const bwd{.x = x.view, .A_log = A_log, .dt_bias = dt_bias, .d_g = dg.view, .d_x = dx.view,
                                         .d_A_log = dA.view, .d_dt_bias = ddt.view};
    if (softplus) {
      kda::gate_softplus(b, fwd);
      kda::gate_softplus_backward(b, bwd);
    } else {
      kda::gate_lower_bound(b, fwd, {.lower_bound = lb});
      kda::gate_lower_bound_backward(b, bwd, {.lower_bound = lb});
    }
    CHECK(rel_err(gr, g.get()) <= tol<S>());
    CHECK(rel_err(dxr, dx.get()) <= tol<S>());
    CHECK(rel_err(dar, dA.get()) <= tol<S>());
    CHECK(rel_err(dbr, ddt.get()) <= tol<S>());
    CHECK(g.padding_is(sentinel<S>()));
    CHECK(dx.padding_is(sentinel<S>()));
    CHECK(ddt.padding_is(sentinel<S>()));
    if (!softplus) {
      // The range: (lb, 0], and never below lb as the storage type rounds it.
      double const lbs = load_as<double>(store_as<S>(lb));
      for (double v : g.get()) CHECK((v <= 0.0 && v >= std::min(lb, lbs)));
    }
    if (first) {
      g0 = g.get(), dx0 = dx.get(), da0 = dA.get(), db0 = ddt.get(), first = false;
    } else {
      CHECK(bitwise_same(g0, g.get()));
      CHECK(bitwise_same(dx0, dx.get()));
      CHECK(bitwise_same(da0, dA.get()));
      CHECK(bitwise_same(db0, ddt.get()));
    }
  });
}

}  // namespace

TEST_CASE_TEMPLATE("gates forward/backward: softplus and lower bound, A_log/dt_bias present or absent, every backend", S, double,
                   float, bfloat16) {
  std::mt19937 rng(8021);
  index_t const HV = 3;
  for (index_t K : {1, 3, 16, 17, 33})
    for (index_t T : {0, 1, 3}) {
      CAPTURE(K);
      CAPTURE(T);
      strided<S, 1> A({HV}, {}, 0, nan_s<S>());
      strided<S, 2> Bi({HV, K}, {0}, 3, nan_s<S>());
      A.set(randn(std::size_t(HV), rng, 0.7));
      Bi.set(randn(std::size_t(HV * K), rng));
      auto const av = A.get(), bv = Bi.get();
      for (double lb : {0.0, -5.0, -4.3, -1.0, -1e-3}) {
        bool const sp = lb == 0.0;
        CAPTURE(lb);
        gate_case<S>(sp, lb, T, K, A.view, Bi.view, av, bv, rng);
        gate_case<S>(sp, lb, T, K, {}, Bi.view, av, bv, rng);
        gate_case<S>(sp, lb, T, K, A.view, {}, av, bv, rng);
        gate_case<S>(sp, lb, T, K, {}, {}, av, bv, rng);
      }
    }
}

TEST_CASE("gate_lower_bound: the bound at its limits and tiny negative bounds") {
  std::mt19937 rng(8022);
  index_t const K = 5, HV = 3;
  std::vector<double> av = {0.0, 1.0, -2.0}, bv = randn(std::size_t(HV * K), rng);
  std::vector<float> Af(av.begin(), av.end()), Bf(bv.begin(), bv.end());
  std::vector<double> Ad(av), Bd(bv);
  auto const Afv = host_view(Af.data(), HV);
  auto const Adv = host_view(Ad.data(), HV);
  auto const Bfv = host_view(Bf.data(), HV, K);
  auto const Bdv = host_view(Bd.data(), HV, K);
  for (double lb : {-5.0, std::nextafter(-5.0, 0.0), -1e-30}) {
    CAPTURE(lb);
    gate_case<double>(false, lb, 2, K, Adv, Bdv, av, bv, rng);
    std::vector<double> avf(Af.begin(), Af.end()), bvf(Bf.begin(), Bf.end());
    gate_case<float>(false, lb, 2, K, Afv, Bfv, avf, bvf, rng);
  }
  gate_case<double>(false, -1e-300, 2, K, Adv, Bdv, av, bv, rng);
  // Bounds whose products are subnormal (or 0 in float): accepted, g in [lb, 0], all finite.
  for (double lb : {-std::numeric_limits<double>::denorm_min(), -std::numeric_limits<double>::min(), -1e-50}) {
    CAPTURE(lb);
    std::vector<double> xd = randn(std::size_t(2 * HV * K), rng), gd(xd.size()), dgd(xd.size(), 1.0), dxd(xd.size());
    std::vector<float> xf(xd.begin(), xd.end()), gf(xd.size()), dgf(xd.size(), 1.0f), dxf(xd.size());
    kda::gate_lower_bound(cpu::threads<>(2),
                          kda::gate_args<double>{.x = host_view(xd.data(), 1, 2, HV, K), .A_log = Adv, .dt_bias = Bdv, .g = host_view(gd.data(), 1, 2, HV, K)},
                          {.lower_bound = lb});
    kda::gate_lower_bound_backward(cpu::threads<>(2),
                                   kda::gate_backward_args<double>{.x = host_view(xd.data(), 1, 2, HV, K), .A_log = Adv, .dt_bias = Bdv,
                                                                   .d_g = host_view(dgd.data(), 1, 2, HV, K), .d_x = host_view(dxd.data(), 1, 2, HV, K)},
                                   {.lower_bound = lb});
    kda::gate_lower_bound(cpu::simd<>{},
                          kda::gate_args<float>{.x = host_view(xf.data(), 1, 2, HV, K), .A_log = Afv, .dt_bias = Bfv, .g = host_view(gf.data(), 1, 2, HV, K)},
                          {.lower_bound = lb});
    kda::gate_lower_bound_backward(cpu::simd<>{},
                                   kda::gate_backward_args<float>{.x = host_view(xf.data(), 1, 2, HV, K), .A_log = Afv, .dt_bias = Bfv,
                                                                  .d_g = host_view(dgf.data(), 1, 2, HV, K), .d_x = host_view(dxf.data(), 1, 2, HV, K)},
                                   {.lower_bound = lb});
    for (std::size_t i = 0; i < xd.size(); ++i) {
      CHECK((gd[i] <= 0.0 && gd[i] >= lb));
      CHECK((gf[i] <= 0.0f && double(gf[i]) >= lb));
      CHECK((std::isfinite(dxd[i]) && dxd[i] <= 0.0));
      CHECK((std::isfinite(dxf[i]) && dxf[i] <= 0.0f));
    }
  }
  // Outside [-5, 0): refused, naming the argument and the value.
  std::vector<float> x(std::size_t(HV * K)), g(x.size());
  for (double lb : {0.0, -0.0, std::nextafter(-5.0, -6.0), -5.5, 1.0, double(NAN), double(INFINITY), -double(INFINITY)}) {
    CAPTURE(lb);
    auto const e = error_of([&] {
      kda::gate_lower_bound(cpu::serial{}, kda::gate_args<float>{.x = host_view(x.data(), 1, 1, HV, K), .g = host_view(g.data(), 1, 1, HV, K)},
                            {.lower_bound = lb});
    });
    CHECK(e.find("'lower_bound'") != std::string::npos);
    CHECK(e.find("[-5, 0)") != std::string::npos);
    auto const e2 = error_of([&] {
      kda::gate_lower_bound_backward(cpu::serial{},
                                     kda::gate_backward_args<float>{.x = host_view(x.data(), 1, 1, HV, K), .d_g = host_view(x.data(), 1, 1, HV, K),
                                                                    .d_x = host_view(g.data(), 1, 1, HV, K)},
                                     {.lower_bound = lb});
    });
    CHECK(e2.find("'lower_bound'") != std::string::npos);
  }
}

// Saturated gates: z = exp(A_log) (x + dt_bias) overflows the compute type while every
// gradient is finite (dg/dz = lb s (1 - s) = 0 there): dx, dA_log and ddt_bias must be 0, not NaN.
TEST_CASE_TEMPLATE("gates: large |x| gives finite gradients where the math is finite", S, double, float, bfloat16) {
  double const mx = load_as<double>(store_as<S>(std::is_same_v<S, double> ? 1e308 : 3e38));
  std::vector<double> xs = {-mx, -1e30, -100, 0.5, 100, 1e30, mx};
  index_t const K = index_t(xs.size()), HV = 1;
  std::vector<S> x(xs.size()), dg(xs.size(), store_as<S>(1.0)), g(xs.size()), dx(xs.size()), A = {store_as<S>(2.0)}, dA(1), Bi(xs.size(), store_as<S>(0.0)),
      dB(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) x[i] = store_as<S>(xs[i]), xs[i] = load_as<double>(x[i]);
  auto const xv = host_view(x.data(), 1, 1, HV, K);
  each_backend([&](auto const& b, std::string const& name) {
    CAPTURE(name);
    for (double lb : {-5.0, -1.0}) {
      CAPTURE(lb);
      kda::gate_lower_bound(b, kda::gate_args<S>{.x = xv, .A_log = host_view(A.data(), HV), .dt_bias = host_view(Bi.data(), HV, K), .g = host_view(g.data(), 1, 1, HV, K)},
                            {.lower_bound = lb});
      kda::gate_lower_bound_backward(b,
                                     kda::gate_backward_args<S>{.x = xv, .A_log = host_view(A.data(), HV), .dt_bias = host_view(Bi.data(), HV, K),
                                                                .d_g = host_view(dg.data(), 1, 1, HV, K), .d_x = host_view(dx.data(), 1, 1, HV, K),
                                                                .d_A_log = host_view(dA.data(), HV), .d_dt_bias = host_view(dB.data(), HV, K)},
                                     {.lower_bound = lb});
      double dar = 0;
      for (std::size_t i = 0; i < xs.size(); ++i) {
        CAPTURE(xs[i]);
        CHECK(std::isfinite(load_as<double>(g[i])));
        CHECK(std::isfinite(load_as<double>(dx[i])));
        CHECK(std::isfinite(load_as<double>(dB[i])));
        double const z = std::exp(2.0) * xs[i];
        double const dz = lb * r_sigmoid(z) * r_sigmoid(-z);
        if (std::isfinite(z)) dar += dz * z;
        CHECK(load_as<double>(dx[i]) == doctest::Approx(dz * std::exp(2.0)).epsilon(tol<S>()));
      }
      CHECK(std::isfinite(load_as<double>(dA[0])));
      CHECK(load_as<double>(dA[0]) == doctest::Approx(dar).epsilon(tol<S>() * 10));
    }
    // softplus: -exp(A) softplus(x) is finite for every x here except -exp(2) * max (overflow of the value itself).
    kda::gate_softplus_backward(b, kda::gate_backward_args<S>{.x = xv, .A_log = host_view(A.data(), HV), .d_g = host_view(dg.data(), 1, 1, HV, K),
                                                              .d_x = host_view(dx.data(), 1, 1, HV, K)});
    for (std::size_t i = 0; i < xs.size(); ++i) {
      CAPTURE(xs[i]);
      CHECK(std::isfinite(load_as<double>(dx[i])));
      CHECK(load_as<double>(dx[i]) == doctest::Approx(-std::exp(2.0) * r_sigmoid(xs[i])).epsilon(tol<S>()));
    }
  });
}

TEST_CASE("gates: a NaN in x stays in its own element of g and dx") {
  index_t const B = 1, T = 3, HV = 2, K = 17;
  std::vector<float> x(std::size_t(B * T * HV * K), 0.25f), g(x.size()), dg(x.size(), 1.0f), dx(x.size());
  std::size_t const bad = std::size_t(((0 * T + 1) * HV + 1) * K + 4);
  x[bad] = NAN;
  auto const xv = host_view(x.data(), B, T, HV, K), gv = host_view(g.data(), B, T, HV, K);
  each_backend([&](auto const& b, std::string const& name) {
    CAPTURE(name);
    kda::gate_lower_bound(b, kda::gate_args<float>{.x = xv, .g = gv}, {.lower_bound = -5.0});
    kda::gate_lower_bound_backward(b, kda::gate_backward_args<float>{.x = xv, .d_g = host_view(dg.data(), B, T, HV, K), .d_x = host_view(dx.data(), B, T, HV, K)},
                                   {.lower_bound = -5.0});
    for (std::size_t i = 0; i < x.size(); ++i) {
      CHECK(std::isnan(g[i]) == (i == bad));
      CHECK(std::isnan(dx[i]) == (i == bad));
    }
    kda::gate_softplus(b, kda::gate_args<float>{.x = xv, .g = gv});
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(std::isnan(g[i]) == (i == bad));
  });
}

// =============================================================================================
// short conv
// =============================================================================================

namespace {

struct conv_cfg {
  index_t B, T, C, W;
  std::vector<std::int64_t> cu;  // empty: batched
  bool bias, init, silu;
};

// bias and init are absent when default-constructed.
template <class S>
void conv_case_impl(conv_cfg const& cf, kda::cu_seqlens_view const& cu, std::vector<seq8> const& seqs, strided<S, 3>& x, strided<S, 2>& w,
                    k3::tensor_view<S const, 1> bias, k3::tensor_view<S const, 3> init, std::vector<double> const& xs, std::vector<double> const& ws, std::vector<double> const& bs,
                    std::vector<double> const& is, strided<S, 3>& dy) {
  index_t const B = cf.B, T = cf.T, C = cf.C, W = cf.W, N = index_t(seqs.size());
  std::vector<double> const gs = dy.get();
  // Forward reference.
  std::vector<double> yr, fr;
  ref_conv(xs, B, T, C, ws, W, bs, seqs, is, cf.silu, yr, fr);
  // Backward reference: complex step of L = sum dy * y over the flat parameter list
  // [x | weight | bias | init].
  std::vector<double> p;
  p.insert(p.end(), xs.begin(), xs.end());
  p.insert(p.end(), ws.begin(), ws.end());
  p.insert(p.end(), bs.begin(), bs.end());
  p.insert(p.end(), is.begin(), is.end());
  std::vector<cd> zp(p.begin(), p.end());
  std::size_t const nx = xs.size(), nw = ws.size(), nb = bs.size();
  std::vector<cd> zy, zf;
  std::vector<double> const grad = k3::test::complex_step_gradient(zp, [&] {
    std::vector<cd> const zx(zp.begin(), zp.begin() + std::ptrdiff_t(nx)), zw(zp.begin() + std::ptrdiff_t(nx), zp.begin() + std::ptrdiff_t(nx + nw)),
        zb(zp.begin() + std::ptrdiff_t(nx + nw), zp.begin() + std::ptrdiff_t(nx + nw + nb)), zi(zp.begin() + std::ptrdiff_t(nx + nw + nb), zp.end());
    ref_conv(zx, B, T, C, zw, W, zb, seqs, zi, cf.silu, zy, zf);
    cd l = 0;
    for (std::size_t k = 0; k < zy.size(); ++k) l += gs[k] * zy[k];
    return l;
  });
  std::vector<double> const dxr(grad.begin(), grad.begin() + std::ptrdiff_t(nx)), dwr(grad.begin() + std::ptrdiff_t(nx), grad.begin() + std::ptrdiff_t(nx + nw));
  std::vector<double> dbr(grad.begin() + std::ptrdiff_t(nx + nw), grad.begin() + std::ptrdiff_t(nx + nw + nb)), dir(grad.begin() + std::ptrdiff_t(nx + nw + nb), grad.end());
  if (!cf.bias) {  // dbias without a bias is the gradient at bias = 0: sum of dpre
    std::vector<cd> zb(std::size_t(C), cd(0));
    std::vector<cd> const zx(xs.begin(), xs.end()), zw(ws.begin(), ws.end()), zi(is.begin(), is.end());
    dbr = k3::test::complex_step_gradient(zb, [&] {
      ref_conv(zx, B, T, C, zw, W, zb, seqs, zi, cf.silu, zy, zf);
      cd l = 0;
      for (std::size_t k = 0; k < zy.size(); ++k) l += gs[k] * zy[k];
      return l;
    });
  }
  std::array<index_t, 3> const ext{B, T, C}, sext{N, C, W - 1};
  std::vector<std::vector<double>> first;
  each_backend([&](auto const& bk, std::string const& name) {
    CAPTURE(name);
    strided<S, 3> y(ext, {1, 0}, 2, sentinel<S>()), dx(ext, {0, 1}, 1, sentinel<S>());
    strided<S, 3> fin(sext, {1, 0}, 1, sentinel<S>()), dinit(sext, {0, 1}, 2, sentinel<S>());
    strided<S, 2> dw({C, W}, {0}, 1, sentinel<S>());
    strided<S, 1> db({C}, {}, 0, sentinel<S>());
    bool const has_init = k3::present(init);
    kda::short_conv_options const opt{.cu_seqlens = cu, .silu = cf.silu};
    kda::short_conv(bk, kda::short_conv_args<S>{.x = x.view, .weight = w.view, .bias = bias, .y = y.view, .initial_state = init, .final_state = fin.view},
                    opt);
    kda::short_conv_backward(bk,
                             kda::short_conv_backward_args<S>{.x = x.view, .weight = w.view, .bias = bias, .d_y = dy.view, .d_x = dx.view,
                                                              .d_weight = dw.view, .d_bias = db.view, .initial_state = init,
                                                              .d_initial_state = has_init ? dinit.view : k3::tensor_view<S, 3>{}},
                             opt);
    CHECK(rel_err(yr, y.get()) <= tol<S>());
    CHECK(rel_err(fr, fin.get()) == 0.0);  // a copy of inputs
    CHECK(rel_err(dxr, dx.get()) <= tol<S>());
    CHECK(rel_err(dwr, dw.get()) <= tol<S>());
    CHECK(rel_err(dbr, db.get()) <= tol<S>());
    if (has_init) {
      CHECK(rel_err(dir, dinit.get()) <= tol<S>());
      CHECK(dinit.padding_is(sentinel<S>()));
    }
    CHECK(y.padding_is(sentinel<S>()));
    CHECK(dx.padding_is(sentinel<S>()));
    CHECK(fin.padding_is(sentinel<S>()));
    CHECK(dw.padding_is(sentinel<S>()));
    std::vector<std::vector<double>> got = {y.get(), fin.get(), dx.get(), dw.get(), db.get(), dinit.get()};
    if (first.empty())
      first = got;
    else
      for (std::size_t k = 0; k < got.size(); ++k) CHECK(bitwise_same(first[k], got[k]));
  });
}

template <class S>
void conv_case(conv_cfg const& cf, std::mt19937& rng) {
  index_t const B = cf.B, T = cf.T, C = cf.C, W = cf.W;
  std::vector<seq8> seqs;
  if (cf.cu.empty())
    for (index_t b = 0; b < B; ++b) seqs.push_back({b, 0, T});
  else
    for (std::size_t i = 0; i + 1 < cf.cu.size(); ++i) seqs.push_back({0, cf.cu[i], cf.cu[i + 1] - cf.cu[i]});
  index_t const N = index_t(seqs.size());
  strided<S, 3> x({B, T, C}, {1, 0}, 3, nan_s<S>()), dy({B, T, C}, {0, 1}, 1, nan_s<S>());
  strided<S, 2> w({C, W}, {0}, 2, nan_s<S>());
  strided<S, 1> bias({C}, {}, 0, nan_s<S>());
  strided<S, 3> init({N, C, W - 1}, {1, 0}, 2, nan_s<S>());
  x.set(randn(std::size_t(B * T * C), rng, 1.5));
  dy.set(randn(std::size_t(B * T * C), rng));
  w.set(randn(std::size_t(C * W), rng, 0.6));
  bias.set(randn(std::size_t(C), rng, 0.3));
  init.set(randn(std::size_t(N * C * (W - 1)), rng));
  std::vector<double> const xs = x.get(), ws = w.get(), bs = cf.bias ? bias.get() : std::vector<double>{},
                            is = cf.init ? init.get() : std::vector<double>{};
  auto go = [&](kda::cu_seqlens_view const& cu) {
    conv_case_impl<S>(cf, cu, seqs, x, w, cf.bias ? bias.view : k3::tensor_view<S, 1>{}, cf.init ? init.view : k3::tensor_view<S, 3>{}, xs, ws, bs,
                      is, dy);
  };
  if (cf.cu.empty()) {
    go({});
  } else {
    std::vector<std::int32_t> cu32(cf.cu.begin(), cf.cu.end());
    go(host_view(cf.cu.data(), index_t(cf.cu.size())));
    go(host_view(static_cast<std::int32_t const*>(cu32.data()), index_t(cu32.size())));
  }
}

std::vector<conv_cfg> conv_cfgs() {
  std::vector<conv_cfg> v;
  for (index_t W : {1, 2, 4, 5}) {
    // Varlen: empty sequences, length 1, shorter than W, longer; empty at both ends.
    v.push_back({1, 13, 17, W, {0, 0, 1, 1, 3, 6, 6, 13, 13}, true, true, true});
    v.push_back({1, 13, 3, W, {0, 0, 1, 1, 3, 6, 6, 13, 13}, false, true, false});
    v.push_back({1, 5, 16, W, {0, 2, 5}, true, false, true});
    v.push_back({1, 0, 15, W, {0}, true, true, true});
    v.push_back({1, 0, 15, W, {0, 0, 0}, true, true, true});
    // Batched, T = 0, 1, 2 and beyond W.
    for (index_t T : {0, 1, 2, 7}) v.push_back({2, T, 1 + 16 * (T % 3), W, {}, T % 2 == 0, true, true});
    v.push_back({3, 6, 33, W, {}, true, false, true});
  }
  return v;
}

}  // namespace

TEST_CASE_TEMPLATE("short_conv forward/backward against the complex step: varlen with empty and short sequences, states, every backend",
                   S, double, float, bfloat16) {
  std::mt19937 rng(8031);
  for (conv_cfg const& cf : conv_cfgs()) {
    CAPTURE(cf.B);
    CAPTURE(cf.T);
    CAPTURE(cf.C);
    CAPTURE(cf.W);
    CAPTURE(cf.cu.size());
    CAPTURE(cf.bias);
    CAPTURE(cf.init);
    CAPTURE(cf.silu);
    conv_case<S>(cf, rng);
  }
}

namespace {

// Prefill the first `pre[n]` tokens of each sequence (from an initial state), then decode the
// rest token by token into a pool at permuted slots; y and the states must equal the full
// prefill, bitwise (same summation order).
template <class S, class Bk>
void prefill_then_decode(Bk const& bk, index_t C, index_t W, bool with_bias, std::mt19937& rng) {
  std::vector<std::int64_t> const cu = {0, 0, 1, 3, 9, 11};
  std::vector<index_t> const pre = {0, 1, 0, 2, 1};  // prefill lengths per sequence
  index_t const N = index_t(cu.size()) - 1, T = cu.back();
  auto const rnd = [&](std::size_t n, double sd) {
    std::vector<S> v(n);
    auto const d = randn(n, rng, sd);
    for (std::size_t i = 0; i < n; ++i) v[i] = store_as<S>(d[i]);
    return v;
  };
  std::vector<S> x = rnd(std::size_t(T * C), 1.0), w = rnd(std::size_t(C * W), 0.5), bias = rnd(std::size_t(C), 0.2),
                 init = rnd(std::size_t(N * C * (W - 1)), 1.0);
  std::vector<S> y_full(x.size()), fin_full(init.size());
  auto const wv = host_view(static_cast<S const*>(w.data()), C, W);
  auto const bv = host_view(static_cast<S const*>(bias.data()), C);
  auto const cuv = host_view(cu.data(), N + 1);
  k3::tensor_view<S const, 1> const bias_arg = with_bias ? bv : k3::tensor_view<S const, 1>{};
  kda::short_conv(bk,
                  kda::short_conv_args<S>{.x = host_view(x.data(), 1, T, C), .weight = wv, .bias = bias_arg, .y = host_view(y_full.data(), 1, T, C),
                                          .initial_state = host_view(init.data(), N, C, W - 1), .final_state = host_view(fin_full.data(), N, C, W - 1)},
                  {.cu_seqlens = cuv});
  // Prefill part: packed prefixes.
  std::vector<std::int64_t> cup = {0};
  std::vector<S> xp, yp;
  for (index_t n = 0; n < N; ++n) {
    for (index_t t = 0; t < pre[std::size_t(n)]; ++t)
      for (index_t c = 0; c < C; ++c) xp.push_back(x[std::size_t((cu[std::size_t(n)] + t) * C + c)]);
    cup.push_back(cup.back() + pre[std::size_t(n)]);
  }
  index_t const Tp = cup.back(), P = N + 2;
  yp.resize(xp.size());
  std::vector<index_t> slot_of = {3, 0, 6, 1, 4};
  std::vector<S> pool(std::size_t(P * C * (W - 1)), store_as<S>(99.0)), st(init.size());
  kda::short_conv(bk,
                  kda::short_conv_args<S>{.x = host_view(xp.data(), 1, Tp, C), .weight = wv, .bias = bias_arg, .y = host_view(yp.data(), 1, Tp, C),
                                          .initial_state = host_view(init.data(), N, C, W - 1), .final_state = host_view(st.data(), N, C, W - 1)},
                  {.cu_seqlens = host_view(cup.data(), N + 1)});
  for (index_t n = 0; n < N; ++n)
    for (index_t i = 0; i < C * (W - 1); ++i)
      pool[std::size_t(slot_of[std::size_t(n)] * C * (W - 1) + i)] = st[std::size_t(n * C * (W - 1) + i)];
  for (index_t n = 0; n < N; ++n)
    for (index_t t = 0; t < pre[std::size_t(n)]; ++t)
      for (index_t c = 0; c < C; ++c)
        CHECK(load_as<double>(yp[std::size_t((cup[std::size_t(n)] + t) * C + c)]) ==
              load_as<double>(y_full[std::size_t((cu[std::size_t(n)] + t) * C + c)]));
  // Decode: at step k every sequence with a token left contributes one row.
  for (index_t k = 0;; ++k) {
    std::vector<std::int64_t> slots;
    std::vector<index_t> who;
    std::vector<S> xd;
    for (index_t n = 0; n < N; ++n) {
      index_t const t = pre[std::size_t(n)] + k;
      if (cu[std::size_t(n)] + t >= cu[std::size_t(n) + 1]) continue;
      who.push_back(cu[std::size_t(n)] + t);
      slots.push_back(slot_of[std::size_t(n)]);
      for (index_t c = 0; c < C; ++c) xd.push_back(x[std::size_t((cu[std::size_t(n)] + t) * C + c)]);
    }
    if (who.empty()) break;
    index_t const M = index_t(who.size());
    std::vector<S> yd(xd.size());
    auto const pv = host_view(pool.data(), P, C, W - 1);
    auto const sv = host_view(static_cast<std::int64_t const*>(slots.data()), M);
    kda::short_conv_decode(bk, kda::short_conv_decode_args<S>{.x = host_view(xd.data(), M, C), .weight = wv, .bias = bias_arg, .conv_state = pv,
                                                              .y = host_view(yd.data(), M, C), .slots64 = sv});
    for (index_t m = 0; m < M; ++m)
      for (index_t c = 0; c < C; ++c) {
        CAPTURE(who[std::size_t(m)]);
        CHECK(load_as<double>(yd[std::size_t(m * C + c)]) == load_as<double>(y_full[std::size_t(who[std::size_t(m)] * C + c)]));
      }
  }
  for (index_t n = 0; n < N; ++n)
    for (index_t i = 0; i < C * (W - 1); ++i)
      CHECK(load_as<double>(pool[std::size_t(slot_of[std::size_t(n)] * C * (W - 1) + i)]) ==
            load_as<double>(fin_full[std::size_t(n * C * (W - 1) + i)]));
  // Untouched slots 2 and 5.
  for (index_t s : {2, 5})
    for (index_t i = 0; i < C * (W - 1); ++i) CHECK(load_as<double>(pool[std::size_t(s * C * (W - 1) + i)]) == 99.0);
}

}  // namespace

TEST_CASE_TEMPLATE("short_conv_decode after a prefill equals the full convolution bitwise (every backend, pool slots)", S, double,
                   float, bfloat16) {
  std::mt19937 rng(8041);
  for (index_t W : {1, 2, 4, 5})
    for (index_t C : {1, 3, 16, 17, 33}) {
      CAPTURE(W);
      CAPTURE(C);
      each_backend([&](auto const& bk, std::string const& name) {
        CAPTURE(name);
        prefill_then_decode<S>(bk, C, W, true, rng);
        prefill_then_decode<S>(bk, C, W, false, rng);
      });
    }
}

TEST_CASE("short_conv in place (final_state is initial_state) equals separate states, partial overlap is refused") {
  std::mt19937 rng(8051);
  index_t const C = 17, W = 4;
  std::vector<std::int64_t> const cu = {0, 0, 1, 3, 3, 10};
  index_t const N = 5, T = 10;
  std::vector<float> x(std::size_t(T * C)), w(std::size_t(C * W)), y(x.size()), y2(x.size()), s(std::size_t(N * C * (W - 1))), s0(s.size()),
      fin(s.size());
  auto fill = [&](std::vector<float>& v) {
    auto const d = randn(v.size(), rng);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = float(d[i]);
  };
  fill(x), fill(w), fill(s0);
  auto const cuv = host_view(cu.data(), N + 1);
  each_backend([&](auto const& bk, std::string const& name) {
    CAPTURE(name);
    s = s0;
    kda::short_conv(bk,
                    kda::short_conv_args<float>{.x = host_view(x.data(), 1, T, C), .weight = host_view(w.data(), C, W), .y = host_view(y.data(), 1, T, C),
                                                .initial_state = host_view(s0.data(), N, C, W - 1), .final_state = host_view(fin.data(), N, C, W - 1)},
                    {.cu_seqlens = cuv});
    kda::short_conv(bk,
                    kda::short_conv_args<float>{.x = host_view(x.data(), 1, T, C), .weight = host_view(w.data(), C, W), .y = host_view(y2.data(), 1, T, C),
                                                .initial_state = host_view(s.data(), N, C, W - 1), .final_state = host_view(s.data(), N, C, W - 1)},
                    {.cu_seqlens = cuv});
    CHECK(y == y2);
    CHECK(s == fin);
  });
  // final_state one element past initial_state: overlapping, not the same view.
  std::vector<float> big(s.size() + 1);
  auto const e = error_of([&] {
    kda::short_conv(cpu::serial{},
                    kda::short_conv_args<float>{.x = host_view(x.data(), 1, T, C), .weight = host_view(w.data(), C, W), .y = host_view(y.data(), 1, T, C),
                                                .initial_state = host_view(big.data(), N, C, W - 1),
                                                .final_state = host_view(big.data() + 1, N, C, W - 1)},
                    {.cu_seqlens = cuv});
  });
  CHECK(k3::test::names_overlap(e, "final_state", "initial_state"));
  // y over x.
  auto const e2 = error_of([&] {
    kda::short_conv(cpu::serial{},
                    kda::short_conv_args<float>{.x = host_view(x.data(), 1, T, C), .weight = host_view(w.data(), C, W), .y = host_view(x.data(), 1, T, C)},
                    {.cu_seqlens = cuv});
  });
  CHECK(k3::test::names_overlap(e2, "y", "x"));
  // decode: y over the pool.
  std::vector<float> pool(std::size_t(2 * C * (W - 1)));
  auto const e3 = error_of([&] {
    kda::short_conv_decode(cpu::serial{}, kda::short_conv_decode_args<float>{.x = host_view(x.data(), 2, C), .weight = host_view(w.data(), C, W),
                                                                             .conv_state = host_view(pool.data(), 2, C, W - 1), .y = host_view(pool.data(), 2, C)});
  });
  CHECK(k3::test::names_overlap(e3, "conv_state", "y"));
}

TEST_CASE("short_conv: NaN/Inf in one sequence stays in that sequence (y, final state, dx, d_initial_state, decode slot)") {
  index_t const C = 3, W = 4;
  std::vector<std::int64_t> const cu = {0, 2, 2, 7, 12};
  index_t const N = 4, T = 12;
  std::vector<double> x(std::size_t(T * C), 0.3), w(std::size_t(C * W), 0.5), y(x.size()), dy(x.size(), 1.0), dx(x.size()),
      s0(std::size_t(N * C * (W - 1)), 0.1), fin(s0.size()), ds0(s0.size()), dw(w.size());
  x[std::size_t(4 * C + 1)] = NAN;  // sequence 2 (tokens 2..6)
  x[std::size_t(5 * C + 2)] = INFINITY;
  auto const cuv = host_view(cu.data(), N + 1);
  auto in_seq2 = [&](index_t t) { return t >= 2 && t < 7; };
  each_backend([&](auto const& bk, std::string const& name) {
    CAPTURE(name);
    kda::short_conv(bk,
                    kda::short_conv_args<double>{.x = host_view(x.data(), 1, T, C), .weight = host_view(w.data(), C, W), .y = host_view(y.data(), 1, T, C),
                                                 .initial_state = host_view(s0.data(), N, C, W - 1), .final_state = host_view(fin.data(), N, C, W - 1)},
                    {.cu_seqlens = cuv});
    kda::short_conv_backward(bk,
                             kda::short_conv_backward_args<double>{.x = host_view(x.data(), 1, T, C), .weight = host_view(w.data(), C, W),
                                                                   .d_y = host_view(dy.data(), 1, T, C), .d_x = host_view(dx.data(), 1, T, C),
                                                                   .d_weight = host_view(dw.data(), C, W), .initial_state = host_view(s0.data(), N, C, W - 1),
                                                                   .d_initial_state = host_view(ds0.data(), N, C, W - 1)},
                             {.cu_seqlens = cuv});
    for (index_t t = 0; t < T; ++t)
      for (index_t c = 0; c < C; ++c)
        if (!in_seq2(t)) {
          CHECK(std::isfinite(y[std::size_t(t * C + c)]));
          CHECK(std::isfinite(dx[std::size_t(t * C + c)]));
        }
    for (index_t n : {0, 1, 3})
      for (index_t i = 0; i < C * (W - 1); ++i) {
        CHECK(std::isfinite(fin[std::size_t(n * C * (W - 1) + i)]));
        CHECK(std::isfinite(ds0[std::size_t(n * C * (W - 1) + i)]));
      }
    // Channel 0 of sequence 2 never sees the NaN/Inf.
    for (index_t t = 2; t < 7; ++t) CHECK(std::isfinite(y[std::size_t(t * C + 0)]));
  });
  // decode: NaN in row 1 touches only y[1] and slot 1.
  std::vector<double> xd(std::size_t(3 * C), 0.2), yd(xd.size()), pool(std::size_t(3 * C * (W - 1)), 0.1);
  xd[std::size_t(1 * C + 0)] = NAN;
  kda::short_conv_decode(cpu::threads<>(3), kda::short_conv_decode_args<double>{.x = host_view(xd.data(), 3, C), .weight = host_view(w.data(), C, W),
                                                                               .conv_state = host_view(pool.data(), 3, C, W - 1), .y = host_view(yd.data(), 3, C)});
  for (index_t n : {0, 2})
    for (index_t c = 0; c < C; ++c) CHECK(std::isfinite(yd[std::size_t(n * C + c)]));
  for (index_t n : {0, 2})
    for (index_t i = 0; i < C * (W - 1); ++i) CHECK(std::isfinite(pool[std::size_t(n * C * (W - 1) + i)]));
}

TEST_CASE_TEMPLATE("short_conv: large |pre| keeps y and the gradients finite", S, double, float, bfloat16) {
  index_t const C = 4, W = 4, T = 6;
  double const big = std::is_same_v<S, double> ? 1e300 : 1e36;
  std::vector<S> x(std::size_t(T * C)), w(std::size_t(C * W), store_as<S>(0.25)), y(x.size()), dy(x.size(), store_as<S>(1.0)), dx(x.size()),
      dw(w.size()), db(static_cast<std::size_t>(C));
  for (index_t t = 0; t < T; ++t)
    for (index_t c = 0; c < C; ++c) x[std::size_t(t * C + c)] = store_as<S>((c % 2 ? -big : big) * (1 + 0.1 * double(t)));
  each_backend([&](auto const& bk, std::string const& name) {
    CAPTURE(name);
    kda::short_conv(bk, kda::short_conv_args<S>{.x = host_view(x.data(), 1, T, C), .weight = host_view(w.data(), C, W), .y = host_view(y.data(), 1, T, C)});
    kda::short_conv_backward(bk, kda::short_conv_backward_args<S>{.x = host_view(x.data(), 1, T, C), .weight = host_view(w.data(), C, W),
                                                                  .d_y = host_view(dy.data(), 1, T, C), .d_x = host_view(dx.data(), 1, T, C),
                                                                  .d_bias = host_view(db.data(), C)});
    for (std::size_t i = 0; i < x.size(); ++i) {
      CHECK(std::isfinite(load_as<double>(y[i])));
      CHECK(std::isfinite(load_as<double>(dx[i])));
    }
    for (index_t c = 0; c < C; ++c) {
      CHECK(std::isfinite(load_as<double>(db[std::size_t(c)])));
      // silu'(z) -> 1 for z -> +inf and -> 0 for z -> -inf.
      CHECK(load_as<double>(db[std::size_t(c)]) == doctest::Approx(c % 2 ? 0.0 : double(T)).epsilon(1e-6));
    }
  });
}

TEST_CASE("short_conv: bad input names the argument with expected and actual values") {
  index_t const C = 3, W = 4, T = 5;
  std::vector<float> x(std::size_t(T * C)), w(std::size_t(C * W)), y(x.size()), s(std::size_t(2 * C * (W - 1)));
  std::vector<std::int64_t> cu_bad_end = {0, 2, 4}, cu_dec = {0, 3, 2, 5}, cu_start = {1, 5};
  auto const xv = host_view(x.data(), 1, T, C), yv = host_view(y.data(), 1, T, C);
  auto const wv = host_view(w.data(), C, W);
  using Args = kda::short_conv_args<float>;
  auto e = error_of([&] { kda::short_conv(cpu::serial{}, Args{.x = xv, .weight = wv, .y = yv}, {.cu_seqlens = host_view(cu_bad_end.data(), 3)}); });
  CHECK(e.find("'cu_seqlens'") != std::string::npos);
  CHECK(e.find("T = 5") != std::string::npos);
  CHECK(e.find("got 4") != std::string::npos);
  e = error_of([&] { kda::short_conv(cpu::serial{}, Args{.x = xv, .weight = wv, .y = yv}, {.cu_seqlens = host_view(cu_dec.data(), 4)}); });
  CHECK(e.find("non-decreasing") != std::string::npos);
  e = error_of([&] { kda::short_conv(cpu::serial{}, Args{.x = xv, .weight = wv, .y = yv}, {.cu_seqlens = host_view(cu_start.data(), 2)}); });
  CHECK(e.find("start at 0") != std::string::npos);
  // initial_state with the wrong sequence count.
  std::vector<std::int64_t> cu3 = {0, 1, 2, 5};
  e = error_of([&] {
    kda::short_conv(cpu::serial{}, Args{.x = xv, .weight = wv, .y = yv, .initial_state = host_view(s.data(), 2, C, W - 1)},
                    {.cu_seqlens = host_view(cu3.data(), 4)});
  });
  CHECK(e.find("'initial_state'") != std::string::npos);
  CHECK(e.find("3") != std::string::npos);
  // weight with the wrong channel count.
  e = error_of([&] { kda::short_conv(cpu::serial{}, Args{.x = xv, .weight = host_view(w.data(), C + 1, 2), .y = yv}); });
  CHECK(e.find("'weight'") != std::string::npos);
  // decode: duplicated and out-of-range slots.
  std::vector<std::int32_t> dup = {1, 1}, oob = {0, 2};
  std::vector<float> xd(std::size_t(2 * C)), yd(xd.size());
  e = error_of([&] {
    kda::short_conv_decode(cpu::serial{}, kda::short_conv_decode_args<float>{.x = host_view(xd.data(), 2, C), .weight = wv,
                                                                             .conv_state = host_view(s.data(), 2, C, W - 1), .y = host_view(yd.data(), 2, C),
                                                                             .slots32 = host_view(dup.data(), 2)});
  });
  CHECK(e.find("'slots32'") != std::string::npos);
  CHECK(e.find("twice") != std::string::npos);
  e = error_of([&] {
    kda::short_conv_decode(cpu::serial{}, kda::short_conv_decode_args<float>{.x = host_view(xd.data(), 2, C), .weight = wv,
                                                                             .conv_state = host_view(s.data(), 2, C, W - 1), .y = host_view(yd.data(), 2, C),
                                                                             .slots32 = host_view(oob.data(), 2)});
  });
  CHECK(e.find("'slots32'") != std::string::npos);
  CHECK(e.find("[0, 2)") != std::string::npos);
}

TEST_CASE("l2norm, beta and gates on views whose last dimension is not unit-stride (transposed) equal the contiguous results") {
  index_t const R = 5, D = 17;
  std::mt19937 rng(8061);
  auto const v = randn(std::size_t(R * D), rng);
  std::vector<float> xc(v.begin(), v.end()), xt(std::size_t(R * D));  // xt[d * R + r] = xc[r * D + d]
  for (index_t r = 0; r < R; ++r)
    for (index_t d = 0; d < D; ++d) xt[std::size_t(d * R + r)] = xc[std::size_t(r * D + d)];
  using V2 = tensor_view<float, 2>;
  V2::extents_type e{R, D}, st{1, R};
  V2 const xtv(xt.data(), e, st);
  std::vector<float> yc(xc.size()), yt(xc.size()), dxc(xc.size()), dxt(xc.size());
  auto const ytv = V2(yt.data(), e, st), dxtv = V2(dxt.data(), e, st);
  auto ct = [&](std::vector<float> const& c, std::vector<float> const& t, char const* what) {
    std::string const stage = what;
    CAPTURE(stage);
    for (index_t r = 0; r < R; ++r)
      for (index_t d = 0; d < D; ++d) CHECK(c[std::size_t(r * D + d)] == t[std::size_t(d * R + r)]);
  };
  each_backend([&](auto const& b, std::string const& name) {
    CAPTURE(name);
    kda::l2norm(b, kda::l2norm_args<float, 2>{.x = host_view(xc.data(), R, D), .y = host_view(yc.data(), R, D)});
    kda::l2norm(b, kda::l2norm_args<float, 2>{.x = xtv, .y = ytv});
    ct(yc, yt, "l2norm");
    kda::l2norm_backward(b, kda::l2norm_backward_args<float, 2>{.x = host_view(xc.data(), R, D), .d_y = host_view(yc.data(), R, D),
                                                                .d_x = host_view(dxc.data(), R, D)});
    kda::l2norm_backward(b, kda::l2norm_backward_args<float, 2>{.x = xtv, .d_y = ytv, .d_x = dxtv});
    ct(dxc, dxt, "l2norm_backward");
    kda::beta_sigmoid(b, kda::beta_sigmoid_args<float, 2>{.x = host_view(xc.data(), R, D), .beta = host_view(yc.data(), R, D)}, {.allow_neg_eigval = true});
    kda::beta_sigmoid(b, kda::beta_sigmoid_args<float, 2>{.x = xtv, .beta = ytv}, {.allow_neg_eigval = true});
    ct(yc, yt, "beta_sigmoid");
    kda::beta_sigmoid_backward(b, kda::beta_sigmoid_backward_args<float, 2>{.x = host_view(xc.data(), R, D), .d_beta = host_view(yc.data(), R, D),
                                                                            .d_x = host_view(dxc.data(), R, D)});
    kda::beta_sigmoid_backward(b, kda::beta_sigmoid_backward_args<float, 2>{.x = xtv, .d_beta = ytv, .d_x = dxtv});
    ct(dxc, dxt, "beta_sigmoid_backward");
  });
}
