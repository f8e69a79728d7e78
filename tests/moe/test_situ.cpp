#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/moe/situ.hpp"

namespace moe = k3::moe;
using k3::index_t;

TEST_CASE("SiTU-GLU reference values (spec C.1) and its negative tail") {
  struct row {
    double g, u, v, dg, du;
  };
  row const rows[] = {{0.5, 1.0, 0.309453721, 0.729338555, 0.309123883},
                      {2.0, -3.0, -4.86106655, -2.64763816, 1.60490401},
                      {10, 100, 98.5907816, 0.668805433, 0.00529176422},
                      {-10, 5, -0.000884047738, -0.000878050667, -0.000172181177},
                      {-3, 2, -0.240467171, -0.172596011, -0.119722117}};
  for (auto const& r : rows) {
    auto gr = moe::situ_glu_grad(r.g, r.u);
    CHECK(gr.value == doctest::Approx(r.v).epsilon(1e-8));
    CHECK(moe::situ_glu(r.g, r.u) == doctest::Approx(r.v).epsilon(1e-8));
    CHECK(gr.d_gate == doctest::Approx(r.dg).epsilon(1e-8));
    CHECK(gr.d_up == doctest::Approx(r.du).epsilon(1e-8));
  }
  auto lim = moe::situ_glu_grad(1000.0, 1000.0);
  CHECK(lim.value == doctest::Approx(100.0));
  CHECK(std::fabs(lim.d_gate) < 1e-12);
  CHECK(std::fabs(lim.d_up) < 1e-12);
  // silu(softcap(g)) would give -0.369 here
  CHECK(std::fabs(moe::situ_glu(-10.0, 5.0)) < 1e-3);
  // float instantiation agrees
  CHECK(moe::situ_glu(2.0f, -3.0f) == doctest::Approx(-4.86106655).epsilon(1e-6));
  // the caps are parameters; large caps approach SwiGLU
  moe::situ_params<double> wide{1e4, 1e4};
  CHECK(moe::situ_glu(2.0, -3.0, wide) == doctest::Approx(-3.0 * 2.0 / (1 + std::exp(-2.0))).epsilon(1e-6));
}

TEST_CASE("SiTU-GLU gradients match central finite differences (double)") {
  std::mt19937_64 g(3);
  std::uniform_real_distribution<double> u(-12, 12);
  for (int t = 0; t < 200; ++t) {
    double x = u(g), y = 3 * u(g);
    moe::situ_params<double> c{2 + std::fabs(u(g)) / 3, 10 + std::fabs(u(g))};
    auto gr = moe::situ_glu_grad(x, y, c);
    double const h = 1e-6;
    auto f = [&](double a, double b, double b1, double b2) { return moe::situ_glu(a, b, moe::situ_params<double>{b1, b2}); };
    double fg = (f(x + h, y, c.beta1, c.beta2) - f(x - h, y, c.beta1, c.beta2)) / (2 * h);
    double fu = (f(x, y + h, c.beta1, c.beta2) - f(x, y - h, c.beta1, c.beta2)) / (2 * h);
    double f1 = (f(x, y, c.beta1 + h, c.beta2) - f(x, y, c.beta1 - h, c.beta2)) / (2 * h);
    double f2 = (f(x, y, c.beta1, c.beta2 + h) - f(x, y, c.beta1, c.beta2 - h)) / (2 * h);
    CHECK(gr.d_gate == doctest::Approx(fg).epsilon(1e-6).scale(1.0));
    CHECK(gr.d_up == doctest::Approx(fu).epsilon(1e-6).scale(1.0));
    CHECK(gr.d_beta1 == doctest::Approx(f1).epsilon(1e-6).scale(1.0));
    CHECK(gr.d_beta2 == doctest::Approx(f2).epsilon(1e-6).scale(1.0));
  }
}

namespace {

struct ffn_case {
  index_t Tn, d, f, E, K;
  std::vector<double> x, p, wg, wu, wd, bd, dO;
  std::vector<std::int32_t> idx;
  moe::situ_params<double> act{};
  bool bias;

