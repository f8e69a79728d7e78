// GPU tests of the KDA pre-processing kernels (k3/kda/cuda/preprocess.cuh) against the CPU
// implementation (k3/kda/preprocess.hpp, itself tested against float64 references and
// finite differences): L2 norm, beta sigmoid, both gates, short conv forward / backward /
// decode, float and bfloat16 storage, batched and varlen. Exits 77 without a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/device_buffer.hpp"
#include "support/error_of.hpp"
#include "k3/kda/cuda/kda.cuh"
#include "k3/kda/preprocess.hpp"

K3_KDA_CUDA_INSTANTIATE(float)
K3_KDA_CUDA_INSTANTIATE(k3::bfloat16)

namespace {

using index_t = std::int64_t;
namespace kc = k3::kda::cuda;
k3::cpu::serial cpu;

template <class S>
std::vector<S> randv(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<S> v(n);
  for (auto& x : v) x = S(static_cast<float>(d(rng)));
  return v;
}

template <class T>
using dbuf = k3::test::device_buffer<T>;

// Elementwise |gpu - cpu| <= rtol |cpu| + atol; bfloat16 results may differ by one rounding.
template <class S>
void check_near(std::vector<S> const& gpu, std::vector<S> const& ref, double rtol, double atol, char const* what) {
  REQUIRE(gpu.size() == ref.size());
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    double const a = static_cast<float>(gpu[i]), b = static_cast<float>(ref[i]);
    double const e = std::fabs(a - b) / (atol + rtol * std::fabs(b));
    if (!(e <= worst)) worst = e, at = i;
  }
  INFO(what << ": worst at " << at);
  CHECK(worst <= 1.0);
}

template <class S>
constexpr double rtol_of() {
  return std::is_same_v<S, float> ? 2e-5 : 1.6e-2;  // bfloat16: one rounding step (2^-7) plus slack
}

}  // namespace

TEST_CASE_TEMPLATE("l2norm and beta sigmoid on the GPU match the CPU", S, float, k3::bfloat16) {
  for (index_t D : {1, 60, 128, 130}) {
    index_t const rows = 37;
    auto x = randv<S>(static_cast<std::size_t>(rows * D), 1 + D, 2.0);
    // Every third row so large that its fp32 sum of squares overflows (the rescaled path),
    // by powers of two that differ between rows.
    for (index_t r = 1; r < rows; r += 3)
      for (index_t d = 0; d < D; ++d) {
        auto& e = x[static_cast<std::size_t>(r * D + d)];
        e = S(std::ldexp(static_cast<float>(e), 64 + static_cast<int>(r % 7)));
      }
    auto dy = randv<S>(x.size(), 2 + D);
    std::vector<S> y(x.size()), dx(x.size());
    k3::kda::l2norm(cpu, k3::kda::l2norm_args<S, 2>{.x = k3::host_view(x.data(), rows, D), .y = k3::host_view(y.data(), rows, D)});
    k3::kda::l2norm_backward(cpu, k3::kda::l2norm_backward_args<S, 2>{.x = k3::host_view(x.data(), rows, D), .d_y = k3::host_view(dy.data(), rows, D),
                                                                      .d_x = k3::host_view(dx.data(), rows, D)});
    dbuf<S> gx(x), gdy(dy), gy(x.size()), gdx(x.size());
    kc::l2norm_fwd(gx.p, gy.p, rows, D, nullptr);
    kc::l2norm_bwd(gx.p, gdy.p, gdx.p, rows, D, nullptr);
    check_near(gy.get(), y, rtol_of<S>(), 1e-6, "l2norm");
    check_near(gdx.get(), dx, rtol_of<S>(), 1e-5, "l2norm backward");
  }
  for (bool neg : {false, true}) {
    index_t const n = 1000;
    auto x = randv<S>(n, 5, 4.0);
    auto dy = randv<S>(n, 6);
    std::vector<S> b(n), dx(n);
    k3::kda::beta_sigmoid(cpu, k3::kda::beta_sigmoid_args<S, 1>{.x = k3::host_view(x.data(), n), .beta = k3::host_view(b.data(), n)},
                          {.allow_neg_eigval = neg});
    k3::kda::beta_sigmoid_backward(cpu,
                                   k3::kda::beta_sigmoid_backward_args<S, 1>{.x = k3::host_view(x.data(), n), .d_beta = k3::host_view(dy.data(), n),
                                                                             .d_x = k3::host_view(dx.data(), n)},
                                   {.allow_neg_eigval = neg});
    dbuf<S> gx(x), gdy(dy), gb(n), gdx(n);
    kc::beta_sigmoid_fwd(gx.p, gb.p, n, neg, nullptr);
    kc::beta_sigmoid_bwd(gx.p, gdy.p, gdx.p, n, neg, nullptr);
    check_near(gb.get(), b, rtol_of<S>(), 1e-7, "beta");
    check_near(gdx.get(), dx, rtol_of<S>(), 1e-7, "beta backward");
  }
}

