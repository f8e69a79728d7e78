// Tests of the row-wise KDA pre-processing ops (k3/kda/preprocess/pointwise.hpp): L2 norm,
// beta sigmoid and the two gates, forward against plain float64 loops written here, backward
// against central finite differences in double, serial against threads (bitwise), float and
// bfloat16 storage against the float64 reference, strided views, and bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "k3/backend/cpu/simd.hpp"
#include "k3/kda/preprocess.hpp"

#include "kda/preprocess_checks.hpp"
#include "support/error_of.hpp"

using k3::bfloat16;
using k3::index_t;
using namespace k3::test;

namespace {


double dot(std::vector<double> const& a, std::vector<double> const& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// ---- float64 references (plain loops, rows of length D) ----
std::vector<double> ref_l2norm(std::vector<double> const& x, index_t D) {
  std::vector<double> y(x.size());
  for (std::size_t r = 0; r * D < x.size(); ++r) {
    double ss = 0;
    for (index_t d = 0; d < D; ++d) ss += x[r * D + d] * x[r * D + d];
    for (index_t d = 0; d < D; ++d) y[r * D + d] = x[r * D + d] / std::sqrt(ss + 1e-6);
  }
  return y;
}
double ref_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double ref_softplus(double x) { return x > 30 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

// g[b,t,h,k] for either gate; A_log / dt_bias empty means absent.
std::vector<double> ref_gate(bool lower, std::vector<double> const& x, std::vector<double> const& A_log,
                             std::vector<double> const& dt_bias, double lb, index_t HV, index_t K) {
  std::vector<double> g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    index_t const k = static_cast<index_t>(i) % K, h = (static_cast<index_t>(i) / K) % HV;
    double const a = A_log.empty() ? 1.0 : std::exp(A_log[h]);
    double const u = x[i] + (dt_bias.empty() ? 0.0 : dt_bias[h * K + k]);
    g[i] = lower ? lb * ref_sigmoid(a * u) : -a * ref_softplus(u);
  }
  return g;
}

k3::cpu::serial serial;

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("l2norm forward matches the float64 reference", S, double, float, bfloat16) {
  for (auto [rows, D] : {std::pair<index_t, index_t>{1, 1}, {7, 16}, {33, 60}, {5, 128}, {0, 8}, {3, 0}}) {
    auto xd = randn(static_cast<std::size_t>(rows * D), 11 + rows, 2.0);
    if (rows > 2) std::fill(xd.begin(), xd.begin() + D, 0.0);  // an all-zero row: eps keeps it finite (0)
    auto x = cast<S>(xd);
    std::vector<S> y(x.size());
    k3::kda::l2norm(serial, k3::kda::l2norm_args<S, 2>{.x = k3::host_view(x.data(), rows, D), .y = k3::host_view(y.data(), rows, D)});
    auto ref = ref_l2norm(widen(x), D);
    double const tol = std::is_same_v<S, double> ? 1e-14 : std::is_same_v<S, float> ? 1e-6 : 8e-3;
    check_close(widen(y), ref, tol, 1e-30, "l2norm");
  }
}

TEST_CASE("l2norm backward matches finite differences (double)") {
  index_t const B = 2, T = 3, H = 2, D = 13;
  std::size_t const n = static_cast<std::size_t>(B * T * H * D);
  auto x = randn(n, 5, 0.7);
  auto w = randn(n, 6);
  std::vector<double> dx(n);
  k3::kda::l2norm_backward(serial, k3::kda::l2norm_backward_args<double>{.x = k3::host_view(x.data(), B, T, H, D),
                                                                         .d_y = k3::host_view(w.data(), B, T, H, D),
                                                                         .d_x = k3::host_view(dx.data(), B, T, H, D)});
  auto loss = [&] { return dot(w, ref_l2norm(x, D)); };
  check_fd(x, dx, loss, "dx");
}

// Regression: the float sum of squares overflowed for |x| beyond ~1e19 (D = 17), and
// y = x / sqrt(inf) came out 0 instead of a unit vector; the backward gave 0 as well. The op is
// scale-invariant once |x|^2 >> eps: powers of two must change nothing but the scale.
TEST_CASE_TEMPLATE("l2norm of huge rows (sum of squares past the type's range) stays exact", S, double, float, bfloat16) {
  index_t const rows = 4, D = 17;
  auto xd = randn(static_cast<std::size_t>(rows * D), 41, 1.0);
  auto dyd = randn(xd.size(), 42, 1.0);
  int const big = std::is_same_v<S, double> ? 520 : 66;  // 2^66 ~ 7e19: ss ~ 1e41 > FLT_MAX
  for (int e : {big, big + 40}) {
    CAPTURE(e);
    std::vector<double> xs(xd.size());
    for (std::size_t i = 0; i < xd.size(); ++i) xs[i] = std::ldexp(xd[i], e);
    auto x = cast<S>(xs);
    auto dy = cast<S>(dyd);
    std::vector<S> y(x.size()), dx(x.size());
    k3::kda::l2norm(serial, k3::kda::l2norm_args<S, 2>{.x = k3::host_view(x.data(), rows, D), .y = k3::host_view(y.data(), rows, D)});
    k3::kda::l2norm_backward(serial, k3::kda::l2norm_backward_args<S, 2>{.x = k3::host_view(x.data(), rows, D),
                                                                         .d_y = k3::host_view(dy.data(), rows, D),
                                                                         .d_x = k3::host_view(dx.data(), rows, D)});
    // references from the unscaled x (exact: x = x1 * 2^e): y = y1, dx = dx1 * 2^-e
    auto x1 = widen(x);
    for (auto& v : x1) v = std::ldexp(v, -e);
    // (eps = 1e-6 is below the rounding of |x|^2 ~ 2^(2e): the reference leaves it out)
    std::vector<double> yr(x1.size()), dxr(x1.size());
    for (index_t r = 0; r < rows; ++r) {
      double ss = 0, gy = 0;
      for (index_t d = 0; d < D; ++d) ss += x1[r * D + d] * x1[r * D + d];
      for (index_t d = 0; d < D; ++d) yr[r * D + d] = x1[r * D + d] / std::sqrt(ss);
      for (index_t d = 0; d < D; ++d) gy += widen(dy)[r * D + d] * yr[r * D + d];
      for (index_t d = 0; d < D; ++d) dxr[r * D + d] = std::ldexp((widen(dy)[r * D + d] - gy * yr[r * D + d]) / std::sqrt(ss), -e);
    }
    double const tol = std::is_same_v<S, double> ? 1e-13 : std::is_same_v<S, float> ? 1e-6 : 8e-3;
    check_close(widen(y), yr, tol, 1e-300, "l2norm huge");
    double dmax = 0;
    for (double v : dxr) dmax = std::max(dmax, std::fabs(v));
    double const dtol = std::is_same_v<S, bfloat16> ? 2e-2 : tol;
    check_close(widen(dx), dxr, dtol, dtol * dmax, "l2norm_backward huge");
  }
}

TEST_CASE("l2norm on strided views equals the contiguous result") {
  // q packed inside a wider [T, 3, D] projection buffer: rows of stride 3D.
  index_t const T = 9, D = 20;
  auto buf = randn(static_cast<std::size_t>(T * 3 * D), 8);
  k3::tensor_view<double, 3> all(buf.data(), {T, 3, D});
  auto q = all.slice(1, 1);  // [T, D], row stride 3D
  std::vector<double> qc(static_cast<std::size_t>(T * D));
  for (index_t t = 0; t < T; ++t)
    for (index_t d = 0; d < D; ++d) qc[static_cast<std::size_t>(t * D + d)] = q(t, d);
  std::vector<double> y1(qc.size()), y2(qc.size() * 2);
  k3::kda::l2norm(serial, k3::kda::l2norm_args<double, 2>{.x = q, .y = k3::host_view(y1.data(), T, D)});
  // the output strided too: every other element
  k3::tensor_view<double, 2> ys(y2.data(), {T, D}, {2 * D, 2});
  k3::kda::l2norm(serial, k3::kda::l2norm_args<double, 2>{.x = q, .y = ys});
  for (index_t t = 0; t < T; ++t)
    for (index_t d = 0; d < D; ++d) REQUIRE(ys(t, d) == y1[static_cast<std::size_t>(t * D + d)]);
  check_close(y1, ref_l2norm(qc, D), 1e-14, 1e-30, "strided");
  std::vector<double> dy = randn(qc.size(), 9), dx1(qc.size()), dx2(qc.size());
  k3::kda::l2norm_backward(serial, k3::kda::l2norm_backward_args<double, 2>{.x = q, .d_y = k3::host_view(dy.data(), T, D),
                                                                            .d_x = k3::host_view(dx1.data(), T, D)});
  k3::kda::l2norm_backward(serial, k3::kda::l2norm_backward_args<double, 2>{.x = k3::host_view(qc.data(), T, D),
                                                                            .d_y = k3::host_view(dy.data(), T, D),
                                                                            .d_x = k3::host_view(dx2.data(), T, D)});
  CHECK(dx1 == dx2);
}

TEST_CASE_TEMPLATE("beta sigmoid forward and backward", S, double, float, bfloat16) {
  for (bool neg : {false, true}) {
    index_t const B = 2, T = 37, HV = 6;
    std::size_t const n = static_cast<std::size_t>(B * T * HV);
    auto xd = randn(n, 21, 4.0);
    xd[0] = 80.0;  // saturated ends stay finite
    xd[1] = -80.0;
    auto x = cast<S>(xd);
    std::vector<S> beta(n);
    k3::kda::beta_sigmoid(serial, k3::kda::beta_sigmoid_args<S>{.x = k3::host_view(x.data(), B, T, HV), .beta = k3::host_view(beta.data(), B, T, HV)},
                          {.allow_neg_eigval = neg});
    std::vector<double> ref(n);
    auto xw = widen(x);
    for (std::size_t i = 0; i < n; ++i) ref[i] = (neg ? 2.0 : 1.0) * ref_sigmoid(xw[i]);
    double const tol = std::is_same_v<S, double> ? 1e-15 : std::is_same_v<S, float> ? 1e-6 : 8e-3;
    check_close(widen(beta), ref, tol, std::is_same_v<S, double> ? 1e-300 : 1e-37, "beta");
    for (auto b : widen(beta)) CHECK((b >= 0.0 && b <= (neg ? 2.0 : 1.0)));

    auto dyd = randn(n, 22);
    auto dy = cast<S>(dyd);
    std::vector<S> dx(n);
    k3::kda::beta_sigmoid_backward(serial,
                                   k3::kda::beta_sigmoid_backward_args<S>{.x = k3::host_view(x.data(), B, T, HV),
                                                                          .d_beta = k3::host_view(dy.data(), B, T, HV),
                                                                          .d_x = k3::host_view(dx.data(), B, T, HV)},
                                   {.allow_neg_eigval = neg});
    std::vector<double> dref(n);
    auto dyw = widen(dy);
    for (std::size_t i = 0; i < n; ++i) {
      double const e = std::exp(-std::fabs(xw[i]));  // sigmoid'(x) = e^-|x| / (1 + e^-|x|)^2
      dref[i] = dyw[i] * (neg ? 2.0 : 1.0) * e / ((1 + e) * (1 + e));
    }
    check_close(widen(dx), dref, tol, 1e-30, "dbeta_raw");
  }
}

TEST_CASE("beta sigmoid backward matches finite differences (double)") {
  for (bool neg : {false, true}) {
    index_t const n = 40;
    auto x = randn(n, 31, 3.0);
    auto w = randn(n, 32);
    std::vector<double> dx(n);
    k3::kda::beta_sigmoid_backward(
        serial, k3::kda::beta_sigmoid_backward_args<double, 1>{.x = k3::host_view(x.data(), n), .d_beta = k3::host_view(w.data(), n), .d_x = k3::host_view(dx.data(), n)},
        {.allow_neg_eigval = neg});
    auto loss = [&] {
      double s = 0;
      for (index_t i = 0; i < n; ++i) s += w[i] * (neg ? 2.0 : 1.0) * ref_sigmoid(x[i]);
      return s;
    };
    check_fd(x, dx, loss, "dx");
  }
}

// ---- gates -----------------------------------------------------------------------------

namespace {

struct gate_case {
  bool lower;
  bool with_A;
  bool with_bias;
  double lb;
};

// Runs the forward of one gate kind on double/float/bfloat16 storage for x and g with
// float parameters, against the float64 reference.
template <class S>
void gate_forward_case(gate_case gc) {
  index_t const B = 2, T = 11, HV = 3, K = 20;
  std::size_t const n = static_cast<std::size_t>(B * T * HV * K);
  auto xd = randn(n, 41, 3.0);
  xd[0] = 60.0;
  xd[1] = -60.0;
  auto x = cast<S>(xd);
  auto A = cast<float>(randn(HV, 42, 0.8));
  auto bias = cast<float>(randn(static_cast<std::size_t>(HV * K), 43, 0.5));
  std::vector<S> g(n);
  auto xv = k3::host_view(x.data(), B, T, HV, K);
  auto gv = k3::host_view(g.data(), B, T, HV, K);
  auto Av = k3::host_view(A.data(), HV);
  auto bv = k3::host_view(bias.data(), HV, K);
  // An absent parameter is a default-constructed view.
  auto run = [&](k3::tensor_view<float const, 1> Aarg, k3::tensor_view<float const, 2> barg) {
    k3::kda::gate_args<S, float> const args{.x = xv, .A_log = Aarg, .dt_bias = barg, .g = gv};
    if (gc.lower)
      k3::kda::gate_lower_bound(serial, args, {.lower_bound = gc.lb});
    else
      k3::kda::gate_softplus(serial, args);
  };
  if (gc.with_A && gc.with_bias) run(Av, bv);
  if (gc.with_A && !gc.with_bias) run(Av, {});
  if (!gc.with_A && gc.with_bias) run({}, bv);
  if (!gc.with_A && !gc.with_bias) run({}, {});
  auto ref = ref_gate(gc.lower, widen(x), gc.with_A ? widen(A) : std::vector<double>{},
                      gc.with_bias ? widen(bias) : std::vector<double>{}, gc.lb, HV, K);
  // double math on float parameters is exact; float math: a few ulps of exp/log1p.
  double const tol = std::is_same_v<S, double> ? 1e-14 : std::is_same_v<S, float> ? 3e-6 : 8e-3;
  double const atol = std::is_same_v<S, double> ? 1e-300 : 1e-37;  // below that float flushes towards 0
  check_close(widen(g), ref, tol, atol, gc.lower ? "lower-bound gate" : "softplus gate");
  // lb as the math sees it: exact in double, rounded to float (then to storage) otherwise
  double const lb_seen = std::is_same_v<S, double> ? gc.lb : k3::load_as<double>(k3::store_as<S>(static_cast<float>(gc.lb)));
  for (auto v : widen(g)) {
    CHECK(v <= 0.0);
    if (gc.lower) CHECK(v >= lb_seen);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("gates forward match the float64 reference", S, double, float, bfloat16) {
  for (bool lower : {false, true})
    for (bool A : {false, true})
      for (bool b : {false, true})
        for (double lb : {-5.0, -1.0, -0.001}) {
          if (!lower && lb != -5.0) continue;
          CAPTURE(lower);
          CAPTURE(A);
          CAPTURE(b);
          CAPTURE(lb);
          gate_forward_case<S>({lower, A, b, lb});
        }
}

TEST_CASE("gate backwards match finite differences in x, A_log and dt_bias (double)") {
  index_t const B = 2, T = 5, HV = 3, K = 7;
  std::size_t const n = static_cast<std::size_t>(B * T * HV * K);
  for (bool lower : {false, true}) {
    CAPTURE(lower);
    double const lb = -5.0;
    auto x = randn(n, 51, 2.0);
    auto A = randn(HV, 52, 0.5);
    auto bias = randn(static_cast<std::size_t>(HV * K), 53, 0.5);
    auto w = randn(n, 54);
    std::vector<double> dx(n), dA(HV), db(static_cast<std::size_t>(HV * K));
    auto xv = k3::host_view(x.data(), B, T, HV, K);
    auto wv = k3::host_view(w.data(), B, T, HV, K);
    auto dxv = k3::host_view(dx.data(), B, T, HV, K);
    k3::kda::gate_backward_args<double> const args{.x = xv, .A_log = k3::host_view(A.data(), HV), .dt_bias = k3::host_view(bias.data(), HV, K),
                                                   .d_g = wv, .d_x = dxv, .d_A_log = k3::host_view(dA.data(), HV),
                                                   .d_dt_bias = k3::host_view(db.data(), HV, K)};
    if (lower)
      k3::kda::gate_lower_bound_backward(serial, args, {.lower_bound = lb});
    else
      k3::kda::gate_softplus_backward(serial, args);
    auto loss = [&] { return dot(w, ref_gate(lower, x, A, bias, lb, HV, K)); };
    check_fd(x, dx, loss, "dx");
    check_fd(A, dA, loss, "dA_log");
    check_fd(bias, db, loss, "ddt_bias");

    // Without parameters: gradients at A_log = 0, dt_bias = 0.
    std::vector<double> dx0(n), dA0(HV), db0(static_cast<std::size_t>(HV * K));
    k3::kda::gate_backward_args<double> const args0{.x = xv, .d_g = wv, .d_x = k3::host_view(dx0.data(), B, T, HV, K),
                                                    .d_A_log = k3::host_view(dA0.data(), HV), .d_dt_bias = k3::host_view(db0.data(), HV, K)};
    if (lower)
      k3::kda::gate_lower_bound_backward(serial, args0, {.lower_bound = lb});
    else
      k3::kda::gate_softplus_backward(serial, args0);
    std::vector<double> A0(HV, 0.0), b0(static_cast<std::size_t>(HV * K), 0.0);
    auto loss0 = [&] { return dot(w, ref_gate(lower, x, A0, b0, lb, HV, K)); };
    check_fd(x, dx0, loss0, "dx (no params)");
    check_fd(A0, dA0, loss0, "dA_log at 0");
    check_fd(b0, db0, loss0, "ddt_bias at 0");
  }
}

TEST_CASE("gate backward in float and bfloat16 storage against double") {
  index_t const B = 1, T = 300, HV = 2, K = 16;  // > one reduction block of rows
  std::size_t const n = static_cast<std::size_t>(B * T * HV * K);
  auto xd = randn(n, 61, 2.0);
  auto Ad = randn(HV, 62, 0.5);
  auto bd = randn(static_cast<std::size_t>(HV * K), 63, 0.5);
  auto wd = randn(n, 64);
  for (bool lower : {false, true}) {
    auto x = cast<bfloat16>(xd);
    auto w = cast<bfloat16>(wd);
    auto xw = widen(x), ww = widen(w);
    auto Af = cast<float>(Ad), bf = cast<float>(bd);
    auto Aw = widen(Af), bw = widen(bf);
    // reference: double math on the same (bf16 / fp32 rounded) inputs
    std::vector<double> dxr(n), dAr(HV), dbr(static_cast<std::size_t>(HV * K));
    k3::kda::gate_backward_args<double> const ref_args{
        .x = k3::host_view(xw.data(), B, T, HV, K), .A_log = k3::host_view(Aw.data(), HV), .dt_bias = k3::host_view(bw.data(), HV, K),
        .d_g = k3::host_view(ww.data(), B, T, HV, K), .d_x = k3::host_view(dxr.data(), B, T, HV, K),
        .d_A_log = k3::host_view(dAr.data(), HV), .d_dt_bias = k3::host_view(dbr.data(), HV, K)};
    if (lower)
      k3::kda::gate_lower_bound_backward(serial, ref_args, {.lower_bound = -5.0});
    else
      k3::kda::gate_softplus_backward(serial, ref_args);
    std::vector<bfloat16> dxb(n);
    std::vector<float> dAf(HV), dbf(static_cast<std::size_t>(HV * K));
    // bfloat16 activations with fp32 parameters and parameter gradients
    k3::kda::gate_backward_args<bfloat16, float> const args{
        .x = k3::host_view(x.data(), B, T, HV, K), .A_log = k3::host_view(Af.data(), HV), .dt_bias = k3::host_view(bf.data(), HV, K),
        .d_g = k3::host_view(w.data(), B, T, HV, K), .d_x = k3::host_view(dxb.data(), B, T, HV, K),
        .d_A_log = k3::host_view(dAf.data(), HV), .d_dt_bias = k3::host_view(dbf.data(), HV, K)};
    if (lower)
      k3::kda::gate_lower_bound_backward(serial, args, {.lower_bound = -5.0});
    else
      k3::kda::gate_softplus_backward(serial, args);
    check_close(widen(dxb), dxr, 8e-3, 1e-30, "dx bf16");
    // parameter grads are sums over tokens accumulated in double from fp32 terms
    check_close(widen(dAf), dAr, 1e-5, 1e-6, "dA_log fp32 from bf16 storage");
    check_close(widen(dbf), dbr, 1e-5, 1e-6, "ddt_bias fp32 from bf16 storage");
  }
}

TEST_CASE("serial and threads give bitwise the same results, gradients included") {
  k3::cpu::threads<> th(3);
  index_t const B = 2, T = 333, HV = 4, K = 24;
  std::size_t const n = static_cast<std::size_t>(B * T * HV * K);
  auto x = cast<float>(randn(n, 71, 2.0));
  auto w = cast<float>(randn(n, 72));
  auto A = cast<float>(randn(HV, 73, 0.5));
  auto bias = cast<float>(randn(static_cast<std::size_t>(HV * K), 74, 0.5));
  auto xv = k3::host_view(x.data(), B, T, HV, K);
  auto wv = k3::host_view(w.data(), B, T, HV, K);
  auto Av = k3::host_view(A.data(), HV);
  auto bv = k3::host_view(bias.data(), HV, K);
  auto both = [&](auto&& f) {
    std::vector<float> o1(n), o2(n), a1(HV), a2(HV), b1(bias.size()), b2(bias.size());
    f(serial, o1, a1, b1);
    f(th, o2, a2, b2);
    CHECK(o1 == o2);
    CHECK(a1 == a2);
    CHECK(b1 == b2);
  };
  both([&](auto const& bk, auto& o, auto&, auto&) { k3::kda::l2norm(bk, k3::kda::l2norm_args<float>{.x = xv, .y = k3::host_view(o.data(), B, T, HV, K)}); });
  both([&](auto const& bk, auto& o, auto&, auto&) {
    k3::kda::l2norm_backward(bk, k3::kda::l2norm_backward_args<float>{.x = xv, .d_y = wv, .d_x = k3::host_view(o.data(), B, T, HV, K)});
  });
  both([&](auto const& bk, auto& o, auto&, auto&) {
    k3::kda::beta_sigmoid(bk, k3::kda::beta_sigmoid_args<float, 4>{.x = xv, .beta = k3::host_view(o.data(), B, T, HV, K)}, {.allow_neg_eigval = true});
  });
  both([&](auto const& bk, auto& o, auto&, auto&) {
    k3::kda::gate_softplus(bk, k3::kda::gate_args<float>{.x = xv, .A_log = Av, .dt_bias = bv, .g = k3::host_view(o.data(), B, T, HV, K)});
  });
  both([&](auto const& bk, auto& o, auto& a, auto& b) {
    k3::kda::gate_softplus_backward(bk, k3::kda::gate_backward_args<float>{.x = xv, .A_log = Av, .dt_bias = bv, .d_g = wv,
                                                                          .d_x = k3::host_view(o.data(), B, T, HV, K),
                                                                          .d_A_log = k3::host_view(a.data(), HV),
                                                                          .d_dt_bias = k3::host_view(b.data(), HV, K)});
  });
  both([&](auto const& bk, auto& o, auto& a, auto& b) {
    k3::kda::gate_lower_bound_backward(bk,
                                       k3::kda::gate_backward_args<float>{.x = xv, .A_log = Av, .dt_bias = bv, .d_g = wv,
                                                                          .d_x = k3::host_view(o.data(), B, T, HV, K),
                                                                          .d_A_log = k3::host_view(a.data(), HV),
                                                                          .d_dt_bias = k3::host_view(b.data(), HV, K)},
                                       {.lower_bound = -3.0});
  });
}

TEST_CASE("memory tuning (streaming stores) never changes the gate backward's numbers") {
  // Cache-line aligned rows (K = 48): d_x streamed when tuning asks for it, with and without
  // the parameter gradients (two different loops), against a call that never streams.
  k3::cpu::threads<> th(3);
  index_t const B = 2, T = 301, HV = 3, K = 48;
  std::size_t const n = static_cast<std::size_t>(B * T * HV * K);
  using aligned = std::vector<float, xsimd::aligned_allocator<float, 64>>;
  auto fill = [](std::size_t m, std::uint64_t seed, double scale) {
    auto v = cast<float>(randn(m, seed, scale));
    return aligned(v.begin(), v.end());
  };
  aligned const x = fill(n, 61, 2.0), dg = fill(n, 62, 1.0), A = fill(HV, 63, 0.5), bias = fill(static_cast<std::size_t>(HV * K), 64, 0.5);
  k3::kda::preprocess_tuning const plain{.prefetch_rows = 0, .stream_min_bytes = ~std::size_t{0}};
  k3::kda::preprocess_tuning const tuned{.prefetch_rows = 3, .stream_min_bytes = 0};
  auto run = [&](auto const& bk, k3::kda::preprocess_tuning const& tune, bool params) {
    aligned dx(n, -1.0f), dA(HV, -1.0f), db(bias.size(), -1.0f);
    k3::kda::gate_backward_args<float> args{.x = k3::host_view(x.data(), B, T, HV, K), .A_log = k3::host_view(A.data(), HV),
                                            .dt_bias = k3::host_view(bias.data(), HV, K), .d_g = k3::host_view(dg.data(), B, T, HV, K),
                                            .d_x = k3::host_view(dx.data(), B, T, HV, K)};
    if (params) {
      args.d_A_log = k3::host_view(dA.data(), HV);
      args.d_dt_bias = k3::host_view(db.data(), HV, K);
    }
    k3::kda::gate_lower_bound_backward(bk, args, {.lower_bound = -5.0, .tuning = tune});
    return std::vector<aligned>{dx, dA, db};
  };
  for (bool params : {true, false}) {
    CAPTURE(params);
    auto const ref = run(serial, plain, params);
    CHECK(run(serial, tuned, params) == ref);
    CHECK(run(th, tuned, params) == ref);
  }
}

TEST_CASE("a NaN stays in its element or row") {
  index_t const R = 4, D = 8;
  std::vector<double> x = randn(R * D, 81), y(R * D), g(R * D);
  x[static_cast<std::size_t>(1 * D + 3)] = std::numeric_limits<double>::quiet_NaN();
  k3::kda::l2norm(serial, k3::kda::l2norm_args<double, 2>{.x = k3::host_view(x.data(), R, D), .y = k3::host_view(y.data(), R, D)});
  for (index_t r = 0; r < R; ++r)
    for (index_t d = 0; d < D; ++d) CHECK(std::isnan(y[static_cast<std::size_t>(r * D + d)]) == (r == 1));
  k3::kda::gate_softplus(serial, k3::kda::gate_args<double>{.x = k3::host_view(x.data(), 1, R, 1, D), .g = k3::host_view(g.data(), 1, R, 1, D)});
  for (std::size_t i = 0; i < g.size(); ++i) CHECK(std::isnan(g[i]) == (i == static_cast<std::size_t>(D + 3)));
}

TEST_CASE("bad input names the argument") {
  std::vector<float> x(2 * 3 * 4 * 5), g(2 * 3 * 4 * 5), A(4), bias(20), big(200);
  auto xv = k3::host_view(x.data(), 2, 3, 4, 5);
  auto gv = k3::host_view(g.data(), 2, 3, 4, 5);
  auto has = [](std::string const& m, char const* s) {
    INFO(m);
    CHECK(m.find(s) != std::string::npos);
  };
  using k3::kda::gate_args;
  using k3::kda::gate_backward_args;
  has(k3::test::error_of([&] { k3::kda::l2norm(serial, k3::kda::l2norm_args<float>{.x = xv, .y = k3::host_view(g.data(), 2, 3, 5, 4)}); }), "'y'");
  has(k3::test::error_of([&] { k3::kda::l2norm(serial, k3::kda::l2norm_args<float>{.x = xv, .y = xv}); }), "overlap");
  has(k3::test::error_of([&] {
        k3::kda::l2norm_backward(serial, k3::kda::l2norm_backward_args<float>{.x = xv, .d_y = k3::host_view(big.data(), 2, 3, 4, 6), .d_x = gv});
      }),
      "'d_y'");
  has(k3::test::error_of([&] {
        k3::kda::beta_sigmoid(serial, k3::kda::beta_sigmoid_args<float, 2>{.x = k3::host_view(x.data(), 6, 4), .beta = k3::host_view(g.data(), 4, 6)});
      }),
      "'beta'");
  has(k3::test::error_of([&] { k3::kda::gate_softplus(serial, gate_args<float>{.x = xv, .A_log = k3::host_view(A.data(), 3), .g = gv}); }), "'A_log'");
  has(k3::test::error_of([&] { k3::kda::gate_softplus(serial, gate_args<float>{.x = xv, .dt_bias = k3::host_view(bias.data(), 5, 4), .g = gv}); }),
      "'dt_bias'");
  has(k3::test::error_of([&] { k3::kda::gate_softplus(serial, gate_args<float>{.x = xv, .g = k3::host_view(g.data(), 2, 3, 4, 4)}); }), "'g'");
  for (double lb : {0.0, 0.5, -5.0001, -100.0, std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(lb);
    has(k3::test::error_of([&] { k3::kda::gate_lower_bound(serial, gate_args<float>{.x = xv, .g = gv}, {.lower_bound = lb}); }), "'lower_bound'");
    has(k3::test::error_of([&] {
          k3::kda::gate_lower_bound_backward(serial, gate_backward_args<float>{.x = xv, .d_g = xv, .d_x = gv}, {.lower_bound = lb});
        }),
        "'lower_bound'");
  }
  CHECK_NOTHROW(k3::kda::gate_lower_bound(serial, gate_args<float>{.x = xv, .g = gv}, {.lower_bound = -5.0}));
  has(k3::test::error_of([&] {
        k3::kda::gate_softplus_backward(serial, gate_backward_args<float>{.x = xv, .d_g = xv, .d_x = gv, .d_A_log = k3::host_view(A.data(), 2)});
      }),
      "'d_A_log'");
  has(k3::test::error_of([&] {
        k3::kda::gate_softplus_backward(serial,
                                        gate_backward_args<float>{.x = xv, .d_g = xv, .d_x = gv, .d_dt_bias = k3::host_view(bias.data(), 4, 4)});
      }),
      "'d_dt_bias'");
  has(k3::test::error_of([&] {
        k3::kda::gate_softplus_backward(serial, gate_backward_args<float>{.x = xv, .d_g = k3::host_view(big.data(), 2, 3, 4, 6), .d_x = gv});
      }),
      "'d_g'");
  has(k3::test::error_of([&] { k3::kda::gate_softplus_backward(serial, gate_backward_args<float>{.x = xv, .d_g = gv, .d_x = xv}); }), "overlap");
}

// ---- the call shape: op(backend, args, options = {}) ------------------------------------------

namespace {

namespace kda = k3::kda;

template <class Bk, class A>
constexpr bool takes_short_conv = requires(Bk const& b, A const& a) { kda::short_conv(b, a, kda::short_conv_options{}); };
template <class Bk, class A>
constexpr bool takes_short_conv_backward = requires(Bk const& b, A const& a) { kda::short_conv_backward(b, a); };
template <class Bk, class A>
constexpr bool takes_short_conv_decode = requires(Bk const& b, A const& a) { kda::short_conv_decode(b, a); };
template <class Bk, class A>
constexpr bool takes_l2norm = requires(Bk const& b, A const& a) { kda::l2norm(b, a); };
template <class Bk, class A>
constexpr bool takes_l2norm_backward = requires(Bk const& b, A const& a) { kda::l2norm_backward(b, a); };
template <class Bk, class A>
constexpr bool takes_beta_sigmoid = requires(Bk const& b, A const& a) { kda::beta_sigmoid(b, a, {.allow_neg_eigval = true}); };
template <class Bk, class A>
constexpr bool takes_beta_sigmoid_backward = requires(Bk const& b, A const& a) { kda::beta_sigmoid_backward(b, a); };
template <class Bk, class A>
constexpr bool takes_gates = requires(Bk const& b, A const& a) {
  kda::gate_softplus(b, a);
  kda::gate_lower_bound(b, a, {.lower_bound = -5});
};
template <class Bk, class A>
constexpr bool takes_gate_backwards = requires(Bk const& b, A const& a) {
  kda::gate_softplus_backward(b, a);
  kda::gate_lower_bound_backward(b, a, {.lower_bound = -5});
};

template <class Bk, class In, class P = In>
constexpr bool takes_all() {
  return takes_short_conv<Bk, kda::short_conv_args<In, P>> && takes_short_conv_backward<Bk, kda::short_conv_backward_args<In, P>> &&
         takes_short_conv_decode<Bk, kda::short_conv_decode_args<In, P>> && takes_l2norm<Bk, kda::l2norm_args<In>> &&
         takes_l2norm<Bk, kda::l2norm_args<In, 2>> && takes_l2norm_backward<Bk, kda::l2norm_backward_args<In>> &&
         takes_beta_sigmoid<Bk, kda::beta_sigmoid_args<In>> && takes_beta_sigmoid_backward<Bk, kda::beta_sigmoid_backward_args<In, 1>> &&
         takes_gates<Bk, kda::gate_args<In, P>> && takes_gate_backwards<Bk, kda::gate_backward_args<In, P>>;
}

static_assert(std::is_aggregate_v<kda::short_conv_args<float>> && std::is_aggregate_v<kda::short_conv_backward_args<float>> &&
              std::is_aggregate_v<kda::short_conv_decode_args<float>> && std::is_aggregate_v<kda::l2norm_args<float>> &&
              std::is_aggregate_v<kda::l2norm_backward_args<float>> && std::is_aggregate_v<kda::beta_sigmoid_args<float>> &&
              std::is_aggregate_v<kda::beta_sigmoid_backward_args<float>> && std::is_aggregate_v<kda::gate_args<float>> &&
              std::is_aggregate_v<kda::gate_backward_args<float>> && std::is_aggregate_v<kda::short_conv_options> &&
              std::is_aggregate_v<kda::gate_options> && std::is_aggregate_v<kda::beta_sigmoid_options>);
static_assert(takes_all<k3::cpu::serial, float>() && takes_all<k3::cpu::simd<>, float>() && takes_all<k3::cpu::threads<>, float>());
static_assert(takes_all<k3::cpu::serial, double>() && takes_all<k3::cpu::threads<>, bfloat16>());
// Mixed storage: bfloat16 activations with fp32 parameters and states.
static_assert(takes_all<k3::cpu::serial, bfloat16, float>() && takes_all<k3::cpu::simd<>, bfloat16, float>());
// One op's args are not another's, and nothing positional remains.
static_assert(!takes_short_conv<k3::cpu::serial, kda::short_conv_backward_args<float>>);
static_assert(!takes_l2norm<k3::cpu::serial, kda::short_conv_args<float>>);
static_assert(!takes_gates<k3::cpu::serial, kda::gate_backward_args<float>>);
template <class Bk, class X, class Y>
constexpr bool takes_positional_l2norm = requires(Bk const& b, X const& x, Y const& y) { kda::l2norm(b, x, y); };
static_assert(!takes_positional_l2norm<k3::cpu::serial, k3::tensor_view<float const, 4>, k3::tensor_view<float, 4>>);
// A rank-2 view is not short_conv's x (the decode step takes [N, C]; the prefill [B, T, C]).
template <class V>
constexpr bool conv_x_takes = requires(V v) { kda::short_conv_args<float>{.x = v}; };
template <class V>
constexpr bool decode_x_takes = requires(V v) { kda::short_conv_decode_args<float>{.x = v}; };
static_assert(!conv_x_takes<k3::tensor_view<float const, 2>> && conv_x_takes<k3::tensor_view<float, 3>>);
static_assert(decode_x_takes<k3::tensor_view<float const, 2>> && !decode_x_takes<k3::tensor_view<float const, 3>>);

}  // namespace

TEST_CASE("the args call shape: optional members absent by default, misuse named by the args member") {
  index_t const B = 1, T = 6, C = 5, W = 4;
  std::vector<float> x(static_cast<std::size_t>(B * T * C), 0.5f), w(static_cast<std::size_t>(C * W), 0.25f), y(x.size()), y2(x.size());
  std::vector<float> s0(static_cast<std::size_t>(2 * C * (W - 1)), 1.0f), ds0(s0.size()), dx(x.size());
  std::vector<std::int32_t> cu = {0, 2, 6};
  auto xv = k3::host_view(x.data(), B, T, C);
  auto wv = k3::host_view(w.data(), C, W);
  // silu = false is the bare convolution: 4 taps of 0.25 * 0.5 once the window is inside x.
  kda::short_conv(serial, kda::short_conv_args<float>{.x = xv, .weight = wv, .y = k3::host_view(y.data(), B, T, C)}, {.silu = false});
  CHECK(y.back() == doctest::Approx(0.5));
  kda::short_conv(serial, kda::short_conv_args<float>{.x = xv, .weight = wv, .y = k3::host_view(y2.data(), B, T, C)});
  CHECK(y2.back() == doctest::Approx(0.5 / (1.0 + std::exp(-0.5))));
  // Packed sequences through the options (int32 offsets): the second sequence starts afresh.
  kda::short_conv(serial, kda::short_conv_args<float>{.x = xv, .weight = wv, .y = k3::host_view(y.data(), B, T, C)},
                  {.cu_seqlens = k3::host_view(cu.data(), 3), .silu = false});
  CHECK(y[static_cast<std::size_t>(2 * C)] == doctest::Approx(0.125));
  auto has = [](std::string const& m, char const* s) {
    INFO(m);
    CHECK(m.find(s) != std::string::npos);
  };
  has(k3::test::error_of([&] {
        kda::short_conv_backward(serial, kda::short_conv_backward_args<float>{.x = xv, .weight = wv, .d_y = xv, .d_x = k3::host_view(dx.data(), B, T, C),
                                                                              .d_initial_state = k3::host_view(ds0.data(), 1, C, W - 1)});
      }),
      "argument 'd_initial_state': needs the initial_state");
  has(k3::test::error_of([&] {
        kda::short_conv_backward(serial, kda::short_conv_backward_args<float>{.x = xv, .weight = wv, .d_y = xv, .d_x = k3::host_view(dx.data(), B, T, C - 1)});
      }),
      "argument 'd_x'");
  std::vector<float> pool(static_cast<std::size_t>(2 * C * (W - 1))), yd(static_cast<std::size_t>(2 * C));
  std::vector<std::int32_t> s32 = {1, 0};
  std::vector<std::int64_t> s64 = {1, 0};
  kda::short_conv_decode_args<float> const dec{.x = k3::host_view(x.data(), 2, C), .weight = wv, .conv_state = k3::host_view(pool.data(), 2, C, W - 1),
                                               .y = k3::host_view(yd.data(), 2, C), .slots32 = k3::host_view(s32.data(), 2)};
  CHECK_NOTHROW(kda::short_conv_decode(serial, dec));
  has(k3::test::error_of([&] { kda::short_conv_decode(serial, dec, {.cu_seqlens = k3::host_view(cu.data(), 3)}); }), "option 'cu_seqlens'");
  auto both_slots = dec;
  both_slots.slots64 = k3::host_view(s64.data(), 2);
  has(k3::test::error_of([&] { kda::short_conv_decode(serial, both_slots); }), "at most one of slots32");
  s32[0] = 0;
  has(k3::test::error_of([&] { kda::short_conv_decode(serial, dec); }), "argument 'slots32': slot 0 appears twice");
}