  ffn_case(index_t Tn_, index_t d_, index_t f_, index_t E_, index_t K_, bool bias_, std::uint64_t seed)
      : Tn(Tn_), d(d_), f(f_), E(E_), K(K_), bias(bias_) {
    std::mt19937_64 g(seed);
    std::normal_distribution<double> nd;
    auto fill = [&](std::vector<double>& v, index_t n, double sc) {
      v.resize(static_cast<std::size_t>(n));
      for (auto& z : v) z = sc * nd(g);
    };
    fill(x, Tn * d, 1.0);
    fill(wg, E * d * f, 1.0);
    fill(wu, E * d * f, 2.0);
    fill(wd, E * f * d, 0.5);
    fill(bd, bias ? E * d : 0, 0.7);
    fill(dO, Tn * d, 1.0);
    p.resize(static_cast<std::size_t>(Tn * K));
    idx.resize(static_cast<std::size_t>(Tn * K));
    std::uniform_real_distribution<double> ud(0.05, 1.0);
    for (index_t t = 0; t < Tn; ++t) {
      std::vector<std::int32_t> perm(static_cast<std::size_t>(E));
      for (index_t e = 0; e < E; ++e) perm[e] = static_cast<std::int32_t>(e);
      std::shuffle(perm.begin(), perm.end(), g);
      for (index_t r = 0; r < K; ++r) {
        idx[t * K + r] = perm[r];
        p[t * K + r] = ud(g);
      }
    }
    p[0] = 0.0;                     // a selected expert with p = 0 keeps its id and gets dp
    if (Tn > 1) idx[K + K - 1] = -1;  // a dropped slot
  }
  moe::expert_ffn_args<double> args(k3::tensor_view<double, 2> o, k3::tensor_view<double, 3> hg, k3::tensor_view<double, 3> hu,
                                     k3::tensor_view<double, 3> y = {}) const {
    return {.x = {x.data(), {Tn, d}},
            .idx = {idx.data(), {Tn, K}},
            .p = {p.data(), {Tn, K}},
            .w_gate = {wg.data(), {E, d, f}},
            .w_up = {wu.data(), {E, d, f}},
            .w_down = {wd.data(), {E, f, d}},
            .b_down = bias ? k3::const_view<double, 2>(bd.data(), {E, d}) : k3::const_view<double, 2>{},
            .o = o,
            .h_gate = hg,
            .h_up = hu,
            .y = y};
  }
  moe::expert_ffn_options<double> options() const { return {.act = act}; }
  double loss() const {
    std::vector<double> o(static_cast<std::size_t>(Tn * d)), hg(static_cast<std::size_t>(Tn * K * f)), hu(hg.size());
    moe::expert_ffn_forward(k3::cpu::serial{}, args(k3::host_view(o.data(), Tn, d), k3::host_view(hg.data(), Tn, K, f), k3::host_view(hu.data(), Tn, K, f)),
                            options());
    double L = 0;
    for (std::size_t i = 0; i < o.size(); ++i) L += o[i] * dO[i];
    return L;
  }
};

struct grads {
  std::vector<double> dx, dp, dwg, dwu, dwd, dbd;
  double d_beta1 = 0, d_beta2 = 0;
  ffn_case const& c;
  grads(ffn_case const& c_)
      : dx(static_cast<std::size_t>(c_.Tn * c_.d)), dp(static_cast<std::size_t>(c_.Tn * c_.K)), dwg(c_.wg.size()), dwu(c_.wu.size()),
        dwd(c_.wd.size()), dbd(c_.bd.size()), c(c_) {}
  // The backward's args: the case's inputs, the forward's cache (and y for the naive d_p), these gradients.
  moe::expert_ffn_backward_args<double> args(k3::const_view<double, 3> hg, k3::const_view<double, 3> hu, k3::const_view<double, 3> y = {}) {
    auto const a = c.args({}, {}, {});
    return {.x = a.x,
            .idx = a.idx,
            .p = a.p,
            .w_gate = a.w_gate,
            .w_up = a.w_up,
            .w_down = a.w_down,
            .b_down = a.b_down,
            .h_gate = hg,
            .h_up = hu,
            .y = y,
            .d_o = {c.dO.data(), {c.Tn, c.d}},
            .d_x = k3::host_view(dx.data(), c.Tn, c.d),
            .d_p = k3::host_view(dp.data(), c.Tn, c.K),
            .d_w_gate = k3::host_view(dwg.data(), c.E, c.d, c.f),
            .d_w_up = k3::host_view(dwu.data(), c.E, c.d, c.f),
            .d_w_down = k3::host_view(dwd.data(), c.E, c.f, c.d),
            .d_b_down = c.bias ? k3::host_view(dbd.data(), c.E, c.d) : k3::tensor_view<double, 2>{},
            .d_beta1 = &d_beta1,
            .d_beta2 = &d_beta2};
  }
};

void check_fd(ffn_case& c, std::vector<double>& param, std::vector<double> const& grad, char const* name) {
  double const h = 1e-6;
  for (std::size_t i = 0; i < param.size(); ++i) {
    double keep = param[i];
    param[i] = keep + h;
    double lp = c.loss();
    param[i] = keep - h;
    double lm = c.loss();
    param[i] = keep;
    double fd = (lp - lm) / (2 * h);
    INFO(name << "[" << i << "]");
    CHECK(grad[i] == doctest::Approx(fd).epsilon(1e-6).scale(1.0));
  }
}

}  // namespace