TEST_CASE_TEMPLATE("gates on the GPU match the CPU, parameter gradients included", S, float, k3::bfloat16) {
  index_t const B = 2, T = 150, HV = 3, K = 20;
  std::size_t const n = static_cast<std::size_t>(B * T * HV * K);
  auto x = randv<S>(n, 11, 2.0);
  auto dg = randv<S>(n, 12);
  auto A = randv<float>(HV, 13, 0.5);
  auto bias = randv<float>(static_cast<std::size_t>(HV * K), 14, 0.5);
  dbuf<S> gx(x), gdg(dg), gg(n), gdx(n);
  dbuf<float> gA(A), gbias(bias), gdA(HV), gdb(bias.size());
  for (bool lower : {false, true})
    for (bool params : {false, true}) {
      CAPTURE(lower);
      CAPTURE(params);
      float const lb = -5.0f;
      std::vector<S> g(n), dx(n);
      std::vector<float> dA(HV), db(bias.size());
      auto xv = k3::host_view(x.data(), B, T, HV, K);
      auto dgv = k3::host_view(dg.data(), B, T, HV, K);
      auto gv = k3::host_view(g.data(), B, T, HV, K);
      auto dxv = k3::host_view(dx.data(), B, T, HV, K);
      auto Av = k3::host_view(A.data(), HV);
      auto bv = k3::host_view(bias.data(), HV, K);
      auto dAv = k3::host_view(dA.data(), HV);
      auto dbv = k3::host_view(db.data(), HV, K);
      // Without params the A_log and dt_bias members stay absent (default-constructed).
      k3::kda::gate_args<S, float> fa{.x = xv, .g = gv};
      k3::kda::gate_backward_args<S, float> ba{.x = xv, .d_g = dgv, .d_x = dxv, .d_A_log = dAv, .d_dt_bias = dbv};
      if (params) {
        fa.A_log = ba.A_log = Av;
        fa.dt_bias = ba.dt_bias = bv;
      }
      if (lower) {
        k3::kda::gate_lower_bound(cpu, fa, {.lower_bound = lb});
        k3::kda::gate_lower_bound_backward(cpu, ba, {.lower_bound = lb});
      } else {
        k3::kda::gate_softplus(cpu, fa);
        k3::kda::gate_softplus_backward(cpu, ba);
      }
      kc::gate_params p;
      p.kind = lower ? kc::gate_kind::lower_bound : kc::gate_kind::softplus;
      p.A_log = params ? gA.p : nullptr;
      p.dt_bias = params ? gbias.p : nullptr;
      p.lower_bound = lb;
      p.rows = B * T, p.HV = HV, p.K = K;
      kc::gate_fwd(p, gx.p, gg.p, nullptr);
      kc::gate_bwd(p, gx.p, gdg.p, gdx.p, gdA.p, gdb.p, nullptr);
      check_near(gg.get(), g, rtol_of<S>(), 1e-30, "g");
      check_near(gdx.get(), dx, rtol_of<S>(), 1e-30, "dx");
      // sums over 300 tokens: fp32 atomics against the CPU's blocked double sums
      check_near(gdA.get(), dA, 1e-4, 1e-4, "dA_log");
      check_near(gdb.get(), db, 1e-4, 1e-4, "ddt_bias");
    }
  kc::gate_params bad;
  bad.kind = kc::gate_kind::lower_bound;
  bad.lower_bound = 0.0f;
  bad.rows = 1, bad.HV = 1, bad.K = 1;
  CHECK_THROWS_WITH_AS(kc::gate_fwd(bad, gx.p, gg.p, nullptr), doctest::Contains("'lower_bound'"), k3::error);
}

TEST_CASE_TEMPLATE("short conv on the GPU matches the CPU: batched, varlen, states, backward", S, float, k3::bfloat16) {
  index_t const C = 10, W = 4;
  auto w = randv<float>(static_cast<std::size_t>(C * W), 21, 0.6);
  auto bias = randv<float>(C, 22, 0.3);
  dbuf<float> gw(w), gbias(bias);
  for (bool varlen : {false, true})
    for (bool with_init : {false, true})
      for (bool silu : {true, false}) {
        CAPTURE(varlen);
        CAPTURE(with_init);
        CAPTURE(silu);
        std::vector<std::int64_t> cu = {0, 0, 1, 3, 70, 70, 200};
        index_t const B = varlen ? 1 : 3, T = varlen ? 200 : 50;
        index_t const N = varlen ? static_cast<index_t>(cu.size()) - 1 : B;
        auto x = randv<S>(static_cast<std::size_t>(B * T * C), 23);
        auto dy = randv<S>(x.size(), 24);
        auto init = randv<float>(static_cast<std::size_t>(N * C * (W - 1)), 25);
        std::vector<S> y(x.size()), dx(x.size());
        std::vector<float> fs(init.size()), dw(w.size()), db(C), di(init.size());
        auto xv = k3::host_view(x.data(), B, T, C);
        auto wv = k3::host_view(w.data(), C, W);
        auto bv = k3::host_view(bias.data(), C);
        auto iv = k3::host_view(init.data(), N, C, W - 1);
        auto cuv = k3::host_view(cu.data(), static_cast<index_t>(cu.size()));
        auto yv = k3::host_view(y.data(), B, T, C);
        auto fv = k3::host_view(fs.data(), N, C, W - 1);
        auto dyv = k3::host_view(dy.data(), B, T, C);
        auto dxv = k3::host_view(dx.data(), B, T, C);
        auto dwv = k3::host_view(dw.data(), C, W);
        auto dbv = k3::host_view(db.data(), C);
        auto div = k3::host_view(di.data(), N, C, W - 1);
        // bfloat16 or float activations with fp32 weights and states.
        k3::kda::short_conv_args<S, float> fa{.x = xv, .weight = wv, .bias = bv, .y = yv, .final_state = fv};
        k3::kda::short_conv_backward_args<S, float> ba{.x = xv, .weight = wv, .bias = bv, .d_y = dyv, .d_x = dxv, .d_weight = dwv, .d_bias = dbv};
        if (with_init) {
          fa.initial_state = ba.initial_state = iv;
          ba.d_initial_state = div;
        }
        k3::kda::short_conv_options opt{.silu = silu};
        if (varlen) opt.cu_seqlens = cuv;
        k3::kda::short_conv(cpu, fa, opt);
        k3::kda::short_conv_backward(cpu, ba, opt);
        dbuf<S> gx(x), gdy(dy), gy(x.size()), gdx(x.size());
        dbuf<float> ginit(init), gfs(init.size()), gdw(w.size()), gdb(C), gdi(init.size());
        dbuf<std::int64_t> gcu(cu);
        kc::conv_params p;
        p.B = B, p.T = T, p.C = C, p.W = W, p.weight = gw.p, p.bias = gbias.p, p.silu = silu;
        if (varlen) p.cu_seqlens = gcu.p, p.cu_seqlens_host = cu.data(), p.N = N;
        float const* init_p = with_init ? ginit.p : nullptr;
        kc::short_conv_fwd(p, gx.p, gy.p, init_p, gfs.p, nullptr);
        kc::short_conv_bwd(p, gx.p, gdy.p, gdx.p, gdw.p, gdb.p, init_p, with_init ? gdi.p : nullptr, nullptr);
        check_near(gy.get(), y, rtol_of<S>(), 1e-5, "y");
        check_near(gfs.get(), fs, 0.0, 0.0 + 1e-30, "final state (copies of inputs: exact)");
        check_near(gdx.get(), dx, rtol_of<S>(), 1e-5, "dx");
        check_near(gdw.get(), dw, 1e-4, 1e-4, "dweight");
        check_near(gdb.get(), db, 1e-4, 1e-4, "dbias");
        if (with_init) check_near(gdi.get(), di, 1e-5, 1e-6, "d_initial_state");
      }
}