TEST_CASE("expert FFN: dp without stored outputs equals the naive <dO, y>, and all grads match finite differences") {
  for (bool bias : {true, false}) {
    ffn_case c(5, 6, 4, 4, 2, bias, bias ? 11 : 12);
    index_t const Tn = c.Tn, d = c.d, f = c.f, K = c.K;
    std::vector<double> o(static_cast<std::size_t>(Tn * d)), hg(static_cast<std::size_t>(Tn * K * f)), hu(hg.size()),
        y(static_cast<std::size_t>(Tn * K * d));
    moe::expert_ffn_forward(k3::cpu::serial{},
                            c.args(k3::host_view(o.data(), Tn, d), k3::host_view(hg.data(), Tn, K, f), k3::host_view(hu.data(), Tn, K, f),
                                   k3::host_view(y.data(), Tn, K, d)),
                            c.options());
    grads fast(c), naive(c);
    k3::const_view<double, 3> hgv(hg.data(), {Tn, K, f}), huv(hu.data(), {Tn, K, f}), yv(y.data(), {Tn, K, d});
    moe::expert_ffn_backward(k3::cpu::serial{}, fast.args(hgv, huv), c.options());
    moe::expert_ffn_backward(k3::cpu::serial{}, naive.args(hgv, huv, yv), c.options());  // d_p from the stored y
    for (std::size_t i = 0; i < fast.dp.size(); ++i) CHECK(fast.dp[i] == doctest::Approx(naive.dp[i]).epsilon(1e-12).scale(1e-12));
    CHECK(fast.dx == naive.dx);
    CHECK(fast.dwd == naive.dwd);
    CHECK(std::fabs(fast.dp[0]) > 1e-3);  // p = 0 slot still has a gradient
    CHECK(fast.dp[K + K - 1] == 0.0);      // dropped slot
    // finite differences of L = <dO, o>
    check_fd(c, c.p, fast.dp, "dp");
    check_fd(c, c.x, fast.dx, "dx");
    check_fd(c, c.wg, fast.dwg, "dw_gate");
    check_fd(c, c.wu, fast.dwu, "dw_up");
    check_fd(c, c.wd, fast.dwd, "dw_down");
    if (bias) check_fd(c, c.bd, fast.dbd, "db_down");
    double const h = 1e-6, b1 = c.act.beta1, b2 = c.act.beta2;
    c.act.beta1 = b1 + h;
    double lp = c.loss();
    c.act.beta1 = b1 - h;
    double lm = c.loss();
    c.act.beta1 = b1;
    CHECK(fast.d_beta1 == doctest::Approx((lp - lm) / (2 * h)).epsilon(1e-6).scale(1.0));
    c.act.beta2 = b2 + h;
    lp = c.loss();
    c.act.beta2 = b2 - h;
    lm = c.loss();
    c.act.beta2 = b2;
    CHECK(fast.d_beta2 == doctest::Approx((lp - lm) / (2 * h)).epsilon(1e-6).scale(1.0));
  }
}

TEST_CASE("expert FFN validates its arguments") {
  ffn_case c(3, 4, 2, 3, 2, true, 5);
  c.idx[1] = 7;
  std::vector<double> o(12), hg(12), hu(12);
  CHECK_THROWS_AS(moe::expert_ffn_forward(k3::cpu::serial{},
                                          c.args(k3::host_view(o.data(), 3, 4), k3::host_view(hg.data(), 3, 2, 2), k3::host_view(hu.data(), 3, 2, 2)),
                                          c.options()),
                  k3::error);
}