TEST_CASE("short conv decode on a GPU pool matches the CPU decode, padding slots are skipped") {
  index_t const C = 12, W = 4, N = 3, P = 6;
  auto w = randv<float>(static_cast<std::size_t>(C * W), 31);
  auto pool = randv<float>(static_cast<std::size_t>(P * C * (W - 1)), 32);
  std::vector<std::int64_t> slots = {4, -1, 1};
  dbuf<float> gw(w), gpool(pool);
  dbuf<std::int64_t> gslots(slots);
  auto cpu_pool = pool;
  for (int step = 0; step < 5; ++step) {
    auto x = randv<float>(static_cast<std::size_t>(N * C), 40 + step);
    std::vector<float> y0(x.size(), 7.0f);
    dbuf<float> gx(x), gy(y0);
    kc::conv_params p;
    p.C = C, p.W = W, p.weight = gw.p;
    kc::short_conv_decode(p, gx.p, gy.p, N, gpool.p, P, gslots.p, nullptr);
    auto const y = gy.get();
    for (index_t n = 0; n < N; ++n) {
      if (slots[n] < 0) {
        for (index_t c = 0; c < C; ++c) REQUIRE(y[n * C + c] == 7.0f);
        continue;
      }
      std::vector<float> yc(C);
      std::int64_t s1[1] = {slots[n]};
      k3::kda::short_conv_decode(cpu, k3::kda::short_conv_decode_args<float>{.x = k3::host_view(x.data() + n * C, 1, C), .weight = k3::host_view(w.data(), C, W),
                                                                             .conv_state = k3::host_view(cpu_pool.data(), P, C, W - 1),
                                                                             .y = k3::host_view(yc.data(), 1, C), .slots64 = k3::host_view(s1, 1)});
      check_near(std::vector<float>(y.begin() + n * C, y.begin() + (n + 1) * C), yc, 2e-5, 1e-6, "decode y");
    }
  }
  CHECK(gpool.get() == cpu_pool);  // the pool holds raw inputs: bit-identical, padding slot untouched
}

TEST_CASE("pre-processing launchers reject an output over an input or another output, naming both, before any launch") {
  // The checks read only the pointers: host memory stands in for device memory here.
  namespace kc = k3::kda::cuda;
  std::vector<float> mem(16 * 256);
  auto at = [&](int i) { return mem.data() + 256 * i; };
  auto err = [](auto&& fn) { return k3::test::error_of(fn); };
  auto const names = k3::test::names_overlap;
  CHECK(names(err([&] { kc::l2norm_fwd<float>(at(0), at(0) + 3, 4, 8, nullptr); }), "y", "x"));
  CHECK(names(err([&] { kc::l2norm_bwd<float>(at(0), at(1), at(1), 4, 8, nullptr); }), "dx", "dy"));
  CHECK(names(err([&] { kc::beta_sigmoid_fwd<float>(at(0), at(0) + 10, 16, false, nullptr); }), "beta", "x"));
  CHECK(names(err([&] { kc::beta_sigmoid_bwd<float>(at(0), at(1), at(1) + 8, 16, false, nullptr); }), "dx", "dbeta"));
  kc::gate_params gp;
  gp.rows = 4, gp.HV = 2, gp.K = 8;
  gp.A_log = at(2), gp.dt_bias = at(3);
  CHECK(names(err([&] { kc::gate_fwd<float>(gp, at(0), at(3) - 10, nullptr); }), "g", "dt_bias"));
  CHECK(names(err([&] { kc::gate_bwd<float>(gp, at(0), at(1), at(4), at(4) + 5, nullptr, nullptr); }), "dx", "dA_log"));
  CHECK(names(err([&] { kc::gate_bwd<float>(gp, at(0), at(1), at(4), nullptr, at(2), nullptr); }), "ddt_bias", "A_log"));
  kc::conv_params cp;
  cp.B = 1, cp.T = 5, cp.C = 4, cp.W = 4;
  cp.weight = at(2), cp.bias = at(3);
  CHECK(names(err([&] { kc::short_conv_fwd<float>(cp, at(0), at(2) + 1, nullptr, nullptr, nullptr); }), "y", "weight"));
  CHECK(names(err([&] { kc::short_conv_fwd<float>(cp, at(0), at(1), at(5), at(5) + 2, nullptr); }), "final_state", "initial_state"));
  CHECK(names(err([&] { kc::short_conv_bwd<float>(cp, at(0), at(1), at(4), at(4) + 3, nullptr, nullptr, nullptr, nullptr); }), "dx", "dweight"));
  CHECK(names(err([&] { kc::short_conv_bwd<float>(cp, at(0), at(1), at(4), nullptr, at(3), nullptr, nullptr, nullptr); }), "dbias", "bias"));
  CHECK(names(err([&] { kc::short_conv_decode<float>(cp, at(0), at(6), 2, at(6) + 4, 3, nullptr, nullptr); }), "y", "conv_state"));
}
